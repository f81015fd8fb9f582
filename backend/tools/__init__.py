"""Command-line tools of the engine: ``python -m sched_lab.backend.tools --help``."""
