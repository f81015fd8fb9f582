"""Replayed durations: the simulator's steps take an engine run's measured times, in order.

    cost_model: {durations_from: results/engine_run/steps.csv}

Step i takes the duration of the engine's step i (rows of the run's policy and rate_scale)
and its plan is compared with that row (:meth:`ReplayedExecutor.plan_match`); the KV capacity
of the engine run (summary.json beside the steps.csv) replaces the simulator's. A recorded
duration already holds any async overlap, so an async replay takes it with host time 0, and
the run's ``async_scheduling`` (false when missing) must equal the simulator's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sched_lab.core.errors import ConfigError
from sched_lab.core.plan import SchedulerOutput, StepResult
from sched_lab.sim.calibrated import MAX_STEP_S
from sched_lab.sim.cost_model import LaunchedStep

# steps.csv column -> what the plan must hold for it (see :func:`plan_row`)
PLAN_COLUMNS = ("num_prefill_tokens", "num_decode_tokens", "num_seqs", "num_prefills",
                "prefill_context_tokens", "prefill_attention_pairs", "decode_context_tokens",
                "num_preempted", "num_swap_out_blocks", "num_swap_in_blocks")  # fmt: skip
KEY = "cost_model.durations_from"


def plan_row(plan: SchedulerOutput) -> tuple[float, ...]:
    """A plan's values of :data:`PLAN_COLUMNS`, as the replay loop records them."""
    f = plan.features()
    return (
        f.num_prefill_tokens,
        f.num_decodes,
        f.num_seqs,
        f.num_prefills,
        f.prefill_context_tokens,
        f.prefill_attention_pairs,
        f.decode_context_tokens,
        len(plan.preempted),
        len(plan.swap_out),
        len(plan.swap_in),
    )


class ReplayedDurations:
    """An engine run's steps.csv (and summary.json beside it, if any), read once. Raises
    ConfigError (one line naming the file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"{KEY}: {self.path} is not a file (expected a run's steps.csv)")
        try:
            df = pd.read_csv(self.path)
        except (OSError, ValueError, UnicodeDecodeError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"{KEY}: {self.path} is not a readable CSV ({why[:120]})") from None
        need = ("policy", "rate_scale", "duration_s", *PLAN_COLUMNS)
        missing = [c for c in need if c not in df.columns]
        if missing:
            raise ConfigError(
                f"{KEY}: {self.path}: not a steps.csv of a run: missing columns "
                f"{', '.join(missing)}"
            )
        dur = pd.to_numeric(df["duration_s"], errors="coerce").to_numpy(dtype=float)
        # no engine step lasts an hour (calibrated.MAX_STEP_S): such a row is a broken file,
        # and it would put the whole run past 1e30 s (a RuntimeWarning, then every metric huge)
        bad = np.flatnonzero(~(np.isfinite(dur) & (dur > 0) & (dur <= MAX_STEP_S)))
        if len(bad):
            raise ConfigError(
                f"{KEY}: {self.path}: row {bad[0] + 1}, duration_s: expected a number > 0 "
                f"and <= {MAX_STEP_S:g} (seconds), got {str(df['duration_s'].iloc[bad[0]])[:40]!r}"
            )
        df["duration_s"] = dur
        self.steps = df
        summary = self.path.parent / "summary.json"
        self.summary: dict[str, Any] = json.loads(summary.read_text()) if summary.is_file() else {}

    def capacity(self) -> tuple[int, int] | None:
        """(GPU blocks, CPU blocks) of the engine run, or None if its summary does not say."""
        for s in self.summary.values():
            if isinstance(s, dict) and "num_gpu_blocks" in s and "num_cpu_blocks" in s:
                return int(s["num_gpu_blocks"]), int(s["num_cpu_blocks"])
        return None

    def fingerprint(self) -> dict | None:
        """The engine fingerprint its runs recorded (summary key ``cost_model``), if any."""
        for s in self.summary.values():
            if isinstance(s, dict) and isinstance(s.get("cost_model"), dict):
                return s["cost_model"].get("fingerprint")
        return None

    def check_trace(
        self, label: str, sha256: str | None, num_requests: int | None, run_label: str | None = None
    ) -> None:
        """Refuse a replay of another trace or window: the run's ``trace.sha256`` and
        ``num_requests`` must equal this run's, where both are known. Raises ConfigError (one line)."""
        run = self.summary.get(run_label or label) or {}
        recorded = (run.get("trace") or {}).get("sha256")
        if recorded and sha256 and recorded != sha256:
            raise ConfigError(
                f"{KEY}: {self.path}: run {label!r} replayed another trace file (sha256 "
                f"{recorded[:12]}..., this one {sha256[:12]}...)"
            )
        n = run.get("num_prompts", run.get("num_requests"))  # num_requests: older summaries
        if n is not None and num_requests is not None and n != num_requests:
            raise ConfigError(
                f"{KEY}: {self.path}: run {label!r} replayed {n:,} requests, this trace "
                f"window has {num_requests:,} (another window: trace.start_s, end_s or limit?)"
            )

    def executor(
        self,
        label: str,
        rate_scale: float,
        limits: dict[str, Any] | None = None,
        run_label: str | None = None,
        async_scheduling: bool = False,
    ) -> ReplayedExecutor:
        """An executor for policy ``label`` at ``rate_scale`` (``run_label``: the run's key in
        summary.json, default ``label``). Raises ConfigError: no rows for that run, or its recorded
        limits or ``async_scheduling`` differ from ``limits`` or ``async_scheduling``."""
        sel = (self.steps["policy"].astype(str) == label) & np.isclose(
            self.steps["rate_scale"].to_numpy(float), rate_scale, rtol=1e-8, atol=0.0
        )
        rows = self.steps[sel]
        if rows.empty:
            raise ConfigError(
                f"{KEY}: {self.path} has no steps of policy {label!r} at rate_scale "
                f"{rate_scale:g} (it has {', '.join(sorted(set(map(str, self.steps.policy))))})"
            )
        run = self.summary.get(run_label or label) or {}
        recorded = run.get("limits")
        if limits is not None and recorded is not None and recorded != limits:
            raise ConfigError(
                f"{KEY}: {self.path}: run {label!r} was recorded with limits {recorded}, "
                f"the simulator has {limits}"
            )
        recorded_async = bool(run.get("async_scheduling", False))
        if recorded_async != async_scheduling:
            words = {True: "asynchronous", False: "synchronous"}
            raise ConfigError(
                f"{KEY}: {self.path}: run {label!r} was recorded with "
                f"{words[recorded_async]} scheduling, the simulator runs "
                f"{words[async_scheduling]} (scheduler.async_scheduling): recorded durations "
                "hold one mode's overlap"
            )
        return ReplayedExecutor(
            rows["duration_s"].to_numpy(float), rows[list(PLAN_COLUMNS)].to_numpy(float)
        )


class ReplayedExecutor:
    """Steps take the recorded durations in order; each plan is compared with its row."""

    wall_clock = False

    def __init__(self, durations_s: np.ndarray, plans: np.ndarray) -> None:
        self.durations_s, self.plans = durations_s, plans
        self.step = 0
        self.mismatched = 0
        self.first_mismatch: str | None = None

    def execute(self, plan: SchedulerOutput) -> StepResult:
        """The recorded duration of the next step. Raises ConfigError past the recorded steps."""
        i = self.step
        if i >= len(self.durations_s):
            raise ConfigError(
                f"{KEY}: the simulator asks for step {i + 1}; the engine run recorded "
                f"{len(self.durations_s)}"
            )
        got, want = plan_row(plan), self.plans[i]
        # pairs are written with 9 significant digits; the counts are exact
        bad = [
            c
            for c, g, w in zip(PLAN_COLUMNS, got, want, strict=True)
            if not np.isclose(g, w, rtol=1e-8, atol=0.5 if c == "prefill_attention_pairs" else 0)
        ]
        if bad:
            self.mismatched += 1
            if self.first_mismatch is None:
                self.first_mismatch = f"step {i}: " + ", ".join(
                    f"{c} {g:g} (engine {w:g})"
                    for c, g, w in zip(PLAN_COLUMNS, got, want, strict=True)
                    if c in bad
                )
        self.step += 1
        return StepResult(float(self.durations_s[i]))

    def launch(self, plan: SchedulerOutput) -> LaunchedStep:
        """The next recorded step, host time 0; raises as :meth:`execute`."""
        return LaunchedStep(self.execute(plan).duration_s, 0.0)

    def wait(self, handle: LaunchedStep) -> StepResult:
        """The launched step's recorded duration."""
        return StepResult(handle.step_s)

    def plan_match(self) -> dict[str, Any]:
        """(steps recorded, steps simulated, steps whose plan matched, first mismatch or None);
        recorded steps never simulated count as mismatched."""
        recorded, simulated = len(self.durations_s), self.step
        matched = simulated - self.mismatched
        first = self.first_mismatch
        if first is None and simulated < recorded:
            first = f"the simulator ended after {simulated} of {recorded} recorded steps"
        return {
            "steps_recorded": recorded,
            "steps_simulated": simulated,
            "steps_matched": matched,
            "fraction_identical": matched / max(recorded, simulated),
            "first_mismatch": first,
        }
