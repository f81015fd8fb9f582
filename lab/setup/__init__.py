"""One setup per backend, looked up by the config's ``backend:`` name (the interface:
:class:`lab.setup.base.Setup`). A new backend is one module beside these and one line in
:data:`SETUPS`."""

from __future__ import annotations

from lab.config import ExperimentConfig
from lab.core.errors import ConfigError
from lab.setup.base import Setup
from lab.setup.engine import EngineSetup
from lab.setup.sim import SimSetup

SETUPS: dict[str, type[Setup]] = {
    SimSetup.name: SimSetup,
    EngineSetup.name: EngineSetup,
}


def setup_class(backend: str) -> type[Setup]:
    """The setup of a ``backend:`` name, for its class facts (no instance, nothing loaded).

    Raises:
        ConfigError: an unknown name (the known ones listed).
    """
    if backend not in SETUPS:
        raise ConfigError(f"backend: unknown {backend!r}; known: {', '.join(sorted(SETUPS))}")
    return SETUPS[backend]


def setup_for(cfg: ExperimentConfig) -> Setup:
    """The config's backend, set up from it (cheap: :meth:`Setup.prepare` loads)."""
    return setup_class(cfg.backend)(cfg)
