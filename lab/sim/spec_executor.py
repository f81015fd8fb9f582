"""Speculative decoding in the simulator: simulated acceptance and the price of verification.

:class:`SpecExecutor` wraps the simulator's executor when ``speculative:`` is on
(lab/core/spec.py). For each decode of ``plan.spec_decodes`` (request r verifying d' drafts) it

* draws the accepted drafts from per-position conditional rates p_1..p_k: draft i is accepted
  when u_i < p_i and the first rejection ends the run. u_i hashes (seed, request id, r's verify
  step n, i), so two policies that schedule the same drafts for a request draw the same
  acceptance (common random numbers);
* fills ``StepResult.num_accepted`` and gives every request that samples a token k placeholder
  ``draft_token_ids`` (the scheduler cuts them to its budget);
* adds the verify tokens' time (:func:`verify_time`) and the proposer's (:func:`draft_time`)
  to the wrapped executor's.

Rates come from ``acceptance_rates`` or an engine run (``acceptance_from: RUN_DIR``,
:data:`RATES_KEY`); ``ngram`` and ``draft`` need one of them (the simulator has no tokens).
``synthetic`` and ``ngram`` proposers cost 0 s; ``draft`` runs k decode steps of the draft model.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from sched_lab.core.errors import ConfigError
from sched_lab.core.plan import SchedulerOutput, StepFeatures, StepResult
from sched_lab.core.request import Request

#: summary.json key (under each run's ``speculative``) holding the conditional per-position
#: acceptance counts that ``acceptance_from`` reads (written by lab/results/spec_metrics.py).
RATES_KEY = "conditional_acceptance_rates"
ACCEPTED_KEY = "num_accepted_tokens_per_pos"
REACHED_KEY = "num_reached_per_pos"
#: Id of a simulated draft token (the simulator has no tokens).
PLACEHOLDER_TOKEN = 0
VERIFY_PRICINGS = ("prefill", "decode")

_MASK = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number
    generators"): a bijection of 64-bit integers."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, request_key: int, step: int, position: int) -> float:
    """A uniform number in [0, 1) determined by (seed, request, verify step, position)."""
    x = _mix64((seed * 0x9E3779B97F4A7C15 + request_key) & _MASK)
    x = _mix64((x + step * 0xD1B54A32D192ED03) & _MASK)
    x = _mix64((x + position * 0x8CB92BA72F3D8DD7 + 1) & _MASK)
    return (x >> 11) * (1.0 / (1 << 53))


def request_key(request_id: str) -> int:
    """A stable 64-bit key of a request id (Python's ``hash`` of a str changes per process)."""
    data = request_id.encode()
    return zlib.crc32(data) << 32 | zlib.adler32(data)


def num_accepted(rates: tuple[float, ...], d: int, seed: int, key: int, step: int) -> int:
    """Drafts accepted out of ``d`` (<= len(rates)) at verify step ``step`` of the request keyed
    ``key``: the prefix of draft i with ``uniform(seed, key, step, i) < rates[i]``."""
    for i in range(d):
        if not uniform(seed, key, step, i) < rates[i]:
            return i
    return d


def expected_tokens(rates: tuple[float, ...], d: int) -> float:
    """Expected tokens a verify of ``d`` drafts yields: 1 + sum_i prod_{j <= i} p_j."""
    total, run = 1.0, 1.0
    for p in rates[:d]:
        run *= p
        total += run
    return total


def check_rates(rates: Any, k: int, where: str) -> tuple[float, ...]:
    """``rates`` as a tuple of k probabilities. Raises ConfigError (one line) otherwise."""
    if not isinstance(rates, (list, tuple)) or len(rates) < k:
        raise ConfigError(f"{where}: expected {k} per-position acceptance rates, got {rates!r}")
    out = []
    for i, p in enumerate(rates[:k]):
        ok = isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p <= 1.0
        if not ok:  # NaN fails the comparison too
            raise ConfigError(f"{where}[{i}]: expected a probability in [0, 1], got {p!r}")
        out.append(float(p))
    return tuple(out)


def measured_rates(run_dir: str | Path, k: int) -> tuple[float, ...]:
    """The conditional acceptance rates an engine run's summary.json measured, pooled over its
    runs: p_i = accepted at position i / verifies that reached position i.

    Raises:
        ConfigError: one line naming the folder.
    """
    where = f"speculative.acceptance_from: {run_dir}"
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except OSError:
        raise ConfigError(
            f"{where}: no summary.json there (expected a results run folder)"
        ) from None
    except ValueError:
        raise ConfigError(f"{where}: summary.json is not JSON") from None
    accepted = [0] * k
    reached = [0] * k
    found = 0
    for run in summary.values() if isinstance(summary, dict) else ():
        spec = run.get("speculative") if isinstance(run, dict) else None
        if not isinstance(spec, dict) or ACCEPTED_KEY not in spec:
            continue
        found += 1
        acc, rea = spec[ACCEPTED_KEY], spec.get(REACHED_KEY, [])
        if len(acc) < k or len(rea) < k:
            raise ConfigError(
                f"{where}: the run measured {len(acc)} draft positions, "
                f"num_speculative_tokens here is {k}"
            )
        for i in range(k):
            accepted[i] += acc[i]
            reached[i] += rea[i]
    if not found:
        raise ConfigError(f"{where}: no run with speculative decoding counts in summary.json")
    if not all(reached):
        i = reached.index(0)
        raise ConfigError(f"{where}: draft position {i + 1} was never verified in that run")
    return tuple(a / r for a, r in zip(accepted, reached))


def acceptance_rates(spec: Any, base_dir: Path = Path(".")) -> tuple[float, ...]:
    """The per-position rates: ``acceptance_rates``, or those measured by ``acceptance_from``.
    Raises ConfigError (one line): neither given, or bad rates."""
    k = spec.num_speculative_tokens
    if spec.acceptance_rates is not None:
        return check_rates(spec.acceptance_rates, k, "speculative.acceptance_rates")
    if spec.acceptance_from is not None:
        path = Path(spec.acceptance_from)
        return measured_rates(path if path.is_absolute() else base_dir / path, k)
    raise ConfigError(
        f"speculative: method {spec.method!r} in the simulator needs acceptance_rates "
        f"[p1..p{k}] or acceptance_from: RUN_DIR (it has no tokens to propose from)"
    )


# ---------------------------------------------------------------------------- pricing
def spec_positions(plan: SchedulerOutput) -> list[tuple[int, int]]:
    """(position of the latest token, d') of each spec decode of ``plan``."""
    tick = plan.decode_tick - 1  # as SchedulerOutput.decode_positions
    return [
        (r.prompt_len + r.join_num_output + tick - r.join_tick, d)
        for r, d in plan.spec_decodes.items()
    ]


def as_prefill_chunks(f: StepFeatures, positions: list[tuple[int, int]]) -> StepFeatures:
    """``f`` with each verify (latest token at position p, d' drafts) moved from the decodes to the
    prompt chunks: n = 1 + d' tokens over p cached ones (n * p + n(n+1)/2 attention pairs)."""
    n_sum = ctx = pairs = 0
    for p, d in positions:
        n = 1 + d
        n_sum += n
        ctx += p
        pairs += n * p + n * (n + 1) // 2
    s = len(positions)
    return replace(
        f,
        num_prefill_tokens=f.num_prefill_tokens + n_sum,
        num_prefills=f.num_prefills + s,
        prefill_context_tokens=f.prefill_context_tokens + ctx,
        prefill_attention_pairs=f.prefill_attention_pairs + pairs,
        num_decodes=f.num_decodes - s,
        decode_context_tokens=f.decode_context_tokens - ctx - s,  # a decode reads p + 1
        num_spec_tokens=0,
        num_spec_decodes=0,
        spec_context_tokens=0,
    )


def verify_time(
    cost_model: Any,
    plan: SchedulerOutput,
    block_size: int,
    pricing: str = "prefill",
) -> float:
    """Seconds of a step whose decodes verify drafts (``plan.spec_decodes``). A cost model with
    ``spec_step_time`` prices it by ``pricing``: ``prefill`` (each verify a prompt chunk,
    :func:`as_prefill_chunks`) or ``decode`` (a decode row of 1 + d' queries); the analytic
    roofline counts the drafts' FLOPs and KV writes, reading the context once per sequence."""
    f = plan.features()
    if pricing == "prefill" and hasattr(cost_model, "spec_step_time"):
        return cost_model.step_time(as_prefill_chunks(f, spec_positions(plan)), block_size)
    if hasattr(cost_model, "spec_step_time"):
        return cost_model.spec_step_time(f, block_size)
    # Analytic: tokens and samples of f count the drafts already; their attention pairs
    # cost what prompt pairs cost.
    pairs = f.prefill_attention_pairs + f.spec_context_tokens
    return cost_model.step_time(replace(f, prefill_attention_pairs=pairs), block_size)


def draft_time(draft_model: Any, num_seqs: int, context_tokens: int, k: int) -> float:
    """Seconds of k draft-model decode steps over ``num_seqs`` sequences holding ``context_tokens``
    tokens in all (each step adds one token per sequence)."""
    if num_seqs == 0:
        return 0.0
    return sum(
        draft_model.step_time(
            StepFeatures(0, 0, 0, 0.0, num_seqs, context_tokens + j * num_seqs, num_seqs, 0), 0
        )
        for j in range(k)
    )


def draft_cost_model(spec: Any, hardware: Any, base_dir: Path = Path(".")) -> Any:
    """The cost model of ``method: draft``'s draft model from ``speculative.model``: a profile CSV
    (calibrated), a model preset name or a checkpoint folder with a config.json (analytic on
    ``hardware``, with lab/sim/analytic_defaults.py's efficiencies)."""
    from sched_lab.sim.analytic_defaults import defaults
    from sched_lab.sim.cost_model import AnalyticCostModel
    from sched_lab.sim.models import MODELS, ModelSpec

    name = spec.model
    if name in MODELS:  # the analytic defaults of that shape (lab/sim/analytic_defaults.py)
        return AnalyticCostModel(MODELS[name], hardware, **defaults(name, hardware.name).values)
    path = Path(name) if Path(name).is_absolute() else base_dir / name
    if path.suffix == ".csv":
        from sched_lab.sim.calibrated import CalibratedCostModel

        return CalibratedCostModel(path)
    config = path / "config.json"
    if config.is_file():
        try:
            shape = ModelSpec.from_config(path.name, json.loads(config.read_text()))
        except (ValueError, KeyError) as e:
            raise ConfigError(f"speculative.model: {config}: not a model config ({e})") from None
        return AnalyticCostModel(shape, hardware, **defaults(shape.name, hardware.name).values)
    raise ConfigError(
        f"speculative.model: for the simulator expected a model preset ({', '.join(MODELS)}), "
        f"a profile CSV or a checkpoint folder with config.json, got {name!r}"
    )


class SpecExecutor:
    """The simulator's executor with speculative decoding.

    Args:
        inner: the wrapped executor; the verify and proposer time is added to its duration.
        cost_model: the target's cost model (``inner``'s).
        k: ``num_speculative_tokens``.
        rates: per-position conditional acceptance rates (k of them).
        seed: the seed of the acceptance draws.
        draft_model: the draft model's cost model (``method: draft``), or None (free proposer).
        verify_pricing: ``prefill`` or ``decode`` (:func:`verify_time`).
    """

    wall_clock = False

    def __init__(
        self,
        inner: Any,
        cost_model: Any,
        block_size: int,
        k: int,
        rates: tuple[float, ...],
        seed: int = 0,
        draft_model: Any = None,
        verify_pricing: str = "prefill",
    ) -> None:
        if verify_pricing not in VERIFY_PRICINGS:
            raise ValueError(
                f"verify_pricing: expected one of {VERIFY_PRICINGS}, got {verify_pricing!r}"
            )
        self.inner, self.cost_model, self.block_size = inner, cost_model, block_size
        self.k, self.rates, self.seed = k, check_rates(rates, k, "acceptance_rates"), seed
        self.draft_model, self.verify_pricing = draft_model, verify_pricing
        self._keys: dict[Request, int] = {}
        self._steps: dict[Request, int] = {}  # verify steps of each request so far

    def execute(self, plan: SchedulerOutput) -> StepResult:
        result = self.inner.execute(plan)
        self._complete(plan, result)
        return result

    def _complete(self, plan: SchedulerOutput, result: StepResult) -> None:
        """Draw acceptance, give proposals and add the verify and draft time to ``result``."""
        spec = plan.spec_decodes
        accepted = result.num_accepted
        extra_tokens = 0
        for r, d in spec.items():
            key = self._keys.get(r)
            if key is None:
                key = self._keys[r] = request_key(r.request_id)
            n = self._steps.get(r, 0)
            self._steps[r] = n + 1
            a = num_accepted(self.rates, d, self.seed, key, n)
            accepted[r] = a
            extra_tokens += a
        if spec:
            f = plan.features()
            base = self.cost_model.step_time(f, self.block_size)
            result.duration_s += (
                verify_time(self.cost_model, plan, self.block_size, self.verify_pricing) - base
            )
        drafts = [PLACEHOLDER_TOKEN] * self.k
        proposing = result.draft_token_ids
        context = plan.decode_context_tokens + len(plan.decodes) + extra_tokens
        for r in plan.decodes:
            proposing[r] = drafts
        for r, n in plan.prefills.items():
            if r.num_computed_tokens + n == r.num_tokens:  # samples its first token
                proposing[r] = drafts
                context += r.num_tokens + 1
        if self.draft_model is not None:
            result.duration_s += draft_time(self.draft_model, len(proposing), context, self.k)


def wrap(
    inner: Any,
    cost_model: Any,
    block_size: int,
    spec: Any,
    hardware: Any,
    base_dir: Path = Path("."),
) -> SpecExecutor:
    """A :class:`SpecExecutor` for a validated ``speculative:`` config. Raises ConfigError: bad or
    missing rates, or a draft model the simulator cannot price."""
    rates = acceptance_rates(spec, base_dir)
    draft = draft_cost_model(spec, hardware, base_dir) if spec.method == "draft" else None
    return SpecExecutor(
        inner, cost_model, block_size, spec.num_speculative_tokens, rates, spec.seed, draft
    )
