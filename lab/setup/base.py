"""The interface of a backend's setup: what the experiment driver, the sweeps and the report
ask of a backend, so that none of them compares ``backend`` names.

One subclass per backend (``lab/setup/sim.py``, ``lab/setup/engine.py``), registered by its
``backend:`` name in ``lab/setup/__init__.py``. A setup module imports its backend's heavy
packages (torch, a client library) inside functions: the registry imports every setup
module, and a simulator run never imports torch.

The driver (``lab/run/experiment.py``) calls, in this order:

* ``check()``: before the trace is read; cheap checks (a missing package).
* ``prepare()``: once per experiment; builds the cost model or loads the model, and sets
  ``num_gpu_blocks``, ``num_cpu_blocks`` (KV capacity) and ``max_position``.
* ``check_policy(pol)`` per policy, then ``check_run(...)`` per run, before any replay.
* ``prepare_trace(requests)`` once per load, before its runs.
* per run: ``begin_run()``; ``executor(...)`` once per replica; ``run_info()`` for the
  summary; ``end_run(label, num_steps)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from lab.config import ExperimentConfig, PolicyConfig
from lab.core.plan import Executor
from lab.core.request import Request
from lab.core.scheduler import SchedulerLimits


class Setup:
    """A backend set up from one experiment's config. Constructing one is cheap (no model
    is loaded, no heavy package imported); :meth:`prepare` does the work. A subclass
    implements ``prepare``, ``executor``, ``run_info``, ``describe`` and ``kv_device``; the
    other methods are hooks that do nothing by default.

    Class attributes (facts readable without preparing):
        name: the ``backend:`` value.
        process_pool: whether sweep points of this backend may run in worker processes
            (False: they run one at a time in the driver's process, e.g. one GPU, a model
            loaded once).
        token_ids: whether prompts need real token ids (hash ids become tokens; hash ids
            past a prompt's blocks are then refused with the prefix cache).
    """

    name: ClassVar[str]
    process_pool: ClassVar[bool] = True
    token_ids: ClassVar[bool] = False

    # set by prepare()
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_position: int  # the longest sequence the model takes (positions)

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg

    def check(self) -> None:
        """Fail before the trace is read when the backend cannot run at all.

        Raises:
            ConfigError: one line (e.g. a package to install).
        """

    def prepare(self) -> None:
        """Build what every run of the experiment shares (cost model, loaded model) and set
        the KV capacity and ``max_position``. Called once, after the trace is read.

        Raises:
            UserError: one line (a bad capacity, a missing checkpoint, ...).
        """
        raise NotImplementedError

    def check_policy(self, pol: PolicyConfig) -> None:
        """Fail before any replay when the backend cannot run this policy entry.

        Raises:
            ConfigError: one line naming the policy and the key.
        """

    def check_run(
        self,
        pol: PolicyConfig,
        limits: SchedulerLimits,
        label: str,
        scale: float,
        num_requests: int | None,
        trace_sha256: str | None,
    ) -> None:
        """Fail before any replay when one run (a policy at a load) cannot be made.

        Args:
            num_requests: the requests the run replays (None: not known before).
            trace_sha256: the trace file's sha256 (None: no file).

        Raises:
            ConfigError: one line naming the run.
        """

    def prepare_trace(self, requests: list[Request]) -> None:
        """Make a load's requests fit the backend (mutates them; e.g. prompt token ids)."""

    def executor(
        self, pol: PolicyConfig, limits: SchedulerLimits, label: str, scale: float
    ) -> Executor:
        """A fresh executor for one replica of one run."""
        raise NotImplementedError

    def run_info(self) -> dict[str, Any]:
        """What made the step times (summary key ``cost_model``): ``kind``, ``profile``,
        ``fingerprint``, ``stale``, ``why``, and backend-specific keys. Valid once the run's
        first executor is made."""
        raise NotImplementedError

    def begin_run(self) -> None:
        """Called before a run's replay."""

    def end_run(self, label: str, num_steps: int) -> None:
        """Called after a run's metrics; logs what the backend noticed during the run."""

    def describe(self) -> str:
        """The model and device line of report.md (markdown)."""
        raise NotImplementedError

    def kv_device(self) -> str:
        """Where the KV cache lives, for plot axis labels."""
        raise NotImplementedError

    def model_id(self) -> str:
        """The model as vLLM's ``model_id`` names it."""
        return self.cfg.model

    def text_decoder(self) -> Callable[[list[int]], str] | None:
        """A token-ids -> text function, or None when the backend has no tokenizer."""
        return None


def async_scheduling(cfg: ExperimentConfig, pol: PolicyConfig) -> bool:
    """Whether a policy entry runs with asynchronous scheduling (its own key wins)."""
    return bool(pol.options.get("async_scheduling", cfg.scheduler.async_scheduling))
