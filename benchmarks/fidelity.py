"""Sim-vs-real fidelity, held out: ``sched-lab fidelity`` (lab/fidelity.py) from a checkout.

    python benchmarks/fidelity.py --engine --out /tmp/fidelity --archive docs/fidelity/heldout_engine.tar.gz
    python benchmarks/fidelity.py --sim      # docs/fidelity.md from the archive

The protocol is benchmarks/fidelity_heldout.yaml; lab/fidelity.py's docstring says what
each side does.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sched_lab.fidelity import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="python benchmarks/fidelity.py"))
