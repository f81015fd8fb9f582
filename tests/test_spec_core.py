"""Speculative decoding: the option (lab/core/spec.py, lab/config.py) and the scheduler's
accounting (lab/core/scheduler.py): drafts spend the step's token budget, lookahead KV slots
are held before the step, rejected ones are released after it.

Hand-computed cases use block size 4 and a fake executor that accepts a fixed number of
drafts per request (:class:`FixedAcceptance`); a property test replays random traces with
random acceptances through every policy.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers import bundled_policy_names
from hypothesis import event, given, settings, target
from hypothesis import strategies as st
from test_properties import check_preemptions, expected_status, scenarios_for

from sched_lab.config import load_config, validate
from sched_lab.core.errors import ConfigError
from sched_lab.core.kv import BlockManager, PrefixCachingBlockManager
from sched_lab.core.plan import PreemptionMode, SchedulerOutput, StepResult
from sched_lab.core.request import Request, RequestStatus
from sched_lab.core.scheduler import Scheduler, SchedulerLimits
from sched_lab.core.spec import SpeculativeConfig, draft_vocab_error
from sched_lab.policies import get_policy
from sched_lab.sim.replay import replay

BS = 4
STEP_S = 0.25


def spec(k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig.from_mapping(
        {"method": "synthetic", "num_speculative_tokens": k, "acceptance_rates": [0.5] * k}
    )


class FixedAcceptance:
    """Fake executor: every step takes STEP_S; a spec decode accepts ``accept.get(id, 0)``
    of its drafts (cut to what it verified); every request that samples gets ``k``
    proposals (ids 100, 101, ...) and, as on the engine, sampled token id 7."""

    def __init__(self, k: int = 3, accept: dict[str, int] | None = None) -> None:
        self.k, self.accept = k, accept or {}
        self.plans: list[SchedulerOutput] = []

    def execute(self, plan: SchedulerOutput) -> StepResult:
        self.plans.append(plan)
        res = StepResult(STEP_S)
        for r, d in plan.spec_decodes.items():
            res.num_accepted[r] = min(self.accept.get(r.request_id, 0), d)
        sampling = list(plan.decodes)
        sampling += [
            r for r, n in plan.prefills.items() if r.num_computed_tokens + n == r.num_tokens
        ]
        for r in sampling:
            res.draft_token_ids[r] = list(range(100, 100 + self.k))
            res.sampled_token_ids[r] = 7
        return res


def make(policy: str, gpu: int, *, budget: int = 64, seqs: int = 8, k: int = 3, cpu: int = 8,
         caching: bool = False) -> Scheduler:  # fmt: skip
    bm = (PrefixCachingBlockManager if caching else BlockManager)(gpu, cpu, BS, 0.0)
    return get_policy(policy)(SchedulerLimits(seqs, budget, 1000), bm, speculative=spec(k))


def step(s: Scheduler, ex: FixedAcceptance, t: float) -> SchedulerOutput:
    plan = s.schedule()
    s.check_plan(plan)
    s.update(plan, ex.execute(plan), t)
    return plan


# ------------------------------------------------------------------------- the option
@pytest.mark.parametrize(
    "raw, message",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens: expected an integer >= 1, got 0"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens: expected an integer >= 1, got 2.5"),
        ({"method": "ngram"}, "num_speculative_tokens: expected an integer >= 1 (required)"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "prompt_lookup_min: expected <= prompt_lookup_max 2, got 4"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max: expected an integer >= 1, got 0"),
        ({"method": "synthetic", "num_speculative_tokens": 2, "acceptance_rates": [0.5, 1.5]},
         "acceptance_rates[1]: expected a probability in [0, 1], got 1.5"),
        ({"method": "synthetic", "num_speculative_tokens": 2, "acceptance_rates": [-0.1, 0.5]},
         "acceptance_rates[0]: expected a probability in [0, 1], got -0.1"),
        ({"method": "synthetic", "num_speculative_tokens": 3, "acceptance_rates": [0.5, 0.5]},
         "acceptance_rates: expected a list of 3 probabilities (one per draft), got [0.5, 0.5]"),
        ({"method": "synthetic", "num_speculative_tokens": 2}, "acceptance_rates: expected a list of 2 probabilities (method synthetic)"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method: expected one of ngram, draft, synthetic, got 'medusa'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown key 'k'"),
        ({"method": "draft", "num_speculative_tokens": 2}, "model: expected the draft model's checkpoint folder"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "m"}, "model: only for method draft"),
        ({"method": "synthetic", "num_speculative_tokens": 1, "acceptance_rates": [1], "prompt_lookup_min": 1},
         "prompt_lookup_min: only for method ngram"),
    ],
)  # fmt: skip
def test_bad_speculative_config_gives_one_line(raw, message):
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.from_mapping(raw)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("speculative")


def test_ngram_bounds_default_like_vllm():
    def bounds(**kw):
        c = SpeculativeConfig.from_mapping({"method": "ngram", "num_speculative_tokens": 2, **kw})
        return c.prompt_lookup_min, c.prompt_lookup_max

    assert bounds() == (5, 5)
    assert bounds(prompt_lookup_max=3) == (3, 3)
    assert bounds(prompt_lookup_min=2) == (2, 2)
    assert bounds(prompt_lookup_min=1, prompt_lookup_max=4) == (1, 4)


def test_draft_vocab_message():
    assert draft_vocab_error("d", 49152, 49152) is None
    msg = draft_vocab_error("/m/draft", 32000, 49152)
    assert msg == (
        "speculative.model: expected a draft model with the target's vocabulary "
        "(49152 tokens), got '/m/draft' with 32000 tokens"
    )


def test_config_shared_and_per_policy_and_dumped():
    trace = dict(load_config("experiments/quickstart.yaml").trace.spec)
    raw = {
        "trace": trace,
        "speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
        "policies": [
            "fcfs",
            {"name": "chunked_prefill", "speculative": None},
            {
                "name": "swap",
                "speculative": {"method": "synthetic", "num_speculative_tokens": 2,
                                "acceptance_rates": [0.8, 0.6]},
            },
        ],
    }  # fmt: skip
    cfg = validate(raw)
    shared = SpeculativeConfig("ngram", 3, 4, 4)
    assert cfg.speculative == shared
    assert [p.speculative for p in cfg.policies] == [
        shared,
        None,
        SpeculativeConfig("synthetic", 2, acceptance_rates=(0.8, 0.6)),
    ]
    d = cfg.to_dict()
    assert d["speculative"] == {"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_min": 4, "prompt_lookup_max": 4, "seed": 0}  # fmt: skip
    assert "speculative" not in d["policies"][0] and d["policies"][1]["speculative"] is None
    again = validate(d)
    assert again.policies == cfg.policies and again.speculative == cfg.speculative
    off = validate({"trace": trace}).to_dict()
    assert "speculative" not in off  # speculation off: the dump is as before
    with pytest.raises(ConfigError, match=r"policies\[1\]\.speculative\.num_speculative_tokens"):
        validate({"trace": trace, "policies": ["fcfs", {"name": "fcfs", "label": "b",
                  "speculative": {"method": "ngram", "num_speculative_tokens": -1}}]})  # fmt: skip


def test_partial_policy_block_says_it_replaces_the_shared_one():
    """A policy's speculative: block missing keys of the top-level one is not merged with
    it: the error says so and names the keys it lacks; without a shared block, the plain
    error."""
    trace = {"format": "azure2023"}
    shared = {"method": "ngram", "num_speculative_tokens": 3}
    pols = ["fcfs", {"name": "fcfs", "label": "b", "speculative": {"num_speculative_tokens": 2}}]
    with pytest.raises(ConfigError) as e:
        validate({"trace": trace, "speculative": shared, "policies": pols}, "x.yaml")
    assert str(e.value) == (
        "x.yaml: policies[1].speculative.method: expected one of ngram, draft, synthetic, got "
        "None (policies[1].speculative replaces the top-level speculative: block whole, not "
        "key by key; it lacks method)"
    )
    with pytest.raises(ConfigError) as e:
        validate({"trace": trace, "policies": pols}, "x.yaml")
    assert str(e.value) == (
        "x.yaml: policies[1].speculative.method: expected one of ngram, draft, synthetic, got None"
    )


# ------------------------------------------------------------------------- accounting
def test_decode_with_three_drafts_two_accepted():
    """Prompt 5, block size 4. Step 0 prefills 5 tokens into blocks_for(5 + 1) = 2 blocks and
    samples token 1 (L = 6). Step 1 feeds it plus 3 drafts at positions 5..8 and needs
    blocks_for(6 + 3 + 1) = 3 blocks; 2 drafts accepted: L = 6 + 2 + 1 = 9 tokens, KV for 8,
    ceil(9 / 4) = 3 blocks kept."""
    s = make("fcfs", 8)
    ex = FixedAcceptance(3, {"a": 2})
    r = Request("a", 0.0, 5, 10)
    s.add(r, 0.0)
    p0 = step(s, ex, 0.25)
    assert p0.prefills == {r: 5} and len(r.block_table) == 2
    assert r.spec_token_ids == [100, 101, 102] and r.output_token_ids == [7]
    p1 = s.schedule()
    s.check_plan(p1)
    assert p1.decodes == [r] and p1.spec_decodes == {r: 3}
    assert len(r.block_table) == 3  # lookahead held before the step
    f = p1.features()
    assert (f.num_tokens, f.num_decodes, f.num_spec_tokens, f.num_spec_decodes) == (4, 1, 3, 1)
    assert f.num_samples == 4  # 1 + 3 verified positions
    assert f.decode_context_tokens == 6 and f.spec_context_tokens == 7 + 8 + 9
    (seq,) = p1.seqs()
    assert (seq.start_pos, seq.num_new_tokens, seq.num_draft_tokens) == (5, 4, 3)
    s.update(p1, ex.execute(p1), 0.5)
    assert r.output_token_ids == [7, 100, 101, 7]  # 2 accepted drafts, then the sampled one
    assert s.num_computed_tokens(r) == 8 and s.decode_set.num_tokens(r) == 9
    assert len(r.block_table) == 3 and r.spec_steps == [(1, 3, 2)]
    assert s.block_manager.num_free_gpu_blocks == 5


def test_rejected_drafts_free_their_block():
    """L = 6 with 3 drafts holds 3 blocks during the step; none accepted: L = 7, KV for 6,
    ceil(7 / 4) = 2 blocks, so the lookahead block goes back."""
    s = make("fcfs", 8)
    ex = FixedAcceptance(3, {"a": 0})
    r = Request("a", 0.0, 5, 10)
    s.add(r, 0.0)
    step(s, ex, 0.25)
    p1 = step(s, ex, 0.5)
    assert p1.spec_decodes == {r: 3}
    assert len(r.block_table) == 2 and s.block_manager.num_free_gpu_blocks == 6
    assert s.num_computed_tokens(r) == 6 and s.decode_set.num_tokens(r) == 7
    assert r.spec_steps == [(1, 3, 0)]


def test_budget_cut_in_running_order_and_output_len():
    """chunked_prefill, budget 7, k = 3. Two decodes each feed 1 token first (5 left); the
    older gets 3 drafts, the newer the remaining 2; the waiting prompt gets no budget. A
    decode with 2 output tokens left drafts 1 (never past its end)."""
    s = make("chunked_prefill", 32, budget=7)
    ex = FixedAcceptance(3)
    a, b = Request("a", 0.0, 3, 10), Request("b", 0.0, 3, 10)
    s.add(a, 0.0)
    s.add(b, 0.0)
    step(s, ex, 0.25)  # both prompts (3 + 3 tokens) in one step
    c = Request("c", 0.25, 6, 4)
    s.add(c, 0.25)
    plan = step(s, ex, 0.5)
    assert plan.spec_decodes == {a: 3, b: 2} and plan.prefills == {}
    assert plan.features().num_tokens == 7
    # Output tokens: a 1 + 1, b 1 + 1 (nothing accepted); budget 7 - 2 = 5 again, so a 3,
    # b 2, and c still waits.
    assert step(s, ex, 0.75).spec_decodes == {a: 3, b: 2}
    s2 = make("fcfs", 32)
    ex2 = FixedAcceptance(3, {"d": 3})
    d = Request("d", 0.0, 3, 6)
    s2.add(d, 0.0)
    step(s2, ex2, 0.25)  # 1 output token
    assert step(s2, ex2, 0.5).spec_decodes == {d: 3}  # 1 + 1 + 3 = 5 tokens
    last = step(s2, ex2, 0.75)
    assert last.spec_decodes == {}  # 1 token left: no draft
    assert d.status is RequestStatus.FINISHED and d.num_output_tokens == 6


def test_chunked_prefill_gets_budget_after_drafts():
    """Budget 8: a decode with 3 drafts takes 4 tokens, the waiting prompt of 10 gets a
    chunk of 4; when its last chunk samples, it gets proposals and verifies them next."""
    s = make("chunked_prefill", 32, budget=8)
    ex = FixedAcceptance(3, {"a": 3, "b": 1})
    a = Request("a", 0.0, 3, 20)
    s.add(a, 0.0)
    step(s, ex, 0.25)
    b = Request("b", 0.25, 10, 5)
    s.add(b, 0.25)
    p = step(s, ex, 0.5)
    assert p.spec_decodes == {a: 3} and p.prefills == {b: 4}
    p = step(s, ex, 0.75)
    assert p.spec_decodes == {a: 3} and p.prefills == {b: 4}
    p = step(s, ex, 1.0)  # b's last 2 tokens: a 1 + 3, b 2 of the 4 left
    assert p.spec_decodes == {a: 3} and p.prefills == {b: 2}
    assert b.spec_token_ids == [100, 101, 102]
    p = step(s, ex, 1.25)  # budget 8 - 2 decodes = 6: a 3, b 3
    assert p.spec_decodes == {a: 3, b: 3}
    assert s.decode_set.num_tokens(b) == 10 + 1 + 1 + 1


def _two_at_capacity(policy: str, accept: dict[str, int] | None = None):
    """4 GPU blocks; prompts of 4 take blocks_for(4 + 1) = 2 blocks each (all 4). After the
    prefill L = 5: without drafts the next token fits in block 1 (blocks_for(6) = 2); with
    3 drafts each needs blocks_for(9) = 3, so the newest is preempted for the lookahead."""
    s = make(policy, 4, cpu=8)
    ex = FixedAcceptance(3, accept)
    a, b = Request("a", 0.0, 4, 8), Request("b", 0.0, 4, 8)
    s.add(a, 0.0)
    s.add(b, 0.0)
    step(s, ex, 0.25)
    return s, ex, a, b


def test_lookahead_forces_preemption_then_recompute_resumes_from_known_tokens():
    s, ex, a, b = _two_at_capacity("fcfs", {"a": 3, "b": 1})
    plan = step(s, ex, 0.5)
    assert plan.preempted == [(b, PreemptionMode.RECOMPUTE)]
    assert plan.decodes == [a] and plan.spec_decodes == {a: 3}
    assert b.spec_token_ids == [] and b.num_computed_tokens == 0 and b.num_output_tokens == 1
    assert s.decode_set.num_tokens(a) == 5 + 4 and len(a.block_table) == 3
    # b cannot come back (blocks_for(4 + 1 + 1) = 2 blocks, 1 free); a: 9 tokens, 5 of 8
    # output: its drafts are cut to 8 - 5 - 1 = 2, both accepted: it ends at 12 tokens.
    assert step(s, ex, 0.75).spec_decodes == {a: 2}
    assert a.status is RequestStatus.FINISHED and a.num_output_tokens == 8
    plan = step(s, ex, 1.0)  # b re-admitted: feeds its 5 known tokens, samples the 6th
    assert plan.prefills == {b: 5} and b.num_recomputed_tokens == 4
    assert b.spec_token_ids == [100, 101, 102]  # proposed anew
    assert step(s, ex, 1.25).spec_decodes == {b: 3}


def test_swap_keeps_proposals():
    s, ex, a, b = _two_at_capacity("swap", {"a": 3})
    plan = step(s, ex, 0.5)
    assert plan.preempted == [(b, PreemptionMode.SWAP)]
    assert b.spec_token_ids == [100, 101, 102]  # kept while swapped
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 4
    while b.status is RequestStatus.SWAPPED:
        plan = step(s, ex, 0.5)
    # Swapped in after this plan's drafts were given out: no drafts in its first step back.
    assert b in plan.decodes and b not in plan.spec_decodes
    assert step(s, ex, 0.75).spec_decodes.get(b) == 3


def test_prefix_cache_keys_only_accepted_tokens():
    """Hash ids cover 12 tokens (3 blocks). Prompt 4, L = 5 after the prefill; 3 drafts
    verified (positions 4..7). With 0 accepted KV holds 5 tokens: 1 full block keyed when
    the request is preempted; with 3 accepted 8 tokens: 2 blocks keyed."""
    for accepted, keyed in ((0, 1), (3, 2)):
        s = make("fcfs", 16, caching=True)
        ex = FixedAcceptance(3, {"a": accepted})
        a = Request("a", 0.0, 4, 8, hash_ids=[1, 2, 3], hash_block_size=4)
        s.add(a, 0.0)
        step(s, ex, 0.25)
        step(s, ex, 0.5)
        assert s.num_computed_tokens(a) == 5 + accepted
        s.preempt(SchedulerOutput(), a)  # recompute: its computed blocks get their keys
        probe = Request("p", 0.0, 12, 1, hash_ids=[1, 2, 3], hash_block_size=4)
        assert len(s.block_manager.lookup(probe)) == keyed


def test_spec_off_is_the_plain_scheduler():
    """Without ``speculative`` the plan has no drafts even if an executor proposes."""
    bm = BlockManager(8, 0, BS, 0.0)
    s = get_policy("fcfs")(SchedulerLimits(8, 64, 1000), bm)
    ex = FixedAcceptance(3, {"a": 3})
    r = Request("a", 0.0, 5, 4)
    s.add(r, 0.0)
    step(s, ex, 0.25)
    assert r.spec_token_ids == [] and step(s, ex, 0.5).spec_decodes == {}


def test_bad_acceptance_count_is_one_line():
    s = make("fcfs", 8)
    r = Request("a", 0.0, 5, 10)
    s.add(r, 0.0)
    step(s, FixedAcceptance(3), 0.25)
    plan = s.schedule()
    with pytest.raises(ValueError, match=r"request a: 4 drafts accepted, expected 0\.\.3"):
        s.update(plan, StepResult(0.1, num_accepted={r: 4}), 0.5)


# ------------------------------------------------------------------------- properties
class RandomAcceptance:
    """Every step takes STEP_S; each sampled request gets 0..k proposals, each spec decode
    accepts a random prefix (seeded)."""

    def __init__(self, scheduler: Scheduler, k: int, seed: int) -> None:
        self.s, self.k, self.rng = scheduler, k, random.Random(seed)
        self.tokens: list[int] = []

    def execute(self, plan: SchedulerOutput) -> StepResult:
        s, lim = self.s, self.s.limits
        f = plan.features()
        assert f.num_tokens <= lim.max_num_batched_tokens
        assert f.num_spec_tokens == sum(plan.spec_decodes.values())
        self.tokens.append(f.num_tokens)
        assert s.block_manager.num_used_gpu_blocks <= s.block_manager.num_gpu_blocks
        res = StepResult(STEP_S)
        for r, d in plan.spec_decodes.items():
            res.num_accepted[r] = self.rng.randint(0, d)
        sampling = list(plan.decodes)
        sampling += [
            r for r, n in plan.prefills.items() if r.num_computed_tokens + n == r.num_tokens
        ]
        for r in sampling:
            res.draft_token_ids[r] = [0] * self.rng.randint(0, self.k)
        return res


POLICY_CASES = [(p, {}) for p in bundled_policy_names()] + [("srpt", {"preempt_longer": True})]


@pytest.mark.parametrize("policy, options", POLICY_CASES)
@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_acceptance_keeps_invariants(policy, options, data):
    sc = data.draw(scenarios_for(policy), label="scenario")
    k = data.draw(st.integers(1, 4), label="k")
    cls = get_policy(policy)
    bm = BlockManager(sc.gpu_blocks, sc.cpu_blocks, sc.block_size, sc.watermark)
    s = cls(sc.limits, bm, speculative=spec(k), **options)
    ex = RandomAcceptance(s, k, data.draw(st.integers(0, 2**16), label="seed"))
    reqs = [Request(str(i), a, p, o) for i, (a, p, o) in enumerate(sc.requests)]
    res = replay(reqs, s, ex, check_invariants=True)
    assert res.failure is None, res.failure
    steps = res.steps
    assert (
        ex.tokens
        == (
            steps["num_prefill_tokens"] + steps["num_decode_tokens"] + steps["num_spec_tokens"]
        ).tolist()
    )
    for r in res.requests:
        assert r.status is expected_status(sc, r.prompt_len, r.output_len), (r, r.reason)
        assert r.block_table == []
        times = res.token_times(r)
        assert len(times) == res.num_token_times(r)
        if r.status is RequestStatus.FINISHED:
            assert len(times) == r.output_len  # exactly, whatever was accepted
            assert np.all(np.diff(times) >= 0) and times[-1] == r.finish_s
            _, counts = np.unique(times, return_counts=True)
            assert counts.max() <= 1 + k
            assert r.num_accepted_tokens <= r.num_draft_tokens <= k * len(r.spec_steps)
    assert bm.num_free_gpu_blocks == sc.gpu_blocks and bm.num_free_cpu_blocks == sc.cpu_blocks
    check_preemptions(res, s)
    event("drafts verified" if steps["num_spec_tokens"].sum() else "no drafts")
    if steps["num_preempted"].sum():
        event("preemptions")
    target(float(steps["num_preempted"].sum()), label="preemptions")  # towards KV pressure


def test_speculative_with_async_on_the_engine_is_refused_in_one_line(tmp_path):
    (tmp_path / "model").mkdir()
    raw = {
        "backend": "engine",
        "trace": {"format": "synthetic", "num_requests": 2, "prompt_len": 8, "output_len": 3,
                  "arrival": {"process": "poisson", "rate": 2}},
        "engine": {"model_path": "model"},
        "speculative": {"method": "ngram", "num_speculative_tokens": 2},
        "policies": ["fcfs", {"name": "fcfs", "label": "b", "async_scheduling": True}],
    }  # fmt: skip
    with pytest.raises(ConfigError) as e:
        validate(raw, base_dir=tmp_path)
    assert str(e.value) == (
        "config: policies[1] (b): speculative with async_scheduling: true runs in the "
        "simulator only; set async_scheduling: false or backend: sim"
    )
    raw["policies"][1]["speculative"] = None  # off for the async policy: accepted
    validate(raw, base_dir=tmp_path)


class LaunchAccept(FixedAcceptance):
    """:class:`FixedAcceptance` with ``launch``/``wait`` (asynchronous scheduling): the
    result is decided at launch, from the plan alone."""

    wall_clock = False

    def launch(self, plan: SchedulerOutput) -> StepResult:
        return self.execute(plan)

    def wait(self, handle: StepResult) -> StepResult:
        return handle


def test_async_drafts_are_placeholders_and_accepted_ones_join_late():
    """Async, fcfs, block size 4, one request (prompt 4, output 12), k = 3, 2 of the drafts
    accepted per verify, 0.25 s steps. Pn is planned while P(n-1) runs. P0 prefills. P1:
    P0's token and its 3 proposals (made on the device) are placeholders; 3 drafts, blocks
    for 5 + 3 + 1 = 9 slots (3). P2: 2 output tokens (1 known + P1's placeholder), P1's 3
    drafts unknown: at most 5, so min(3, 12 - 5 - 1) = 3 drafts, blocks for
    6 + 3 + 3 + 1 = 13 slots (4). P3: P1's 2 accepted have joined: 4 known + P2's
    placeholder = 5, at most 8: min(3, 12 - 8 - 1) = 3 drafts. P4: 7 + 1, at most 11: none
    (the bound counts P3's drafts as accepted). P3 ends with 10 tokens, P4 with 11, P5
    samples the 12th: an end by length, so no step follows it (sync would need one too)."""
    bm = BlockManager(16, 0, BS, 0.0)
    s = get_policy("fcfs")(
        SchedulerLimits(8, 64, 1000), bm, speculative=spec(3), async_scheduling=True
    )
    r = Request("a", 0.0, 4, 12)
    blocks = []

    class Recording(LaunchAccept):
        def launch(self, plan):
            blocks.append(len(r.block_table))
            return super().launch(plan)

    ex = Recording(3, {"a": 2})
    res = replay([r], s, ex, check_invariants=True)
    assert res.failure is None, res.failure
    assert [p.spec_decodes.get(r, 0) for p in ex.plans] == [0, 3, 3, 3, 0, 0]
    assert blocks == [2, 3, 4, 4, 4, 4]
    assert r.spec_steps == [(1, 3, 2), (2, 3, 2), (3, 3, 2)]
    # Accepted drafts arrive with their step's token, at its end.
    assert res.token_times(r).tolist() == [0.25] + [0.5] * 3 + [0.75] * 3 + [1.0] * 3 + [
        1.25,
        1.5,
    ]
    assert res.num_token_times(r) == 12 and r.finish_s == 1.5
    assert res.steps["num_wasted_tokens"].tolist() == [0, 0, 0, 0, 0, 0]
    assert res.steps["num_spec_tokens"].tolist() == [0, 3, 3, 3, 0, 0]
    assert bm.num_free_gpu_blocks == 16


@pytest.mark.parametrize("policy", ["fcfs", "swap"])
def test_async_preemption_with_drafts_in_flight(policy):
    """Async, 6 GPU blocks of 4, prompts of 4, output 16, k = 3, 2 accepted. P0 prefills
    both (2 blocks each). P1 (P0 in flight): 3 placeholder drafts each, blocks for
    5 + 1 + 3 = 9 slots: 3 each, 0 free. P2 (P1 in flight): P1's 3 drafts may all be
    accepted, so each needs blocks for 6 + 3 + 1 + 3 = 13 slots (4): b, the newest, is
    preempted with its P1 drafts in flight. When P1's results arrive b gains its 2 accepted
    drafts (4 output tokens): recompute re-prefills 4 + 4 = 8 tokens in P3 (its 5 computed
    tokens and the 2 accepted redone); swap moved 3 blocks out and frees the CPU tail
    beyond blocks_for(8) = 2 blocks."""
    bm = BlockManager(6, 8, BS, 0.0)
    s = get_policy(policy)(
        SchedulerLimits(8, 64, 1000), bm, speculative=spec(3), async_scheduling=True
    )
    ex = LaunchAccept(3, {"a": 2, "b": 2})
    a, b = Request("a", 0.0, 4, 16), Request("b", 0.0, 4, 16)
    res = replay([a, b], s, ex, check_invariants=True)
    assert res.failure is None, res.failure
    p = ex.plans
    assert p[1].spec_decodes == {a: 3, b: 3}
    mode = PreemptionMode.RECOMPUTE if policy == "fcfs" else PreemptionMode.SWAP
    assert p[2].preempted == [(b, mode)] and p[2].spec_decodes == {a: 3}
    assert b.spec_steps[0] == (1, 3, 2)
    if policy == "fcfs":
        assert p[3].prefills == {b: 8}
        assert res.steps["kv_used_blocks"][:4].tolist() == [4, 6, 4, 6]
    else:
        assert len(p[2].swap_out) == 3
        assert res.steps["cpu_used_blocks"][:4].tolist() == [0, 0, 3, 2]
    for r in (a, b):
        assert r.status is RequestStatus.FINISHED and len(res.token_times(r)) == 16
    assert int(res.steps["num_wasted_tokens"].sum()) == 0  # ends by length


@pytest.mark.parametrize("finish_reason", ["length", "stop"])
@pytest.mark.parametrize("policy", ["fcfs", "chunked_prefill", "swap", "srpt"])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(data=st.data())
def test_async_random_acceptance_keeps_invariants(policy, finish_reason, data):
    """Async scheduling with speculation: blocks, budget and key invariants hold
    (``check_plan`` on every plan), every request ends as its limits say, a finished one
    got exactly output_len tokens, and async's wasted-slot rule holds (none for ends by
    length, parked requests included)."""
    sc = data.draw(scenarios_for(policy), label="scenario")
    k = data.draw(st.integers(1, 4), label="k")
    bm = BlockManager(sc.gpu_blocks, sc.cpu_blocks, sc.block_size, sc.watermark)
    s = get_policy(policy)(sc.limits, bm, speculative=spec(k), async_scheduling=True)

    class Async(RandomAcceptance):
        wall_clock = False

        def launch(self, plan):
            return self.execute(plan)

        def wait(self, handle):
            return handle

    ex = Async(s, k, data.draw(st.integers(0, 2**16), label="seed"))
    reqs = [
        Request(str(i), a, p, o, finish_reason=finish_reason)
        for i, (a, p, o) in enumerate(sc.requests)
    ]
    res = replay(reqs, s, ex, check_invariants=True)
    assert res.failure is None, res.failure
    for r in res.requests:
        assert r.status is expected_status(sc, r.prompt_len, r.output_len), (r, r.reason)
        assert r.block_table == []
        if r.status is RequestStatus.FINISHED:
            times = res.token_times(r)
            assert len(times) == r.output_len == res.num_token_times(r)
            assert np.all(np.diff(times) >= 0) and times[-1] == r.finish_s
    # Async's rule: one wasted slot per finished request whose next step decodes.
    steps, n = res.steps, len(res.steps["time_s"])
    decodes = steps["num_decode_tokens"]
    ends = {float(t): i for i, t in enumerate(res.step_end_s)}
    after = [ends[r.finish_s] + 1 for r in res.requests if r.status is RequestStatus.FINISHED]
    wasted = sum(i < n and decodes[i] > 0 for i in after) if finish_reason == "stop" else 0
    assert int(steps["num_wasted_tokens"].sum()) == wasted
    assert not s.in_flight.parked and not s.in_flight.ended
    assert bm.num_free_gpu_blocks == sc.gpu_blocks and bm.num_free_cpu_blocks == sc.cpu_blocks
    event("drafts verified" if steps["num_spec_tokens"].sum() else "no drafts")
    target(float(steps["num_preempted"].sum()), label="preemptions")


@pytest.mark.parametrize("policy", ["fcfs", "chunked_prefill", "swap"])
@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_acceptance_with_prefix_caching(policy, data):
    """As above with the prefix cache on and every request sharing one chain of hash ids
    over its prompt and output (so generated blocks are keyed too): block and key
    invariants hold (``check_plan``) and every finished request gets exactly output_len."""
    sc = data.draw(scenarios_for(policy), label="scenario")
    k = data.draw(st.integers(1, 4), label="k")
    bm = PrefixCachingBlockManager(sc.gpu_blocks, sc.cpu_blocks, sc.block_size, sc.watermark)
    s = get_policy(policy)(sc.limits, bm, speculative=spec(k))
    ex = RandomAcceptance(s, k, data.draw(st.integers(0, 2**16), label="seed"))
    reqs = []
    for i, (a, p, o) in enumerate(sc.requests):
        n = -(-(p + o) // sc.block_size)
        r = Request(str(i), a, p, o, hash_ids=list(range(n)), hash_block_size=sc.block_size)
        reqs.append(r)
    res = replay(reqs, s, ex, check_invariants=True)
    assert res.failure is None, res.failure
    for r in res.requests:
        assert r.status is expected_status(sc, r.prompt_len, r.output_len), (r, r.reason)
        if r.status is RequestStatus.FINISHED:
            assert len(res.token_times(r)) == r.output_len
    assert bm.num_free_gpu_blocks == sc.gpu_blocks


def test_async_drafts_run_to_the_last_token_and_a_maybe_ended_request_is_parked():
    """As the async timeline above with every draft accepted: P1 and P2 verify 3 (5, then 9
    tokens out), P3 (planned with 6 known-or-placeholder + 3 unknown) verifies
    12 - 9 - 1 = 2, up to the last token. P4's plan (P3 in flight) counts 10 tokens plus
    P3's 2 unknown drafts: they may end the request, so it is parked (vLLM schedules no
    token past max_tokens), P4 is empty and not launched. P3's results (both accepted:
    12 tokens) end it at 1.0 s: four steps, no wasted slot. With "stop" (EOS) ends the
    drafts stop a token short (12 - 9 - 2 = 1), P4 is not known to sample the last token
    until P3's results arrive, then it ends the request and P5 is its wasted slot."""
    bm = BlockManager(16, 0, BS, 0.0)
    s = get_policy("fcfs")(
        SchedulerLimits(8, 64, 1000), bm, speculative=spec(3), async_scheduling=True
    )
    r = Request("a", 0.0, 4, 12)
    ex = LaunchAccept(3, {"a": 3})
    res = replay([r], s, ex, check_invariants=True)
    assert res.failure is None, res.failure
    assert res.steps["num_spec_tokens"].tolist() == [0, 3, 3, 2]
    assert r.spec_steps == [(1, 3, 3), (2, 3, 3), (3, 2, 2)]
    assert res.token_times(r).tolist() == [0.25] + [0.5] * 4 + [0.75] * 4 + [1.0] * 3
    assert r.status is RequestStatus.FINISHED and r.finish_s == 1.0
    assert res.steps["num_wasted_tokens"].tolist() == [0, 0, 0, 0]
    assert bm.num_free_gpu_blocks == 16

    bm = BlockManager(16, 0, BS, 0.0)
    s = get_policy("fcfs")(
        SchedulerLimits(8, 64, 1000), bm, speculative=spec(3), async_scheduling=True
    )
    r = Request("a", 0.0, 4, 12, finish_reason="stop")
    ex = LaunchAccept(3, {"a": 3})
    res = replay([r], s, ex, check_invariants=True)
    assert res.failure is None, res.failure
    assert res.steps["num_spec_tokens"].tolist() == [0, 3, 3, 1, 0, 0]
    assert r.spec_steps == [(1, 3, 3), (2, 3, 3), (3, 1, 1)]
    assert res.token_times(r).tolist() == [0.25] + [0.5] * 4 + [0.75] * 4 + [1.0] * 2 + [1.25]
    assert r.status is RequestStatus.FINISHED and r.finish_s == 1.25
    assert res.steps["num_wasted_tokens"].tolist() == [0, 0, 0, 0, 0, 1]
