"""One setup per backend (:class:`sched_lab.setup.base.Setup`), by the config's ``backend:`` name."""

from __future__ import annotations

from sched_lab.config import ExperimentConfig
from sched_lab.core.errors import ConfigError
from sched_lab.setup.base import Setup
from sched_lab.setup.engine import EngineSetup
from sched_lab.setup.sim import SimSetup

SETUPS: dict[str, type[Setup]] = {
    SimSetup.name: SimSetup,
    EngineSetup.name: EngineSetup,
}


def setup_class(backend: str) -> type[Setup]:
    """The setup class of a ``backend:`` name; ConfigError for an unknown one."""
    if backend not in SETUPS:
        raise ConfigError(f"backend: unknown {backend!r}; known: {', '.join(sorted(SETUPS))}")
    return SETUPS[backend]


def setup_for(cfg: ExperimentConfig) -> Setup:
    """The config's backend, set up from it (cheap: :meth:`Setup.prepare` loads)."""
    return setup_class(cfg.backend)(cfg)
