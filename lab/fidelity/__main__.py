"""``python -m sched_lab.fidelity``: the same as ``sched-lab fidelity``."""

import sys

from sched_lab.fidelity import main

sys.exit(main())
