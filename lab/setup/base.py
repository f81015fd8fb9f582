"""The interface of a backend's setup. A setup module imports heavy packages (torch) only
inside functions.

Call order (lab/run/experiment.py): ``check()``; ``prepare()``; ``check_policy(pol)`` per
policy and ``check_run(...)`` per run; ``prepare_trace(requests)`` per load; per run
``begin_run()``, ``executor(...)`` per replica, ``run_info()``, ``end_run(...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from sched_lab.config import ExperimentConfig, PolicyConfig
from sched_lab.core.plan import Executor
from sched_lab.core.request import Request
from sched_lab.core.scheduler import SchedulerLimits


class Setup:
    """A backend set up from one experiment's config; cheap to construct, :meth:`prepare`
    does the work. Subclasses implement ``prepare``, ``executor``, ``run_info``,
    ``describe`` and ``kv_device``; the other hooks do nothing by default.

    Class attributes:
        name: the ``backend:`` value.
        process_pool: whether sweep points may run in worker processes.
        token_ids: whether prompts need real token ids (made from hash ids).
        cheap_prepare: whether :meth:`prepare` takes milliseconds (a sweep then prepares
            every point to check it before any runs).
    """

    name: ClassVar[str]
    process_pool: ClassVar[bool] = True
    token_ids: ClassVar[bool] = False
    cheap_prepare: ClassVar[bool] = False

    # set by prepare()
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_position: int  # the longest sequence the model takes (positions)

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg

    def check(self) -> None:
        """ConfigError before the trace is read if the backend cannot run (a missing package)."""

    def prepare(self) -> None:
        """Build what every run shares; set ``num_gpu_blocks``, ``num_cpu_blocks`` and
        ``max_position``. UserError (one line) on failure."""
        raise NotImplementedError

    def check_policy(self, pol: PolicyConfig) -> None:
        """ConfigError naming the policy and key if the backend cannot run this entry."""

    def check_run(
        self,
        pol: PolicyConfig,
        limits: SchedulerLimits,
        label: str,
        scale: float,
        num_requests: int | None,
        trace_sha256: str | None,
    ) -> None:
        """ConfigError naming the run if it cannot be made. ``num_requests`` and
        ``trace_sha256`` are None when unknown."""

    def prepare_trace(self, requests: list[Request]) -> None:
        """Make a load's requests fit the backend (mutates them; e.g. prompt token ids)."""

    def executor(
        self,
        pol: PolicyConfig,
        limits: SchedulerLimits,
        label: str,
        scale: float,
        seed: tuple[int, ...] | None = None,
    ) -> Executor:
        """A fresh executor for one replica of one run; ``seed``: the stream of its step-time
        noise (config key ``seeds``; only a backend with simulated steps gets one)."""
        raise NotImplementedError

    def run_info(self) -> dict[str, Any]:
        """Summary key ``cost_model``: ``kind``, ``profile``, ``fingerprint``, ``stale``,
        ``why`` and backend keys. Valid once the run's first executor is made."""
        raise NotImplementedError

    def begin_run(self) -> None:
        """Called before a run's replay."""

    def end_run(self, label: str, num_steps: int) -> None:
        """Called after a run's metrics (logs what the backend noticed)."""

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

    def model_dir(self) -> Path | None:
        """The model's folder (config.json, tokenizer files) when the backend runs one."""
        return None


def async_scheduling(cfg: ExperimentConfig, pol: PolicyConfig) -> bool:
    """Whether a policy entry runs with asynchronous scheduling (its own key wins)."""
    return bool(pol.options.get("async_scheduling", cfg.scheduler.async_scheduling))
