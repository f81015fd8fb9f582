"""Fewer kernels per step, and FlashAttention where it wins: A/B in one run (issue 17, items 3, 5).

    python benchmarks/kernels_step.py --out results/kernels_step            # H200, < 6 min
    python benchmarks/kernels_step.py --out /tmp/ks --tiny                  # CPU logic check

Parts, each in its own process under ``timeout`` (``--part`` runs one in this process):

* ``merge``: the decode attention kernel alone, its split-K merge fused into it vs the
  separate merge kernel (``fused_merge`` True / False), each call captured in a CUDA graph
  and replayed back to back, at batch 1 / 4 / 32 / 64 / 128 x 1k context, Qwen3-0.6B and
  Llama-3.1-8B heads, and the largest difference between the two outputs.
* ``decode``: the engine's decode step (``ModelRunner.execute``, graphs on, sync included)
  with the merge fused (the default rule) vs separate (``triton_kernels.FUSED_MERGE`` off
  while the runner captures), two runners of the same random weights side by side, at
  batch 32 / 64 / 128 x 1k, for both shapes; the step's ratio to the HBM roofline as
  benchmarks/decode_roofline.py computes it ((weights + KV bytes read) / device copy rate,
  measured in the same process); kernels per step = kernels of one decode graph replay
  (torch.profiler), and the graph replayed back to back.
* ``prefill``: causal prefill attention of chunks from position 0, FlashAttention-2's
  varlen (``torch.nn.attention.varlen``) vs the lab's Triton prefill kernel over the paged
  cache, at the issue's shapes (1 x 8192, 4 x 4096, 8 x 1024, 32 x 256 tokens; and 16 x 512) for both
  shapes' heads; then whole eager prefill steps (``mixed_graphs: false``) of Qwen3-0.6B with
  ``prefill_attention`` triton vs flash_varlen, and what ``auto`` picks.

Random weights, bf16, block size 16. Writes ``kernels_step.json`` and ``kernels_step.md``
under ``--out`` (one JSON per part as it ends, so a part that times out keeps the others).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

PARTS = {"merge": 60, "decode": 200, "prefill": 90}  # part -> timeout (s) on the H200
PRESETS = ("qwen3-0.6b", "llama-3.1-8b")
BATCHES = (32, 64, 128)
CONTEXT = 1024
PREFILL_SHAPES = ((1, 8192), (4, 4096), (8, 1024), (16, 512), (32, 256))  # (chunks, tokens)
# --tiny: a CPU check of the logic (Triton interpreter), not a measurement
TINY = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 512,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
}  # fmt: skip


class Bench:
    """Device, dtype and sizes of this run (the H200 or --tiny)."""

    def __init__(self, tiny: bool) -> None:
        import torch

        self.tiny = tiny
        self.torch = torch
        self.device = torch.device("cpu" if tiny else "cuda")
        self.dtype = torch.float32 if tiny else torch.bfloat16
        self.batches = (2, 3) if tiny else BATCHES
        self.context = 40 if tiny else CONTEXT
        self.prefill_shapes = ((1, 96), (3, 40)) if tiny else PREFILL_SHAPES
        self.presets = ("tiny",) if tiny else PRESETS
        self.iters = 2 if tiny else 20

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def time(self, fn, warmup: int = 3) -> float:
        """Median seconds of ``fn()``, synchronized around each call."""
        for _ in range(warmup if not self.tiny else 1):
            fn()
        self.sync()
        times = []
        for _ in range(self.iters):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    def graph_time(self, fn) -> float:
        """Seconds per back-to-back replay of a CUDA graph of ``fn()`` (eager on CPU)."""
        torch = self.torch
        if self.device.type != "cuda":
            return self.time(fn)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.replay_time(graph)

    def replay_time(self, graph) -> float:
        for _ in range(3):
            graph.replay()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(self.iters):
            graph.replay()
        self.sync()
        return (time.perf_counter() - t0) / self.iters

    def config(self, preset: str) -> dict:
        from sched_lab.core.model_presets import PRESETS as ALL

        return TINY if preset == "tiny" else ALL[preset]

    def copy_rate(self) -> float:
        """Device copy rate in bytes/s, read + write counted (benchmarks/common.py)."""
        torch = self.torch
        n = (1 << 20) if self.tiny else (2 << 30)
        a = torch.empty(n, dtype=torch.uint8, device=self.device)
        b = torch.empty_like(a)
        return 2 * n / self.time(lambda: b.copy_(a))

    def runner(self, preset: str, **kwargs):
        """A ModelRunner of ``preset``'s shapes with random weights drawn on the device (no
        checkpoint on disk: the 8B shape loads in seconds): N(0, 0.02), norms 1."""
        import sched_lab.backend.runner as runner_mod
        from sched_lab.backend.model import Transformer
        from sched_lab.backend.rope import rope_table

        def random_model(model_dir, config, backend, device, dtype, max_model_len, kn=False):
            torch = self.torch
            with torch.device("meta"):
                model = Transformer(config, backend)
            model = model.to(dtype=dtype).to_empty(device=device)
            gen = torch.Generator(device).manual_seed(0)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("norm.weight"):
                        p.fill_(1.0)
                    else:
                        p.normal_(0.0, 0.2 if self.tiny else 0.02, generator=gen)
            model.rope_cos, model.rope_sin = rope_table(config, max_model_len, device)
            return model.eval()

        tmp = Path(tempfile.mkdtemp(prefix="kernels_step_"))
        (tmp / "config.json").write_text(json.dumps(self.config(preset)))
        saved = runner_mod.load_model
        runner_mod.load_model = random_model
        try:
            return runner_mod.ModelRunner(
                tmp, device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
                attention_backend="triton", block_size=16, swap_space_bytes=0, **kwargs,
            )  # fmt: skip
        finally:
            runner_mod.load_model = saved


def prompts(chunks: int, length: int) -> list:
    """``chunks`` prompts of ``length`` tokens from position 0, each over its own blocks."""
    from sched_lab.backend.runner import SeqInput

    per = -(-length // 16)
    return [SeqInput([1] * length, 0, list(range(c * per, (c + 1) * per)), True)
            for c in range(chunks)]  # fmt: skip


def heads_of(config: dict) -> tuple[int, int, int]:
    h = config["num_attention_heads"]
    return h, config["num_key_value_heads"], config.get("head_dim", config["hidden_size"] // h)


# -- parts ---------------------------------------------------------------------------------


def part_merge(b: Bench) -> dict:
    """Decode attention alone: fused merge vs the separate merge kernel."""
    import numpy as np

    from sched_lab.backend.attention import triton_kernels as tk
    from sched_lab.backend.attention.base import decode_items, decode_work

    torch, rows = b.torch, []
    for preset in b.presets:
        heads, kv_heads, head_dim = heads_of(b.config(preset))
        for batch in ((1, 4) if not b.tiny else ()) + b.batches:  # 1, 4: the rule's reason
            per_seq = -(-(b.context + 1) // 16)
            blocks = batch * per_seq
            k_cache = torch.randn(blocks, 16, kv_heads, head_dim, device=b.device, dtype=b.dtype)
            v_cache = torch.randn_like(k_cache)
            q = torch.randn(batch, heads, head_dim, device=b.device, dtype=b.dtype)
            out = torch.empty_like(q)
            tables = torch.arange(blocks, dtype=torch.int32, device=b.device).view(batch, -1)
            qstart = torch.arange(batch + 1, dtype=torch.int32, device=b.device)
            lens = torch.full((batch,), b.context + 1, dtype=torch.int32, device=b.device)
            w, loc = decode_work(np.full(batch, b.context + 1), np.arange(batch),
                                 decode_items(batch, kv_heads))  # fmt: skip
            work, loc = torch.from_numpy(w).to(b.device), torch.from_numpy(loc).to(b.device)
            row = {"preset": preset, "batch": batch, "context": b.context,
                   "items": int(w.shape[0])}  # fmt: skip
            outs = []
            args = (q, k_cache, v_cache, out, tables, qstart, lens, work, loc, head_dim**-0.5)
            for name, fused in (("separate_us", False), ("fused_us", True)):
                call = partial(tk.decode_attention, *args, merge=True, fused_merge=fused)
                tk.merge_counters(batch, kv_heads, b.device)  # allocated before any capture
                row[name] = b.graph_time(call) * 1e6
                out.fill_(float("nan"))
                call()
                outs.append(out.float().clone())
            row["fused_vs_separate"] = row["fused_us"] / row["separate_us"]
            row["max_abs_diff"] = float((outs[0] - outs[1]).abs().max())  # nan: a row missed
            rows.append(row)
            print(row, flush=True)
    return {"merge": rows}


def kernels_per_replay(b: Bench, graphs, seqs) -> tuple[int | None, float]:
    """(kernels in one decode-graph replay, seconds per back-to-back replay); None on CPU."""
    size = graphs.size_for(seqs)
    graphs.stage(seqs, size)
    if not graphs.capture:
        return None, float("nan")
    from torch.profiler import ProfilerActivity, profile

    graph = graphs.graphs[("decode", size, size)]
    replay = b.replay_time(graph)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        b.sync()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    kernels = [n for n in names if not n.startswith(("Memcpy", "Memset"))]
    return len(kernels) // 5, replay


def part_decode(b: Bench) -> dict:
    """Decode steps with the merge fused vs separate, same weights, side by side."""
    from common import decode_inputs

    from sched_lab.backend.attention import triton_kernels as tk

    rows, bw = [], b.copy_rate()
    for preset in b.presets:
        cfg = b.config(preset)
        per_seq = -(-(b.context + 1) // 16)
        opts = dict(max_num_seqs=max(b.batches), mixed_graphs=False, max_model_len=2 * b.context,
                    num_gpu_blocks=max(b.batches) * per_seq + 16, cuda_graphs=True,
                    cuda_graph_sizes=b.batches)  # fmt: skip
        runners = {}
        for name, fused in (("separate", False), ("fused", True)):
            tk.FUSED_MERGE = fused  # read at capture: each runner's graphs keep their kernels
            runners[name] = b.runner(preset, **opts)
        tk.FUSED_MERGE = True
        weights = sum(p.numel() * p.element_size() for p in runners["fused"].model.parameters())
        _, kv_heads, head_dim = heads_of(cfg)
        kv_per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * b.dtype.itemsize
        for r in runners.values():  # the same random KV in both (zeros would make V = 0)
            r.kv_cache.gpu.normal_(generator=b.torch.Generator(b.device).manual_seed(1))
        check = decode_inputs(b.batches[0], b.context)  # same weights, same cache: same logits
        logits = [r.execute_logits(check) for r in runners.values()]
        diff = max(float((x - y).abs().max()) for x, y in zip(*logits, strict=True))
        same = all(int(x.argmax()) == int(y.argmax()) for x, y in zip(*logits, strict=True))
        print(f"{preset}: logits fused vs separate max diff {diff:.3g}, argmax equal {same}")
        for batch in b.batches:
            seqs = decode_inputs(batch, b.context)
            roof = (weights + batch * b.context * kv_per_token) / bw
            row = {"preset": preset, "batch": batch, "context": b.context, "roofline_ms": roof * 1e3,
                   "logits_max_diff": diff, "argmax_equal": same}  # fmt: skip
            for _ in range(2):  # A B A B: the better of two
                for name, r in runners.items():
                    t = b.time(lambda r=r, s=seqs: r.execute(s))
                    key = f"{name}_step_ms"
                    row[key] = min(row.get(key, float("inf")), t * 1e3)
            for name, r in runners.items():
                kernels, replay = kernels_per_replay(b, r.graphs, seqs)
                row[f"{name}_kernels"] = kernels
                row[f"{name}_replay_ms"] = replay * 1e3
                row[f"{name}_ratio"] = row[f"{name}_step_ms"] / row["roofline_ms"]
            rows.append(row)
            print(row, flush=True)
        del runners
        if b.device.type == "cuda":
            b.torch.cuda.empty_cache()
    return {"decode": rows, "copy_rate_TBps": bw / 1e12}


def part_prefill(b: Bench) -> dict:
    """varlen vs Triton prefill attention; eager prefill steps triton vs flash_varlen."""
    from sched_lab.backend.attention import flash_varlen
    from sched_lab.backend.attention import triton_kernels as tk
    from sched_lab.backend.attention.base import prefill_tiles

    torch = b.torch
    can = flash_varlen.available(b.device, b.dtype)
    attn_rows, step_rows = [], []
    for preset in b.presets:
        heads, kv_heads, head_dim = heads_of(b.config(preset))
        for chunks, length in b.prefill_shapes:
            tokens = chunks * length
            q = torch.randn(tokens, heads, head_dim, device=b.device, dtype=b.dtype)
            k = torch.randn(tokens, kv_heads, head_dim, device=b.device, dtype=b.dtype)
            v = torch.randn_like(k)
            blocks = -(-tokens // 16)  # chunk c's tokens at slots [c * length, ...)
            k_cache = k.new_zeros(blocks * 16, kv_heads, head_dim)
            k_cache[:tokens] = k
            v_cache = k.new_zeros(blocks * 16, kv_heads, head_dim)
            v_cache[:tokens] = v
            k_cache = k_cache.view(blocks, 16, kv_heads, head_dim)
            v_cache = v_cache.view(blocks, 16, kv_heads, head_dim)
            per = -(-length // 16)
            tables = torch.zeros(chunks, per, dtype=torch.int32, device=b.device)
            for c in range(chunks):  # chunk c starts at token c * length (16 divides lengths)
                tables[c] = torch.arange(per) + c * length // 16
            cu = torch.arange(0, tokens + 1, length, dtype=torch.int32, device=b.device)
            lens = torch.full((chunks,), length, dtype=torch.int32, device=b.device)
            tiles = torch.from_numpy(prefill_tiles([length] * chunks)).to(b.device)
            out = torch.empty_like(q)
            scale = head_dim**-0.5
            row = {"preset": preset, "chunks": chunks, "tokens_each": length,
                   "auto_picks": "flash_varlen" if flash_varlen.choose(
                       "auto", [length] * chunks, [length] * chunks) else "triton"}  # fmt: skip
            tri = partial(tk.prefill_attention, q, k_cache, v_cache, out, tables, cu, lens,
                          tiles, scale)  # fmt: skip
            row["triton_ms"] = 1e3 * b.time(tri)
            if can:
                flash = partial(flash_varlen.varlen_prefill, q, k, v, cu, length, scale)
                row["max_abs_diff"] = float((flash().float() - out.float()).abs().max())
                row["varlen_ms"] = 1e3 * b.time(flash)
                row["varlen_vs_triton"] = row["varlen_ms"] / row["triton_ms"]
            attn_rows.append(row)
            print(row, flush=True)
    # Whole eager prefill steps (no mixed graphs), the first preset's shape.
    preset = b.presets[0]
    modes = ("triton", "flash_varlen") if can else ("triton",)
    longest = max(c * n for c, n in b.prefill_shapes)
    runners = {
        m: b.runner(
            preset,
            prefill_attention=m,
            mixed_graphs=False,
            cuda_graphs=False,
            max_model_len=longest + 16,
            num_gpu_blocks=-(-longest // 16) + 64,
            max_num_batched_tokens=longest,
        )  # fmt: skip
        for m in modes
    }
    for chunks, length in b.prefill_shapes:
        seqs = prompts(chunks, length)
        row = {"preset": preset, "chunks": chunks, "tokens_each": length}
        for m, r in runners.items():
            row[f"{m}_step_ms"] = 1e3 * b.time(lambda r=r, s=seqs: r.execute(s), warmup=2)
        if can:
            row["varlen_vs_triton"] = row["flash_varlen_step_ms"] / row["triton_step_ms"]
        step_rows.append(row)
        print(row, flush=True)
    return {"prefill_attention": attn_rows, "prefill_step": step_rows, "varlen_available": can}


# -- driver -----------------------------------------------------------------------------------


def markdown(results: dict, device: str) -> str:
    lines = [f"# kernels_step, {device}", ""]

    def table(title: str, rows: list[dict]) -> None:
        if not rows:
            return
        keys = list(dict.fromkeys(k for r in rows for k in r))
        lines.extend([f"## {title}", "", "| " + " | ".join(keys) + " |",
                      "|" + "---|" * len(keys)])  # fmt: skip
        for r in rows:
            cells = [f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "-"))
                     for k in keys]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")

    table("Decode attention alone, merge fused vs separate (us per call, graph replay)",
          results.get("merge", []))  # fmt: skip
    table("Decode step, merge fused vs separate (ms; ratio to the HBM roofline; kernels per "
          "graph replay)", results.get("decode", []))  # fmt: skip
    table("Prefill attention, chunks from position 0: varlen vs Triton (ms per layer call)",
          results.get("prefill_attention", []))  # fmt: skip
    table("Eager prefill step: prefill_attention triton vs flash_varlen (ms)",
          results.get("prefill_step", []))  # fmt: skip
    for part, err in results.get("failed", {}).items():
        lines.append(f"- part {part} failed: {err}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="CPU logic check (Triton interpreter)")
    ap.add_argument("--part", choices=sorted(PARTS), help="run one part in this process")
    args = ap.parse_args()
    args.out = args.out.resolve()  # the parts run in benchmarks/
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part:
        if args.tiny:  # the tests' interpreter setup (TRITON_INTERPRET=1 and its patch)
            sys.path.insert(0, str(HERE.parent / "tests"))
            import triton_setup  # noqa: F401
        b = Bench(args.tiny)
        fn = {"merge": part_merge, "decode": part_decode, "prefill": part_prefill}[args.part]
        (args.out / f"part_{args.part}.json").write_text(json.dumps(fn(b), indent=2))
        return
    results: dict = {"failed": {}}
    t_all = time.perf_counter()
    for part, limit in PARTS.items():
        cmd = ["timeout", str(limit * (10 if args.tiny else 1)), sys.executable, __file__,
               "--out", str(args.out), "--part", part] + ["--tiny"] * args.tiny  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True)
        print(f"part {part}: rc {proc.returncode}, {time.perf_counter() - t0:.0f} s", flush=True)
        path = args.out / f"part_{part}.json"
        if proc.returncode == 0 and path.exists():
            results.update(json.loads(path.read_text()))
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            reason = "timeout" if proc.returncode == 124 else " / ".join(tail)
            results["failed"][part] = f"rc {proc.returncode}: {reason}"
            print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n")
    results["total_s"] = time.perf_counter() - t_all
    device = "CPU (--tiny: logic only)" if args.tiny else device_line()
    results["device"] = device
    (args.out / "kernels_step.json").write_text(json.dumps(results, indent=2))
    (args.out / "kernels_step.md").write_text(markdown(results, device))
    print(markdown(results, device))


def device_line() -> str:
    import torch

    p = torch.cuda.get_device_properties(0)
    return f"{p.name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"


if __name__ == "__main__":
    main()
