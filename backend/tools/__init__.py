"""Command-line tools of the engine: ``python -m backend.tools --help``."""
