"""Step-time noise for the stochastic simulator (``seeds:``; docs/simulator.md, "Bands").

A seeded replica prices a step as the cost model's prediction times a factor drawn once for
the whole replica, times a residual drawn for the step, plus, now and then, a host stall:

    duration = predicted * f[kind] * r + spell(clock) + [u < stall_probability] * stall_s

``f[kind]``, the run factor, is how wrong the model may be on a whole run: a step shape the
fit did not see is predicted off by a few percent, and every step of that shape in a run is
off the same way, so that error does not average out over a run's steps as ``r`` does. Each
replica draws ``f = exp(sigma * z - sigma**2 / 2)``, ``z`` standard normal, one per step kind
(mean 1); ``sigma`` (``run_sigma[kind]``) is the root mean square of log(measured /
held-out prediction) (:func:`fit_noise`'s ``held_out``): for the calibrated model
(``CalibratedCostModel.noise``) over whole calibration replays each left out of the fit,
or, without replays, over the profile's rows of that kind each left out (5-fold); for the
analytic roofline over the profile rows it was fitted to as a whole.

``r`` is drawn from the residuals (measured / predicted) of the profile rows of the step's
kind (``decode``: no prompt tokens; ``prefill``: prompt tokens only; ``mixed``: both) and
size (its tokens: prompt tokens + decodes, in :data:`SIZE_EDGES` buckets), as the inverse
of their empirical distribution function at :data:`LEVELS` (linear between levels),
divided by the mean of that distribution: a draw's mean is the prediction, so a replica does
as much work as the deterministic run on average (residuals are skewed: centred on their
median instead, every replica would run a little slower, which queues near saturation
magnify many times). A bucket's own mean, ``bias``, is kept for the record
only; the point prediction stays the fitted one. A
bucket of fewer than :data:`MIN_ROWS` rows uses its kind's rows, a kind of fewer than that
every row. A row measured at least :data:`STALL_RATIO` times its prediction is a stall, not
a residual: its share of the rows is ``stall_probability`` and the median of its excess
seconds ``stall_s``. Profiles made by ``sched-lab profile`` keep the median of several passes
per row, so their stalls are rare by design; engine steps.csv files given as
``cost_model.replay_steps`` keep every step, stalls included.

``spell(clock)`` is the engine host's slow spells (:class:`Spells`, fitted by
:func:`fit_spells`): the engine's steps run at one of two levels that persist for spells of
a fraction of a second to seconds, the slow one ``slow_s`` seconds longer per step whatever
the step's size (a fixed per-step host cost, not a factor). Each replica carries a two-state
(fast/slow) process in its own clock, the sum of the step times it has priced (its busy
seconds: idle time does not move it): it starts slow with probability ``slow_share``, and
each state lasts an exponential dwell of mean ``fast_dwell_s`` or ``slow_dwell_s``, drawn
from a generator of its own (seeded by the replica's seed and :data:`SPELL_STREAM`, so the
other draws are those of a model without spells, and replica k of every policy has the same
spells at the same busy second). A step priced while fast adds ``-slow_share * slow_s``,
while slow ``(1 - slow_share) * slow_s`` (mean 0 over time: the fit already sits between
the two levels), never taking the step below half its time. Spells are fitted from
calibration replays only (their steps in order); a model fitted to a profile alone has none
(``spells`` None: the profile keeps one median per row, no sequence).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from sched_lab.core.plan import StepFeatures

KINDS = ("decode", "prefill", "mixed")
SIZE_EDGES = (64, 1024)  # tokens per step: <= 64, 65-1024, > 1024
SIZES = ("small", "medium", "large")
NUM_LEVELS = 21  # quantiles at 0%, 5%, ..., 100%
LEVELS = tuple(np.linspace(0.0, 1.0, NUM_LEVELS).tolist())
MIN_ROWS = 8  # rows a bucket needs for quantiles of its own
STALL_RATIO = 2.0  # a row measured at >= 2x its prediction is a stall
DRAWS = 4096  # uniforms drawn from the generator at once
SPELL_WINDOW = 51  # decode steps in the rolling median that gives a replay's local level
MIN_SPELL_STEPS = 25  # a run of fewer steps at one level is noise, not a spell (merged)
SPELL_STREAM = 0x5BE11  # appended to a replica's seed for its spells' generator


def step_kind(num_prefills: int, num_decodes: int) -> str:
    """``decode`` (no prompt tokens), ``prefill`` (no decodes) or ``mixed``."""
    if not num_prefills:
        return "decode"
    return "mixed" if num_decodes else "prefill"


def size_bucket(num_tokens: int) -> str:
    """The size bucket of a step of ``num_tokens`` (prompt tokens + decodes)."""
    return SIZES[bisect.bisect_left(SIZE_EDGES, num_tokens)]


@dataclass(frozen=True)
class Spells:
    """The engine host's slow spells (module doc): ``slow_s`` seconds a step takes longer in
    the slow state than in the fast one; mean dwell seconds (busy time) of each state;
    ``runs`` replay runs, ``transitions`` state changes and ``seconds`` busy time they were
    fitted from."""

    slow_s: float
    fast_dwell_s: float
    slow_dwell_s: float
    fast_level_s: float = 0.0  # the fast state's level (measured - predicted), for states()
    runs: int = 0
    transitions: int = 0
    seconds: float = 0.0

    @property
    def slow_share(self) -> float:
        """The long-run share of time in the slow state."""
        return self.slow_dwell_s / (self.fast_dwell_s + self.slow_dwell_s)

    def states(self, measured, predicted, decode) -> np.ndarray:
        """A replay run's state per step (True: slow), as :func:`fit_spells` labels it."""
        level = local_levels(measured, predicted, decode)
        if not len(level) or not np.isfinite(level).all():
            return np.zeros(len(level), bool)
        return merge_short(level > self.fast_level_s + self.slow_s / 2)

    def offsets(self, slow: np.ndarray) -> np.ndarray:
        """Seconds each state adds to a step (module doc): centred, mean 0 over time."""
        p = self.slow_share
        return np.where(slow, (1.0 - p) * self.slow_s, -p * self.slow_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "slow_ms": round(self.slow_s * 1e3, 4),
            "fast_dwell_s": round(self.fast_dwell_s, 4),
            "slow_dwell_s": round(self.slow_dwell_s, 4),
            "slow_share": round(self.slow_share, 4),
            "runs": self.runs,
            "transitions": self.transitions,
            "seconds": round(self.seconds, 2),
        }


def local_levels(measured, predicted, decode, window: int = SPELL_WINDOW) -> np.ndarray:
    """Each step's local level in seconds: the centred rolling median of measured -
    predicted over ``window`` decode-only steps (``decode`` True), carried to the steps
    between them (steady decodes show the level best: prompt steps' residuals are the fit's
    own). NaN everywhere for a run without decode steps."""
    import pandas as pd

    e = np.where(np.asarray(decode, bool), np.asarray(measured, float) - predicted, np.nan)
    s = pd.Series(e).rolling(window, center=True, min_periods=max(1, window // 4)).median()
    return s.ffill().bfill().to_numpy(float)


def merge_short(slow: np.ndarray, min_steps: int = MIN_SPELL_STEPS) -> np.ndarray:
    """``slow`` (a state per step) with each run of fewer than ``min_steps`` steps given the
    state of the run before it (the first run keeps its own)."""
    out = np.asarray(slow, bool).copy()
    edges = np.flatnonzero(np.diff(out.astype(np.int8))) + 1
    starts, ends = np.r_[0, edges], np.r_[edges, len(out)]
    for a, b in zip(starts[1:], ends[1:]):
        if b - a < min_steps:
            out[a:b] = out[a - 1]
    return out


def fit_spells(runs: Sequence[tuple], min_steps: int = MIN_SPELL_STEPS) -> Spells | None:
    """The slow spells of replay ``runs``, each ``(measured, predicted, decode)`` arrays of
    its steps in order (seconds, seconds, decode-only). Each step's :func:`local_levels`
    pooled over runs split in two by 1-D 2-means: ``slow_s`` is the gap between the two
    centres. Each run's steps are labelled by the nearer centre (:func:`merge_short`), its
    clock is its cumulative measured seconds; a state's mean dwell is its seconds over the
    changes out of it (exponential dwells, a run's ends censored: the maximum-likelihood
    mean). None (no spells): no run with decode steps, no change of state in any run, or a
    state never left."""
    levels = [local_levels(m, p, d) for m, p, d in runs]
    pooled = np.concatenate([x for x in levels if len(x) and np.isfinite(x).all()] or [[]])
    if len(pooled) < 2 * min_steps:
        return None
    centres = np.quantile(pooled, [0.1, 0.9])
    for _ in range(100):
        slow = np.abs(pooled - centres[1]) < np.abs(pooled - centres[0])
        if slow.all() or not slow.any():
            return None
        new = np.array([pooled[~slow].mean(), pooled[slow].mean()])
        if np.array_equal(new, centres):
            break
        centres = new
    gap, cut = float(centres[1] - centres[0]), float(centres.mean())
    seconds, leaves, used = np.zeros(2), np.zeros(2, int), 0
    for (measured, _, _), level in zip(runs, levels):
        if not len(level) or not np.isfinite(level).all():
            continue
        state = merge_short(level > cut, min_steps).astype(int)
        used += 1
        np.add.at(seconds, state, np.asarray(measured, float))
        change = np.flatnonzero(np.diff(state)) + 1
        np.add.at(leaves, state[change - 1], 1)
    if gap <= 0 or not leaves.all():
        return None
    fast, slow_ = seconds / leaves
    return Spells(gap, float(fast), float(slow_), float(centres[0]), used, int(leaves.sum()),
                  float(seconds.sum()))  # fmt: skip


@dataclass(frozen=True)
class StepNoise:
    """A fitted noise model: ``quantiles[kind/size]`` the residual at each of LEVELS,
    ``rows[kind/size]`` how many rows they came from (its own, its kind's or all),
    ``bias[kind/size]`` the mean of their draws (divided out of the quantiles),
    ``stall_probability`` per step and ``stall_s`` added by a stall."""

    quantiles: dict[str, tuple[float, ...]]
    rows: dict[str, int]
    bias: dict[str, float]
    stall_probability: float
    stall_s: float
    run_sigma: dict[str, float] = field(default_factory=dict)  # per kind; none: no run factor
    spells: Spells | None = None  # the host's slow spells (module doc); None: none

    def to_dict(self) -> dict[str, Any]:
        """Plain types (summary key ``cost_model.noise``): quantiles rounded to 4 digits."""
        return {
            "levels": [round(x, 2) for x in LEVELS],
            "quantiles": {k: [round(x, 4) for x in q] for k, q in self.quantiles.items()},
            "rows": dict(self.rows),
            "bias": {k: round(b, 4) for k, b in self.bias.items()},
            "stall_probability": self.stall_probability,
            "stall_s": self.stall_s,
            "run_sigma": {k: round(v, 4) for k, v in self.run_sigma.items()},
            "spells": None if self.spells is None else self.spells.to_dict(),
        }


def fit_noise(
    kinds: Sequence[str],
    sizes: Sequence[str],
    measured,
    predicted,
    held_out=None,
    stalls: bool = True,
) -> StepNoise:
    """The noise of rows with these step kinds, size buckets, measured and predicted seconds
    (module doc); ``held_out``: each row's prediction by a fit that left it out, for the run
    factor (None: no run factor). ``stalls`` False: rows at >= STALL_RATIO are the model's own
    misses, not host stalls (the analytic roofline prices some prompt rows 2-7x short): they
    are left out of the residuals as stalls are, but no stall is drawn (probability 0).
    Raises ValueError for no rows."""
    measured, predicted = np.asarray(measured, float), np.asarray(predicted, float)
    if not len(measured):
        raise ValueError("fit_noise: no rows")
    ratio = measured / predicted
    stall = ratio >= STALL_RATIO
    excess = (measured - predicted)[stall]
    kinds_a, sizes_a = np.asarray(kinds), np.asarray(sizes)
    calm = ~stall if (~stall).any() else np.ones(len(ratio), bool)

    everything = np.ones(len(ratio), bool)
    quantiles, rows, bias = {}, {}, {}
    for kind in KINDS:
        of_kind = kinds_a == kind
        for size in SIZES:
            own = of_kind & (sizes_a == size)
            pick = next(m for m in (own, of_kind, everything) if (m & calm).sum() >= MIN_ROWS
                        or m is everything)  # fmt: skip
            r = ratio[pick & calm]
            q = np.quantile(r, LEVELS)
            mean = float(draw_mean(q))
            quantiles[f"{kind}/{size}"] = tuple((q / mean).tolist())
            rows[f"{kind}/{size}"] = len(r)
            bias[f"{kind}/{size}"] = mean
    run_sigma = {}
    if held_out is not None:
        log_err = np.log(measured / np.asarray(held_out, float))
        ok = calm & np.isfinite(log_err)
        for kind in KINDS:
            pick = next(m for m in (kinds_a == kind, everything) if (m & ok).sum() >= MIN_ROWS
                        or m is everything)  # fmt: skip
            e = log_err[pick & ok]
            run_sigma[kind] = float(np.sqrt(np.mean(e**2))) if len(e) else 0.0
    if not stalls:
        return StepNoise(quantiles, rows, bias, 0.0, 0.0, run_sigma)
    return StepNoise(
        quantiles,
        rows,
        bias,
        float(stall.mean()),
        float(np.median(excess)) if len(excess) else 0.0,
        run_sigma,
    )


def draw_mean(q) -> float:
    """The mean of a draw from quantiles ``q`` at :data:`LEVELS`, linear between them: the
    trapezoid rule over equal steps."""
    q = np.asarray(q, float)
    return float((q[1:] + q[:-1]).mean() / 2)


def profile_features(df) -> list[StepFeatures]:
    """Each profile row (a frame of ``read_profile``) as StepFeatures; a feature the profile
    has no column for (the LoRA ones of a profile without adapters) is 0."""
    names = [f.name for f in fields(StepFeatures)]
    cols = [df[n].to_numpy() if n in df.columns else [0] * len(df) for n in names]
    return [
        StepFeatures(
            *(float(v) if n == "prefill_attention_pairs" else int(v) for n, v in zip(names, row))
        )  # fmt: skip
        for row in zip(*cols)
    ]


def fit_to_profile(df, predicted, held_out=None, stalls: bool = True) -> StepNoise:
    """:func:`fit_noise` of a profile frame's rows against ``predicted`` (and ``held_out``)
    seconds per row."""
    prefills = df["num_prefills"].to_numpy()
    decodes = df["num_decodes"].to_numpy()
    tokens = df["num_prefill_tokens"].to_numpy() + decodes
    kinds = [step_kind(p, d) for p, d in zip(prefills, decodes)]
    sizes = [size_bucket(int(t)) for t in tokens]
    measured = df["duration_s"].to_numpy(float)
    return fit_noise(kinds, sizes, measured, predicted, held_out, stalls=stalls)


class NoisyCostModel:
    """A cost model whose step times carry a seeded draw of ``noise`` (module doc); every
    other attribute is the wrapped model's (host time: of the noisy step it is given). Deterministic given the seed and the sequence of
    steps priced."""

    #: Each ``step_time`` call draws: the simulator prices every step (no fast-forward).
    deterministic: ClassVar[bool] = False

    def __init__(self, base: Any, noise: StepNoise, seed: Sequence[int]) -> None:
        self.base, self.noise = base, noise
        self._rng = np.random.default_rng(list(seed))
        self._u: list[float] = []
        self._q = noise.quantiles
        self._p, self._stall_s = noise.stall_probability, noise.stall_s
        # the replica's run factors (module doc), drawn first; 1 for a kind without a sigma
        z = self._rng.standard_normal(len(KINDS))
        sig = [noise.run_sigma.get(k, 0.0) for k in KINDS]
        self.run_factor = {k: float(np.exp(s * x - s * s / 2)) for k, s, x in zip(KINDS, sig, z)}
        self._spells = noise.spells
        if self._spells is not None:  # the replica's spells (module doc), a stream of their own
            sp = self._spells
            self._spell_rng = np.random.default_rng([*seed, SPELL_STREAM])
            self._slow = bool(self._spell_rng.random() < sp.slow_share)
            self._clock = 0.0  # busy seconds priced so far
            self._switch_at = self._dwell()
            self._add = (-sp.slow_share * sp.slow_s, (1.0 - sp.slow_share) * sp.slow_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def _uniform(self) -> float:
        if not self._u:
            self._u = self._rng.random(DRAWS).tolist()
            self._u.reverse()
        return self._u.pop()

    def _dwell(self) -> float:
        sp = self._spells
        return float(
            self._spell_rng.exponential(sp.slow_dwell_s if self._slow else sp.fast_dwell_s)
        )

    def spell_s(self, step_s: float) -> float:
        """Seconds the host's state at the replica's clock adds to a step of ``step_s``
        (module doc)."""
        while self._clock >= self._switch_at:
            self._slow = not self._slow
            self._switch_at += self._dwell()
        return max(self._add[self._slow], -step_s / 2)

    def _noisy(self, f: StepFeatures, t: float) -> float:
        tokens = f.num_prefill_tokens + f.num_decodes
        kind = step_kind(f.num_prefills, f.num_decodes)
        q = self._q[f"{kind}/{size_bucket(tokens)}"]
        x = self._uniform() * (NUM_LEVELS - 1)
        i = min(int(x), NUM_LEVELS - 2)
        t *= self.run_factor[kind] * (q[i] + (x - i) * (q[i + 1] - q[i]))
        if self._spells is not None:
            t += self.spell_s(t)
        if self._p and self._uniform() < self._p:
            t += self._stall_s
        if self._spells is not None:
            self._clock += t
        return t

    def step_time(self, f: StepFeatures, block_size: int) -> float:
        """The wrapped model's prediction with one draw of noise."""
        return self._noisy(f, self.base.step_time(f, block_size))
