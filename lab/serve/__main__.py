"""``python -m sched_lab.serve CONFIG ...``: the same as ``sched-lab serve``."""

import sys

from sched_lab.serve import main

sys.exit(main(prog="python -m sched_lab.serve"))
