"""``sched-lab serve``: an OpenAI-compatible HTTP server over one backend (docs/serving.md).

A top room, like the CLI: it builds on setup, run, config, sim and core; nothing imports it.
aiohttp and prometheus-client (the ``serve`` extra) are imported only inside this package,
after :func:`main` has checked they are installed.
"""

from __future__ import annotations

import importlib.util
import sys

EXTRA_MODULES = ("aiohttp", "prometheus_client")


def main(argv: list[str] | None = None, prog: str = "sched-lab serve") -> int:
    """The command's entry point; one line and status 2 when the extra is missing."""
    missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"error: {prog} needs {' and '.join(missing)}, not installed: "
            "pip install -e '.[serve]' in the lab's folder",
            file=sys.stderr,
        )
        return 2
    from sched_lab.serve.app import main as serve_main

    return serve_main(argv, prog)
