"""The record of one run (one policy at one load): what the driver returns and the
writers read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from sched_lab.core.events import EventLog
from sched_lab.sim.records import ReplayResult


@dataclass
class Run:
    """One policy at one load."""

    label: str
    policy: str
    rate_scale: float
    result: ReplayResult
    # One row per trace request; once written by ResultsWriter.add, only what the report
    # reads of it (sched_lab.report.folder.report_view)
    requests: pd.DataFrame
    itl_cdf_s: np.ndarray  # ITL at CDF levels linspace(0, 1, len): metrics.cdf_points
    summary: dict[str, Any]
    # The run in the format of vLLM's `vllm bench serve --save-result` (lab/results/vllm_result.py)
    vllm: dict[str, Any] = field(default_factory=dict)
    # ITL tail: (fraction of gaps above, gap in s), shape (2, n): vllm_result.tail_points
    itl_tail_s: np.ndarray | None = None
    # What the plots read of the steps, kept when the steps are released
    # (sched_lab.report.plots.run_series); None: read from ``result.steps``.
    plot_series: dict[str, Any] | None = None

    def release(self) -> None:
        """Free the per-step columns, the decode ticks, the event log and (unless they hold
        output tokens) the request objects, once the run's rows and timelines are written:
        ``result`` becomes a copy with the same keys and zero rows (an empty event log
        where there was one). Only a plain :class:`ReplayResult` of a run without workload
        classes (a cluster's result, or one with classes, is left as it is)."""
        res = self.result
        if type(res) is not ReplayResult or "classes" in self.summary:
            return  # per class and tenant, the plots read token times (the steps' ends)
        keep = any(r.output_token_ids for r in res.requests)
        self.result = dataclasses.replace(
            res,
            requests=res.requests if keep else [],
            steps=res.step_rows(0, 0),
            tick_steps=np.empty(0, np.int64),
            events=None if res.events is None else EventLog(),
        )
