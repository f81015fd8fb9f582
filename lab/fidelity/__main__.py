"""``python -m lab.fidelity``: the same as ``sched-lab fidelity``."""

import sys

from lab.fidelity import main

sys.exit(main())
