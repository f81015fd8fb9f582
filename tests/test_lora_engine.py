"""Multi-LoRA in the engine: the segmented kernels against the torch reference, a mixed batch
against each adapter merged into the base weights, the adapter tool and bad adapters.

Kernels run in Triton's CPU interpreter (tests/triton_setup.py), with tiny shapes.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")

from safetensors.torch import load_file, save_file  # noqa: E402
from triton_setup import (  # before sched_lab: sets TRITON_INTERPRET
    DEVICE,
    HAS_CUDA,
    QWEN3_TINY,
    needs_triton,
)

from sched_lab.backend import lora_kernels as lk  # noqa: E402
from sched_lab.backend.config import ModelConfig  # noqa: E402
from sched_lab.backend.lora import (  # noqa: E402
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoraAdapterError,
    LoraOptions,
    Tiling,
    adapters_in_dir,
    lora_segments,
    max_tiles,
    read_adapter,
    segments_size,
    tensor_name,
)
from sched_lab.backend.runner import ModelRunner, SeqInput  # noqa: E402
from sched_lab.backend.tools.__main__ import main as tools_main  # noqa: E402
from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint  # noqa: E402
from sched_lab.backend.tools.random_lora import write_random_loras  # noqa: E402

pytestmark = needs_triton

# Logits of the mixed batch vs the merged-weight reference, float32 (summation order only).
LOGITS_ATOL = 1e-4


def split_segments(out, slots, tokens):
    """(seg_start, seg_len, order, tile_slot, tile_first, tile_len) of lora_segments' array."""
    m = max_tiles(tokens, slots)
    assert out.shape == (segments_size(tokens, slots),) == (2 * slots + tokens + 3 * m,)
    cuts = [0, *np.cumsum([slots, slots, tokens, m, m, m]).tolist()]
    return [out[lo:hi] for lo, hi in zip(cuts, cuts[1:])]  # numpy or torch views


def test_segments_group_rows_by_slot_with_unadapted_rows_first():
    # seqs: slot 1 (2 tokens), none (1), slot 0 (1), slot 1 (1); padded to 7 rows
    out = lora_segments(np.array([1, -1, 0, 1]), np.array([2, 1, 1, 1]), 3, 7)
    seg_start, seg_len, order, tile_slot, tile_first, tile_len = split_segments(out, 3, 7)
    # rows: 0,1 -> slot 1; 2 -> none; 3 -> slot 0; 4 -> slot 1; 5,6 padding (none)
    assert order.tolist() == [2, 5, 6, 3, 0, 1, 4]
    assert seg_start.tolist() == [3, 4, 7]
    assert seg_len.tolist() == [1, 3, 0]
    # max_tiles(7, 3) = (7 + 15 * 3) // 16 = 3: slot 0's row, slot 1's three, one unused
    assert tile_slot.tolist() == [0, 1, 0]
    assert tile_first.tolist() == [3, 4, 0]
    assert tile_len.tolist() == [1, 3, 0]


def test_a_long_segment_is_cut_into_tiles_of_16_rows():
    # slot 0: a 20-token chunk, slot 1: one decode, 3 padding rows
    out = lora_segments(np.array([0, 1]), np.array([20, 1]), 2, 24)
    seg_start, seg_len, order, tile_slot, tile_first, tile_len = split_segments(out, 2, 24)
    assert order.tolist() == [21, 22, 23, *range(20), 20]
    assert (seg_start.tolist(), seg_len.tolist()) == ([3, 23], [20, 1])
    # max_tiles(24, 2) = (24 + 30) // 16 = 3, all used: rows 0-15, 16-19, 20
    assert tile_slot.tolist() == [0, 0, 1]
    assert tile_first.tolist() == [3, 19, 23]
    assert tile_len.tolist() == [16, 4, 1]


def test_tiles_cover_every_adapted_row_once_within_max_tiles():
    rng = np.random.default_rng(0)
    for _ in range(200):
        slots, n = int(rng.integers(1, 9)), int(rng.integers(1, 12))
        seq_slots = rng.integers(-1, slots, n)
        q = rng.choice([1, 1, 1, 2, 5, 17, 40], n)
        pad = int(q.sum() + rng.integers(0, 20))
        parts = split_segments(lora_segments(seq_slots, q, slots, pad), slots, pad)
        order, tile_slot, tile_first, tile_len = parts[2:]
        want = np.repeat(seq_slots, q)
        covered = []
        for s, first, count in zip(tile_slot, tile_first, tile_len, strict=True):
            assert 0 <= count <= 16
            rows = order[first : first + count]
            assert (want[rows] == s).all()
            covered += rows.tolist()
        assert sorted(covered) == np.flatnonzero(want >= 0).tolist()


# bf16 tl.dot is wrong under the interpreter (tests/test_triton_ops.py): bf16 on the GPU only.
# grid "slots": programs for every slot; "tiles": programs for the step's tiles, with
# 512-feature splits, with 256-feature splits and 16-column expand tiles (one slice each),
# and with the default tiling (1,024 features: no split of the 1,000).
@pytest.mark.parametrize("dtype", [torch.float32] + [torch.bfloat16] * HAS_CUDA)
@pytest.mark.parametrize(
    "grid,tiling,splits",
    [
        ("slots", None, 2),
        ("tiles", Tiling(512), 2),
        ("tiles", Tiling(256, 16, 2), 4),
        ("tiles", Tiling(), 1),
    ],
)
def test_kernels_match_the_torch_reference_over_a_mixed_batch(dtype, grid, tiling, splits):
    gen = torch.Generator().manual_seed(0)
    slots, rank, tokens, fan_in = 3, 16, 40, 1000
    bounds = [0, 32, 48, 64]  # three slices of a fused projection (q, k, v)
    x = (0.05 * torch.randn(tokens, fan_in, generator=gen)).to(DEVICE, dtype)
    a = torch.randn(slots, 3 * rank, fan_in, generator=gen).to(DEVICE, dtype)
    b = torch.randn(slots, bounds[-1], rank, generator=gen).to(DEVICE, dtype)
    scale = torch.tensor([0.5, 2.0, 1.0], device=DEVICE)
    # slot 2: 9 + 1 rows; slot 0: 1 + 18 (two tiles); slot 1: 7; 3 rows unadapted, 1 padding
    seq_slots, q = np.array([2, -1, 0, 2, 1, 0]), np.array([9, 3, 1, 1, 7, 18])
    packed = torch.from_numpy(lora_segments(seq_slots, q, slots, tokens)).to(DEVICE)
    seg_start, seg_len, order, *tiles = split_segments(packed, slots, tokens)
    slot_of = torch.from_numpy(np.repeat(seq_slots, q)).to(DEVICE)
    slot_of = torch.cat([slot_of, torch.full((1,), -1, device=DEVICE)])  # the padding row
    if grid == "slots":
        parts = lk.shrink(x, a, order, seg_start, seg_len)
    else:
        parts = lk.shrink_tiles(x, a, order, *tiles, tiling=tiling)
    assert parts.shape == (splits, tokens, 3 * rank)  # split-K over 1,000 features
    xr_ref = lk.shrink_ref(x, a, slot_of, torch.zeros(tokens, 3 * rank, device=DEVICE))
    unadapted = slot_of < 0
    adapted_sum = parts.sum(0)[~unadapted]
    torch.testing.assert_close(adapted_sum, xr_ref[~unadapted], rtol=1e-2, atol=1e-3)
    y0 = torch.randn(tokens, bounds[-1], generator=gen).to(DEVICE, dtype)
    bounds_d = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    if grid == "slots":
        y = lk.expand(y0.clone(), parts, b, scale, bounds_d, order, seg_start, seg_len)
    else:
        y = lk.expand_tiles(y0.clone(), parts, b, scale, bounds_d, order, *tiles, tiling=tiling)
    y_ref = lk.expand_ref(y0.clone(), xr_ref, b, scale, bounds, slot_of)
    tol = 1e-4 if dtype == torch.float32 else 0.1  # bf16: xr rounded before the expand
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=1e-2, atol=tol)
    assert torch.equal(y[unadapted], y0[unadapted])  # rows with no adapter are untouched
    assert (y[~unadapted] != y0[~unadapted]).any()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Qwen3 and two adapters: 'a' (rank 4, every module), 'b' (rank 8, q and v)."""
    root = tmp_path_factory.mktemp("lora")
    model = write_random_checkpoint(QWEN3_TINY, root / "m", dtype="float32", std=0.2)
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    a = write_random_loras(model, root / "a", 1, 4, 8.0, every, seed=1, std=0.2, dtype="float32")
    b = write_random_loras(model, root / "b", 1, 8, 4.0, ("q_proj", "v_proj"), seed=2, std=0.2,
                           dtype="float32")  # fmt: skip
    return model, {"a": a[0], "b": b[0]}


def merged_checkpoint(model, adapter_dir, out):
    """``model`` with the adapter merged: W + scaling * B @ A for every targeted projection."""
    out.mkdir()
    shutil.copy(model / "config.json", out / "config.json")
    weights = load_file(model / "model.safetensors")
    adapter = read_adapter("x", adapter_dir, ModelConfig.from_dir(model), 64, torch.float32)
    for (layer, m), (a, b) in adapter.weights.items():
        block = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        name = f"model.layers.{layer}.{block}.{m}.weight"
        weights[name] = weights[name] + adapter.scaling * (b @ a)
    save_file(weights, out / "model.safetensors")
    return out


PROMPTS = [[5, 17, 99, 3, 42], [7, 7, 200, 1], [250, 0, 31, 64, 8, 9]]


def run_steps(runner, names, which=(0, 1, 2), steps=3):
    """Prefill the PROMPTS in ``which`` (with adapter ``names``) then greedy decodes; each
    step's logits per sequence."""
    seqs = [SeqInput(list(PROMPTS[i]), 0, [4 * i, 4 * i + 1, 4 * i + 2], True, 0.0, lora_name=n)
            for i, n in zip(which, names, strict=True)]  # fmt: skip
    out = []
    for _ in range(steps):
        logits = runner.execute_logits(seqs)
        out.append([t.clone() for t in logits])
        seqs = [
            SeqInput(
                [int(t.argmax())],
                s.start_pos + len(s.token_ids),
                s.block_table,
                True,
                0.0,
                lora_name=s.lora_name,
            )  # fmt: skip
            for s, t in zip(seqs, logits, strict=True)
        ]
    return out


KW = dict(device=str(DEVICE), dtype="float32", attention_backend="torch", block_size=4,
          num_gpu_blocks=12, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)  # fmt: skip
GRAPHS = dict(cuda_graphs=True, cuda_graph_sizes=(4,), cuda_graph_token_sizes=(16,))


def lora_kwargs(backend):
    """ModelRunner arguments: torch runs eager steps; triton the fused kernels and the
    padded CUDA-graph path (uncaptured off CUDA: the LoRA segments go through the graphs'
    static buffer)."""
    return {**KW, "attention_backend": backend, **(GRAPHS if backend == "triton" else {})}


# slots: the kernels' older grid over every slot, run on every step
@pytest.mark.parametrize("backend,grid", [("torch", "tiles"), ("triton", "tiles"),
                                          ("triton", "slots")])  # fmt: skip
def test_mixed_batch_equals_each_adapter_merged(tiny, tmp_path, backend, grid):
    model, adapters = tiny
    kw = KW
    lora_kw = lora_kwargs(backend)
    runner = ModelRunner(model, lora_adapters=adapters, max_loras=2, max_lora_rank=8, **lora_kw)
    if grid == "slots":
        runner.attach_lora(adapters, 2, 8, options=LoraOptions(grid="slots", skip_idle=False))
    assert (runner.graphs is not None) == (backend == "triton")
    mixed = run_steps(runner, ["a", "b", ""])
    for i, name in enumerate(["a", "b", ""]):  # the reference: torch attention, eager
        ref_model = merged_checkpoint(model, adapters[name], tmp_path / name) if name else model
        alone = run_steps(ModelRunner(ref_model, **kw), [""], which=(i,))
        for step, (got, want) in enumerate(zip(mixed, alone, strict=True)):
            torch.testing.assert_close(got[i], want[0], rtol=0, atol=LOGITS_ATOL,
                                       msg=f"seq {i} step {step}")  # fmt: skip
            assert int(got[i].argmax()) == int(want[0].argmax())
    base = run_steps(ModelRunner(model, **kw), ["", "", ""], steps=1)[0]
    assert (mixed[0][0] - base[0]).abs().max() > 0.1  # the adapters change the outputs
    assert (mixed[0][1] - base[1]).abs().max() > 0.1


class CallCounter:
    """Counts calls of the LoRA ops (kernels and torch references) of lora_kernels."""

    NAMES = ("shrink_tiles", "expand_tiles", "shrink", "expand", "shrink_ref", "expand_ref")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in self.NAMES:
            monkeypatch.setattr(lk, name, self._wrap(name, getattr(lk, name)))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)

        return counted


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_step_without_adapters_runs_no_lora_op_and_equals_lora_off(tiny, backend,
                                                                     monkeypatch):  # fmt: skip
    model, adapters = tiny
    plain = run_steps(ModelRunner(model, **lora_kwargs(backend)), ["", "", ""])
    counter = CallCounter(monkeypatch)
    runner = ModelRunner(model, lora_adapters=adapters, max_loras=2, max_lora_rank=8,
                         **lora_kwargs(backend))  # fmt: skip
    graphs = runner.graphs
    if backend == "triton":  # prefill: a mixed graph, then decodes: a decode graph
        assert graphs is not None and graphs.variants() == [True, False]
        base, on_a = SeqInput([1], 0, [0], True), SeqInput([1], 0, [1], True, lora_name="a")
        assert not graphs.lora_variant([base, base])
        assert graphs.lora_variant([base, on_a])

    def run(names, steps=3):
        got = run_steps(runner, names, steps=steps)
        if graphs is not None:
            assert graphs.lora_on == any(names)  # the graph variant replayed
        assert runner.lora.active == any(names)
        return got

    captured = HAS_CUDA and backend == "triton"  # graphs captured at first use, replayed after
    if captured:  # capturing the LoRA variant calls the ops once; replays call no Python op
        run(["", "", ""])
        counter.calls.clear()
    for got, want in zip(run(["", "", ""]), plain, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert counter.calls == []
    run(["", "a", ""], steps=1)
    # 2 layers x 4 fused projections x (shrink, expand): the kernels under the interpreter
    # (on CUDA the LoRA variant's graph replays them)
    assert counter.calls == ([] if captured else ["shrink_tiles", "expand_tiles"] * 8)
    assert run(["", "", ""], steps=1)[0][1].equal(plain[0][1])  # and back
    counter.calls.clear()
    runner.attach_lora(adapters, 2, 8, options=LoraOptions(skip_idle=False))
    assert runner.graphs is None or runner.graphs.variants() == [True]
    graphs = runner.graphs
    assert torch.equal(run_steps(runner, ["", "", ""], steps=1)[0][2], plain[0][2])
    if captured:  # a fresh graph set, captured at first use: the ops ran while capturing
        assert counter.calls and set(counter.calls) == {"shrink_tiles", "expand_tiles"}
    else:  # no segment: y untouched
        assert counter.calls == ["shrink_tiles", "expand_tiles"] * 8
    assert runner.lora.active and (graphs is None or graphs.lora_on)


def test_lora_options_refuse_bad_values_in_one_line():
    with pytest.raises(
        ValueError, match="^lora options: grid must be 'tiles' or 'slots', got 'x'$"
    ):
        LoraOptions(grid="x")
    with pytest.raises(ValueError, match="expand_block_n a power of two >= 16, got 1024 and 48$"):
        Tiling(expand_block_n=48)
    with pytest.raises(ValueError, match="num_warps must be 1, 2, 4, 8 or 16, got 3$"):
        Tiling(num_warps=3)


def test_slots_load_on_demand_and_evict_the_least_recently_used(tiny):
    model, adapters = tiny
    three = {**adapters, "c": adapters["a"]}
    runner = ModelRunner(model, attention_backend="torch", block_size=4, num_gpu_blocks=4,
                         max_model_len=64, lora_adapters=three, max_loras=2)  # fmt: skip
    slots = runner.lora
    assert slots.ensure_loaded(["a", "", "a"]) == {"a": 0}
    assert slots.ensure_loaded(["b"]) == {"b": 1}
    assert slots.ensure_loaded(["a", "c"]) == {"a": 0, "c": 1}  # b was used longest ago
    assert slots.slot_names == ["a", "c"]
    assert float(slots.scale[1]) == 2.0  # c is a: lora_alpha 8 / r 4
    with pytest.raises(ValueError, match="more than max_loras 2"):
        slots.ensure_loaded(["a", "b", "c"])
    with pytest.raises(ValueError, match="unknown adapter 'zz'; loaded: a, b, c"):
        slots.ensure_loaded(["zz"])
    from sched_lab.backend.profile import engine_fingerprint
    from sched_lab.backend.sources import backend_sources_hash

    # the fingerprint names the LoRA kernels' sources: they run with adapters only
    fp = engine_fingerprint(runner)
    assert fp["backend_sources_lora"] == backend_sources_hash(option="lora")
    assert "backend_sources_quantization" not in fp


def test_lora_off_leaves_the_model_as_it_was(tiny):
    model, _ = tiny
    runner = ModelRunner(model, attention_backend="torch", block_size=4, num_gpu_blocks=4,
                         max_model_len=64, lora_adapters={})  # fmt: skip
    assert runner.lora is None
    assert all(layer.self_attn.lora is None and layer.mlp.lora is None
               for layer in runner.model.layers)  # fmt: skip


def test_tool_writes_peft_folders_that_load(tiny, tmp_path, capsys):
    model, _ = tiny
    argv = ["make-random-lora", "--model-dir", str(model), "--out", str(tmp_path / "l"),
            "--count", "2", "--rank", "8", "--alpha", "4", "--targets", "q_proj,down_proj",
            "--dtype", "fp32"]  # fmt: skip
    assert tools_main(argv) == 0
    assert "wrote 2 random rank-8 adapters" in capsys.readouterr().out
    folders = adapters_in_dir(tmp_path / "l", ["lora-0", "lora-1"])
    config = json.loads((folders["lora-1"] / CONFIG_FILE).read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 4.0)
    assert config["target_modules"] == ["q_proj", "down_proj"]
    adapter = read_adapter("lora-1", folders["lora-1"], ModelConfig.from_dir(model), 8,
                           torch.float32)  # fmt: skip
    assert adapter.scaling == 0.5
    a, b = adapter.weights[(1, "down_proj")]
    assert a.shape == (8, 128) and b.shape == (64, 8)  # intermediate 128 -> hidden 64
    assert b.abs().min() > 0
    assert len(adapter.weights) == 2 * 2  # 2 layers x 2 modules
    assert tools_main(argv) == 0  # a folder of random adapters may be overwritten
    # ... and is replaced whole: fewer adapters leave no lora-1 of the earlier write behind
    assert tools_main([*argv[:6], "1", *argv[7:]]) == 0
    assert sorted(p.name for p in (tmp_path / "l").iterdir()) == ["lora-0", "random_lora.json"]
    capsys.readouterr()
    # a rank past the smallest targeted side (q_proj 64 -> 128, down_proj 128 -> 64: 64)
    assert tools_main([*argv[:8], "65", *argv[9:]]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --rank 65: larger than down_proj's smaller side (64); a LoRA of that rank is "
        "no longer low-rank (expected <= the smallest targeted projection's side)"
    )
    assert sorted(p.name for p in (tmp_path / "l").iterdir()) == ["lora-0", "random_lora.json"]


def _one_line(capsys_or_exc) -> str:
    text = str(capsys_or_exc)
    assert "\n" not in text
    return text


@pytest.mark.parametrize(
    "damage,expected",
    [
        ("no_weights", "no adapter_model.safetensors (expected a PEFT adapter folder)"),
        ("rank", "r=8 exceeds max_lora_rank 4"),
        ("target", "target module 'lm_head' is not supported; expected some of q_proj"),
        ("shape", "has shape [8, 32], expected [8, 64]"),
    ],
)
def test_bad_adapters_are_one_line_naming_the_folder(tiny, tmp_path, damage, expected):
    model, adapters = tiny
    folder = tmp_path / "bad"
    shutil.copytree(adapters["b"], folder)  # rank 8, q_proj and v_proj
    max_rank = 4 if damage == "rank" else 16
    if damage == "no_weights":
        (folder / WEIGHTS_FILE).unlink()
    elif damage == "target":
        cfg = json.loads((folder / CONFIG_FILE).read_text())
        (folder / CONFIG_FILE).write_text(json.dumps({**cfg, "target_modules": ["lm_head"]}))
    elif damage == "shape":
        tensors = load_file(folder / WEIGHTS_FILE)
        name = tensor_name(1, "q_proj", "A")
        tensors[name] = tensors[name][:, :32].contiguous()
        save_file(tensors, folder / WEIGHTS_FILE)
    with pytest.raises(LoraAdapterError) as e:
        ModelRunner(model, attention_backend="torch", block_size=4, num_gpu_blocks=4,
                    max_model_len=64, lora_adapters={"x": folder}, max_lora_rank=max_rank)  # fmt: skip
    line = _one_line(e.value)
    assert expected in line
    assert str(folder) in line


def test_a_missing_adapter_folder_names_the_dir(tmp_path):
    (tmp_path / "lora-0").mkdir()
    with pytest.raises(LoraAdapterError, match=r"lora.adapter_dir .*: no folder 'lora-1'"):
        adapters_in_dir(tmp_path, ["lora-0", "lora-1"])


def lora_step_main(monkeypatch, *args: str) -> int:
    """benchmarks/lora_step.py's main() in this process, ``args`` its command line: what the
    script prints is its output (its kernels run in this process's Triton interpreter, as
    in a child that inherits TRITON_INTERPRET)."""
    import importlib.util

    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))  # its `from common import ...`
    spec = importlib.util.spec_from_file_location("lora_step", benchmarks / "lora_step.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", ["lora_step.py", *args])
    return script.main()


def test_lora_step_benchmark_dry_run_ab_prints_a_row_per_rank_and_count(tmp_path, monkeypatch,
                                                                        capsys):  # fmt: skip
    assert lora_step_main(
        monkeypatch, "--dry-run", "--ranks", "8", "--adapters", "1,4", "--paths", "old",
        "new:k_per_split=256", "--out", str(tmp_path / "o.json"),
        # one target: both paths' kernels still run (in the Triton interpreter on a CPU), on
        # one module a layer instead of seven
        "--targets", "o_proj",
    ) == 0  # fmt: skip
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 8 |")]
    assert [r[1] for r in rows] == ["0", "1", "4"]  # LoRA on with no adapter, then 1 and 4
    # per path: step ms, x base, LoRA ops ms (GB/s)
    assert all(float(r[3]) > 0 and float(r[6]) > 0 for r in rows)
    assert rows[0][7].startswith("0.000 (0)")  # new: a step without adapters runs no LoRA op
    assert float(rows[0][4].split()[0]) > 0  # old: its kernels run on no segment
    saved = json.loads((tmp_path / "o.json").read_text())
    assert [(r["path"], r["adapters"]) for r in saved["rows"]] == [
        ("old", 0), ("old", 1), ("old", 4),
        ("new:k_per_split=256", 0), ("new:k_per_split=256", 1), ("new:k_per_split=256", 4),
    ]  # fmt: skip


def test_lora_step_benchmark_refuses_an_unknown_path_in_one_line(monkeypatch):
    # SystemExit with a message: Python prints it as the last stderr line and exits 1
    with pytest.raises(SystemExit) as e:
        lora_step_main(monkeypatch, "--dry-run", "--paths", "new:block=3")
    assert e.value.code not in (0, None)
    assert str(e.value.code).startswith("--paths: 'new:block=3': 'block=3'")


def test_the_executor_passes_each_request_adapter_to_its_sequence():
    from sched_lab.backend.engine import EngineExecutor
    from sched_lab.core.plan import SchedulerOutput
    from sched_lab.core.request import Request

    prefill = Request("p", 0.0, 3, 4, [1, 2, 3], lora_name="a")
    decode = Request("d", 0.0, 2, 4, [4, 5], lora_name="b")
    prefill.block_table, decode.block_table = [0], [1]
    decode.num_computed_tokens, decode.output_token_ids = 2, [6]
    plan = SchedulerOutput(prefills={prefill: 3}, decodes=[decode])
    executor = EngineExecutor(runner=None)  # builds inputs only
    assert [s.lora_name for s in executor.step_inputs(plan)] == ["a", "b"]
    assert [s.lora_name for s in executor.async_inputs(plan)[0]] == ["a", "b"]


def test_tensor_parallel_and_speculation_with_lora_are_refused_in_one_line(tiny):
    from types import SimpleNamespace

    from sched_lab.backend.spec_decode import spec_decoder_from
    from sched_lab.backend.tp import TPShard
    from sched_lab.core.errors import ConfigError

    model, adapters = tiny
    with pytest.raises(ConfigError, match="^lora: adapters with tensor parallelism are not"):
        ModelRunner(model, lora_adapters=adapters, tensor_parallel=TPShard(0, 2))
    spec = SimpleNamespace(method="ngram", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="^speculative: speculative decoding with LoRA"):
        spec_decoder_from(spec, SimpleNamespace(lora=object()), 0.0, 0, 4)


@pytest.mark.parametrize(
    "extra,expected",
    [
        ("lora: {num_adapters: 1, adapter_dir: loras}\n", "LoRA adapters (lora:)"),
        ("", "engine.tensor_parallel_size 2"),
    ],
)
def test_a_speculative_policy_the_engine_cannot_run_is_refused_before_any_run(
    tiny, tmp_path, monkeypatch, capsys, extra, expected
):
    """A speculative policy after a plain one, with LoRA or tensor parallelism: refused
    before the model loads, not after the plain run (whose results a refusal then lost)."""
    import run_experiment
    import sched_lab.setup.engine

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(sched_lab.setup.engine, "_runner", loaded)
    monkeypatch.setattr(sched_lab.setup.engine, "TensorParallelRunner", loaded, raising=False)
    model, _ = tiny
    write_random_loras(model, tmp_path / "loras", 1, 4, dtype="float32")
    tp = 2 if not extra else 1
    path = tmp_path / "spec.yaml"
    path.write_text(
        "backend: engine\n"
        "trace: {format: synthetic, num_requests: 2, arrival: {process: poisson, rate: 1},"
        " prompt_len: 8, output_len: 2}\n"
        f"engine: {{model_path: {model}, device: cpu, dtype: float32,"
        f" tensor_parallel_size: {tp}}}\n"
        "kv_cache: {block_size: 4, num_gpu_blocks: 16}\n"
        + extra
        + "speculative: {method: ngram, num_speculative_tokens: 2}\n"
        "policies: [{name: fcfs, label: plain, speculative: null}, {name: fcfs, label: ngram}]\n"
    )
    assert run_experiment.main([str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {path}: policies[1] (ngram): speculative decoding with {expected} is not "
        "implemented on the engine; remove its speculative"
    )


def test_a_draft_of_another_vocabulary_is_refused_before_any_run(tiny, tmp_path, capsys):
    import run_experiment

    model, _ = tiny
    draft = write_random_checkpoint({**QWEN3_TINY, "vocab_size": 100}, tmp_path / "d", "float32")
    path = tmp_path / "draft.yaml"
    path.write_text(
        "backend: engine\n"
        "trace: {format: synthetic, num_requests: 2, arrival: {process: poisson, rate: 1},"
        " prompt_len: 8, output_len: 2}\n"
        f"engine: {{model_path: {model}, device: cpu, dtype: float32}}\n"
        "kv_cache: {block_size: 4, num_gpu_blocks: 16}\n"
        "policies: [{name: fcfs, label: plain}, {name: fcfs, label: draft, speculative:"
        f" {{method: draft, num_speculative_tokens: 2, model: {draft}}}}}]\n"
    )
    assert run_experiment.main([str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "replay" not in captured.err  # refused before the plain run
    err = captured.err.strip()
    assert err.startswith(
        f"error: {path}: policies[1] (draft): speculative.model: expected a draft model with "
        "the target's vocabulary (256 tokens), got '"
    )
    assert err.endswith(" with 100 tokens") and "\n" not in err


def test_kn_weights_on_the_cpu_is_refused_before_the_model_loads(tiny, tmp_path, monkeypatch,
                                                                  capsys):  # fmt: skip
    """``engine.kn_weights: true`` on the CPU is refused in one line (the loader ignored it,
    and the run's fingerprint said kn_weights True)."""
    import run_experiment
    import sched_lab.setup.engine

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(sched_lab.setup.engine, "_runner", loaded)
    model, _ = tiny
    path = tmp_path / "kn.yaml"
    path.write_text(
        "backend: engine\n"
        "trace: {format: synthetic, num_requests: 2, arrival: {process: poisson, rate: 1},"
        " prompt_len: 8, output_len: 2}\n"
        f"engine: {{model_path: {model}, device: cpu, dtype: float32, kn_weights: true}}\n"
        "kv_cache: {block_size: 4, num_gpu_blocks: 16}\npolicies: [fcfs]\n"
    )
    assert run_experiment.main([str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {path}: engine.kn_weights: true is a cuBLAS weight layout, for CUDA only; "
        "engine.device is 'cpu' (remove kn_weights, or run on cuda)"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_graphs_with_lora_equal_eager_as_adapters_move(tiny, dtype):
    model, adapters = tiny
    kw = dict(device="cuda", dtype=dtype, attention_backend="triton", block_size=4,
              num_gpu_blocks=12, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              lora_adapters=adapters, max_loras=2, max_lora_rank=8)  # fmt: skip
    graphs = ModelRunner(model, cuda_graphs=True, cuda_graph_sizes=(4,),
                         cuda_graph_token_sizes=(16,), **kw)  # fmt: skip
    eager = ModelRunner(model, cuda_graphs=False, **kw)
    assert graphs.graphs is not None and graphs.graphs.graphs  # captured, LoRA inside
    tol = 1e-4 if dtype == "float32" else 5e-2
    g = graphs.graphs
    assert set(g.plain_graphs) == set(g.graphs)  # each key also without LoRA ops
    for key, logits in g.outputs.items():  # a decode key's variants share their logits
        if key[0] == "decode":
            assert g.plain_outputs[key].data_ptr() == logits.data_ptr()
    # the same graphs replayed with the adapters on other sequences (slot ids change), and
    # the LoRA-free variant when no sequence has one
    for names in (["a", "b", ""], ["", "a", "b"], ["b", "b", "a"], ["", "", ""]):
        for got, want in zip(run_steps(graphs, names), run_steps(eager, names), strict=True):
            torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=tol, rtol=tol)


def test_a_yaml_lora_section_runs_on_the_engine(tmp_path):
    """The ``lora:`` section wires the engine (lab/setup/engine.py): adapters lora-0 and
    lora-1 read from ``adapter_dir``, one GPU slot. Four requests of one prompt at t = 0:
    A (lora-0), B (lora-1), C (base), D (lora-0). fcfs with max_loras 1 admits A, skips B,
    admits C (no adapter) and D (lora-0 in use), then B once A and D end: 2 loads. Greedy
    tokens depend only on the adapter: A == D, and the adapters move them off the base."""
    from sched_lab.config import validate
    from sched_lab.core.request import Request
    from sched_lab.run.experiment import run_experiment

    model = write_random_checkpoint(QWEN3_TINY, tmp_path / "m", dtype="float32", std=0.2)
    write_random_loras(model, tmp_path / "loras", 2, 8, 32.0, seed=3, std=0.5, dtype="float32")
    cfg = validate({
        "name": "lora_engine",
        "backend": "engine",
        "trace": {"format": "synthetic", "num_requests": 1},  # replaced below
        "engine": {"model_path": str(model), "device": "cpu", "dtype": "float32"},
        "kv_cache": {"block_size": 4, "num_gpu_blocks": 64, "swap_space_gib": 0.001},
        "scheduler": {"max_num_seqs": 8, "max_model_len": 64},
        "lora": {"max_loras": 1, "num_adapters": 2, "max_lora_rank": 8,
                 "adapter_dir": str(tmp_path / "loras")},
        "policies": ["fcfs"],
    })  # fmt: skip
    prompt = [5, 17, 99, 3, 42, 7, 7, 200]
    reqs = [Request(rid, 0.0, 8, 6, list(prompt), lora_name=name)
            for rid, name in (("A", "lora-0"), ("B", "lora-1"), ("C", ""), ("D", "lora-0"))]  # fmt: skip
    run = run_experiment(cfg, False, reqs)[0]
    assert list(run.requests["status"]) == ["finished"] * 4
    assert run.summary["num_lora_loads"] == 2
    out = {r.request_id: list(r.output_token_ids) for r in run.result.requests}
    assert out["A"] == out["D"] and len(out["A"]) == 6
    assert out["A"] != out["C"] and out["B"] != out["C"]
