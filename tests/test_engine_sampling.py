"""Per-request sampling on the engine (CPU, a tiny random model): each sequence's
temperature, top_p and seed reach the sampler, eagerly and through the CUDA-graph runner's
static buffers (CPU, no capture).

* temperature 0 is greedy whatever top_p and seed say; top_p 1e-6 is greedy at any
  temperature (only the most likely token is left);
* a seed gives a request the same tokens run alone, run again, or run beside other requests
  (seeded or not) in other batch rows;
* the executor fills each SeqInput from the request's ``sampling_params``, the configured
  temperature where they leave it unset.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")

from triton_setup import QWEN3_TINY, needs_triton  # noqa: E402  (sets TRITON_INTERPRET)

from sched_lab.backend.engine import EngineExecutor  # noqa: E402
from sched_lab.backend.runner import ModelRunner, SeqInput  # noqa: E402
from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint  # noqa: E402
from sched_lab.core.request import Request, SamplingParams  # noqa: E402

BLOCK_SIZE = 4
STEPS = 4  # tokens generated per sequence: the prefill's and three decodes'
PROMPT = [5, 17, 3, 99, 42, 7]
MATES = [[11, 12, 13], [200, 201, 202, 203, 204, 205, 206, 207, 208], [9] * 5]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_tiny_sampling")
    write_random_checkpoint(QWEN3_TINY, path, dtype="float32", std=0.2)
    return path


def make_runner(model_dir, graphs: bool = False) -> ModelRunner:
    return ModelRunner(model_dir, device="cpu", dtype="float32",
                       attention_backend="triton" if graphs else "torch", block_size=BLOCK_SIZE,
                       num_gpu_blocks=64, swap_space_bytes=0, max_num_seqs=8,
                       max_num_batched_tokens=64, cuda_graphs=graphs, cuda_graph_sizes=(4, 8),
                       cuda_graph_token_sizes=(16, 32), seed=0)  # fmt: skip


def generate(runner: ModelRunner, prompts: list[list[int]], how: list[dict]) -> list[list[int]]:
    """Prefill every prompt in one step, then decode them together for STEPS - 1 steps;
    ``how[i]``: sequence i's SeqInput sampling fields. Blocks: 5 per sequence."""
    tables = [list(range(5 * i, 5 * i + 5)) for i in range(len(prompts))]
    seqs = [SeqInput(list(p), 0, t, True, **h) for p, t, h in zip(prompts, tables, how)]
    out = [[t] for t in runner.execute(seqs)]
    for _ in range(STEPS - 1):
        seqs = [SeqInput([o[-1]], len(p) + len(o) - 1, t, True, **h)
                for p, o, t, h in zip(prompts, out, tables, how)]  # fmt: skip
        for o, t in zip(out, runner.execute(seqs)):
            o.append(t)
    return out


@pytest.fixture(scope="module")
def greedy_tokens() -> dict[bool, list[int]]:
    """PROMPT's greedy tokens alone by ``graphs``, filled by :func:`greedy` (the same for
    every make_runner(model_dir, graphs) of the module's model, so generated once)."""
    return {}


def greedy(runner: ModelRunner, graphs: bool, made: dict[bool, list[int]]) -> list[int]:
    if graphs not in made:
        made[graphs] = generate(runner, [PROMPT], [{}])[0]
    return list(made[graphs])


@pytest.mark.parametrize("graphs", [False, pytest.param(True, marks=needs_triton)])
def test_greedy_cases(model_dir, greedy_tokens, graphs):
    runner = make_runner(model_dir, graphs)
    want = greedy(runner, graphs, greedy_tokens)
    zero = {"temperature": 0.0, "top_p": 0.5, "seed": 3}  # temperature 0: the rest is moot
    tiny_top_p = {"temperature": 1.0, "top_p": 1e-6}  # one token left in the nucleus
    got = generate(runner, [PROMPT, PROMPT], [zero, tiny_top_p])
    assert got == [want, want]


@pytest.mark.parametrize("graphs", [False, pytest.param(True, marks=needs_triton)])
def test_seed_gives_the_same_tokens_alone_again_and_beside_others(model_dir, greedy_tokens,
                                                                  graphs):  # fmt: skip
    runner = make_runner(model_dir, graphs)
    seeded = {"temperature": 1.0, "seed": 1234}
    alone = generate(runner, [PROMPT], [seeded])[0]
    assert generate(runner, [PROMPT], [seeded])[0] == alone
    # Row 2 of 4 now, beside an unseeded sampled request, a greedy one and another seed;
    # the engine's generator has advanced meanwhile.
    mates = [{"temperature": 1.0}, {}, {"temperature": 0.7, "seed": 99}]
    got = generate(runner, [MATES[0], MATES[1], PROMPT, MATES[2]],
                   [mates[0], mates[1], seeded, mates[2]])  # fmt: skip
    assert got[2] == alone
    # temperature 1 over 256 tokens does sample
    assert alone != greedy(runner, graphs, greedy_tokens)
    assert generate(runner, [PROMPT], [{"temperature": 1.0, "seed": 1235}])[0] != alone


def test_executor_fills_seq_inputs_from_sampling_params(model_dir):
    executor = EngineExecutor(make_runner(model_dir), temperature=0.5)
    plain = Request("a", 0.0, 3, 2)
    only_seed = Request("b", 0.0, 3, 2, sampling_params=SamplingParams(seed=7))
    full = Request("c", 0.0, 3, 2, sampling_params=SamplingParams(0.0, 0.9, 11))
    assert executor.sampling(plain) == (0.5, 1.0, None)
    assert executor.sampling(only_seed) == (0.5, 1.0, 7)
    assert executor.sampling(full) == (0.0, 0.9, 11)
