"""The record of one run (one policy at one load): what the driver returns and the
writers read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from sched_lab.sim.records import ReplayResult


@dataclass
class Run:
    """One policy at one load."""

    label: str
    policy: str
    rate_scale: float
    result: ReplayResult
    requests: pd.DataFrame
    itl_cdf_s: np.ndarray  # ITL at CDF levels linspace(0, 1, len): metrics.cdf_points
    summary: dict[str, Any]
    # The run in the format of vLLM's `vllm bench serve --save-result` (lab/results/vllm_result.py)
    vllm: dict[str, Any] = field(default_factory=dict)
    # ITL tail: (fraction of gaps above, gap in s), shape (2, n): vllm_result.tail_points
    itl_tail_s: np.ndarray | None = None
