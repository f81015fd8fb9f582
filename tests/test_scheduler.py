"""Hand-computed replays with the fixed-cost toy executor (10 ms per step)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import bundled_policy_names, by_id, run

from sched_lab.core.errors import ConfigError
from sched_lab.core.scheduler import register_policy
from sched_lab.policies import get_policy, policy_names

POLICIES = bundled_policy_names()


@pytest.mark.parametrize("policy", POLICIES)
def test_too_long_request_rejected_others_finish(policy):
    # block size 16, 8 GPU blocks. r2's prompt alone needs ceil(201 / 16) = 13 blocks.
    res = run(policy, [("r1", 0.0, 40, 8), ("r2", 0.1, 200, 8), ("r3", 0.2, 30, 8)])
    r = by_id(res)
    assert r["r2"].status.value == "rejected"
    assert "13 KV blocks" in r["r2"].reason and "has 8" in r["r2"].reason
    assert r["r2"].finish_s == pytest.approx(0.1)
    # r1: prefill 0.00-0.01 (token 1), 7 decodes -> tokens at 0.01, 0.02, ..., 0.08.
    np.testing.assert_allclose(res.token_times(r["r1"]), np.arange(1, 9) * 0.01)
    # r3 arrives at 0.2 to an idle engine: tokens at 0.21 ... 0.28.
    np.testing.assert_allclose(res.token_times(r["r3"]), 0.2 + np.arange(1, 9) * 0.01)
    assert [r["r1"].status.value, r["r3"].status.value] == ["finished", "finished"]


def test_rejected_over_max_model_len_names_blocks():
    res = run("fcfs", [("a", 0.0, 200, 8)], max_model_len=128)
    reason = by_id(res)["a"].reason
    assert "208 tokens (13 blocks) exceeds max_model_len 128" in reason
    assert "8 GPU blocks" in reason


@pytest.mark.parametrize("policy", POLICIES)
def test_blocks_held_per_step(policy):
    # Convention: the sampled token's slot is reserved in the step that samples it, so
    # during step k a request holds ceil((prompt + k) / block_size) blocks: 3+1..3+6 tokens.
    res = run(policy, [("a", 0.0, 3, 6)], block_size=4)
    assert res.steps["kv_used_blocks"].tolist() == [1, 2, 2, 2, 2, 3]
    np.testing.assert_allclose(res.token_times(res.requests[0]), np.arange(1, 7) * 0.01)


@pytest.mark.parametrize("policy", POLICIES)
def test_lone_request_outgrowing_cache_is_aborted(policy):
    # 4 blocks of 4 tokens = 16 tokens. "big": prompt 8 fits (3 blocks with the sampled
    # slot), but 8 + 20 tokens never do: it is aborted when its 17th token needs a 5th
    # block. Prefill at 0.00-0.01 gives 9 tokens; decodes add one per step, so the decode
    # step that would make 17 tokens is planned at t = 0.08 (after 7 decodes).
    res = run(policy, [("big", 0.0, 8, 20), ("later", 0.5, 4, 4)], gpu_blocks=4, block_size=4)
    r = by_id(res)
    assert r["big"].status.value == "aborted"
    assert "outgrew the KV cache" in r["big"].reason
    assert r["big"].finish_s == pytest.approx(0.08)
    assert r["big"].block_table == []
    assert r["later"].status.value == "finished"
    np.testing.assert_allclose(res.token_times(r["later"]), 0.5 + np.arange(1, 5) * 0.01)


def test_fcfs_preempts_newest_by_recompute():
    # 4 GPU blocks of 4 tokens. a (prompt 4, out 6) and b (prompt 4, out 6) each hold 2
    # blocks after their prefill (5 tokens). Step 1 prefills both (prefill-first), tokens at
    # 0.01. Steps 2-4 decode both up to 8 tokens (still 2 blocks each). Planning step 5
    # (t = 0.04), each needs a 3rd block and none is free: b (newest) is preempted.
    res = run("fcfs", [("a", 0.0, 4, 6), ("b", 0.0, 4, 6)], gpu_blocks=4, block_size=4)
    r = by_id(res)
    assert r["a"].num_preemptions_recompute == 0
    assert r["b"].num_preemptions_recompute == 1
    assert res.steps["num_preempted"].sum() == 1
    # a: prefill at 0.01, decodes at 0.02..0.06 -> done at 0.06.
    np.testing.assert_allclose(res.token_times(r["a"]), np.arange(1, 7) * 0.01)
    # b: tokens at 0.01 ... 0.04 (8 tokens), preempted when planning 0.04-0.05. At 0.05 its
    # re-prefill needs ceil(9 / 4) = 3 blocks, 1 is free; a finishes at 0.06, so b
    # re-prefills 8 tokens at 0.06-0.07 (its 5th token) and decodes at 0.07-0.08.
    np.testing.assert_allclose(res.token_times(r["b"]), [0.01, 0.02, 0.03, 0.04, 0.07, 0.08])


def test_swap_moves_victim_to_cpu_and_back():
    res = run("swap", [("a", 0.0, 4, 6), ("b", 0.0, 4, 6)], gpu_blocks=4, block_size=4)
    r = by_id(res)
    assert r["b"].num_preemptions_swap == 1 and r["b"].num_preemptions_recompute == 0
    assert res.steps["num_swap_out_blocks"].sum() == 2  # b held 2 blocks (7 tokens)
    assert res.steps["num_swap_in_blocks"].sum() == 2
    assert res.steps["cpu_used_blocks"][-1] == 0
    # b: swapped out (2 blocks, 8 tokens) while planning 0.04-0.05; swap-in needs 3 blocks
    # (its next token starts one), free once a finishes at 0.06: it decodes at 0.06-0.07 and
    # 0.07-0.08 with nothing recomputed (the toy cost model charges neither).
    np.testing.assert_allclose(res.token_times(r["b"]), [0.01, 0.02, 0.03, 0.04, 0.07, 0.08])


def test_swap_falls_back_to_recompute_without_cpu_space():
    res = run(
        "swap", [("a", 0.0, 4, 6), ("b", 0.0, 4, 6)], gpu_blocks=4, block_size=4, cpu_blocks=1
    )
    assert by_id(res)["b"].num_preemptions_recompute == 1
    assert by_id(res)["b"].num_preemptions_swap == 0


def test_swap_invariants_under_pressure():
    # 40 requests of up to 128 tokens (32 blocks) into 40 blocks: the replay checks used + free = total and single
    # ownership at every step (check_invariants); CPU swap space ends empty.
    reqs = [(str(i), i * 0.003, 10 + 7 * i % 40, 30 + 11 * i % 50) for i in range(40)]
    res = run("swap", reqs, gpu_blocks=40, cpu_blocks=64, block_size=4)
    assert all(r.status.value == "finished" for r in res.requests)
    assert res.steps["num_swap_out_blocks"].sum() > 0
    assert res.steps["cpu_used_blocks"][-1] == 0
    assert res.steps["kv_used_blocks"].max() <= 40


def test_chunked_prefill_splits_prompt_and_keeps_decodes_going():
    # Budget 8 tokens: "long" (prompt 20) needs chunks 7, 7, 6 while "short" (prompt 2)
    # decodes in every step (decode-first).
    res = run(
        "chunked_prefill",
        [("short", 0.0, 2, 6), ("long", 0.0, 20, 2)],
        budget=8,
        block_size=4,
        gpu_blocks=16,
    )
    r = by_id(res)
    # Step 1: short prefill 2 + long chunk 6; steps 2-3: 1 decode + 7 chunk; step 4:
    # 1 decode + the last 0 ... long's 20 tokens = 6 + 7 + 7: first token at step 3 (0.03).
    assert res.steps["num_prefill_tokens"].tolist()[:3] == [8, 7, 7]
    assert res.token_times(r["long"])[0] == pytest.approx(0.03)
    np.testing.assert_allclose(res.token_times(r["short"]), np.arange(1, 7) * 0.01)
    assert (res.steps["num_prefill_tokens"] + res.steps["num_decode_tokens"]).max() <= 8


@pytest.mark.parametrize("policy", POLICIES)
def test_max_num_seqs_respected(policy):
    reqs = [(str(i), 0.0, 5, 5) for i in range(6)]
    res = run(policy, reqs, max_num_seqs=2, gpu_blocks=32, budget=64)
    assert res.steps["num_running"].max() == 2
    assert all(r.status.value == "finished" for r in res.requests)


def test_registry_rejects_duplicates_and_lists_names():
    with pytest.raises(ValueError, match="already registered"):
        register_policy("fcfs")(type("Dup", (), {}))
    with pytest.raises(ConfigError) as e:
        get_policy("no_such_policy")
    assert str(e.value).endswith("known policies: " + ", ".join(policy_names()))
    assert {"chunked_prefill", "fcfs", "swap"} <= set(policy_names())
