"""Run an experiment YAML and write its results folder: ``sched-lab run`` under its old name.

python run_experiment.py experiments/quickstart.yaml [--out DIR] [--limit N]
"""

from __future__ import annotations

import sys

try:
    from sched_lab.cli import run_main
except ModuleNotFoundError as e:  # a checkout imports as sched_lab once installed
    if e.name != "sched_lab":
        raise
    sys.exit("run_experiment.py: sched_lab is not installed: pip install -e . in the checkout")


def main(argv: list[str] | None = None) -> int:
    """``sched-lab run`` with ``argv``; returns the exit status."""
    return run_main(argv, prog="run_experiment.py")


if __name__ == "__main__":
    sys.exit(main())
