"""The scheduler's request events and wait streaks (lab/core/events.py), on hand-computed
replays: every step takes 10 ms (tests/helpers.py), so step k runs over [10k, 10k + 10) ms."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import by_id, run
from hypothesis import given, settings
from hypothesis import strategies as st
from test_properties import POLICIES, PROFILE, replay_scenario, scenarios_for

from sched_lab.core.events import ABORTED, ADMITTED, PREEMPTED, PREFILL, SWAPPED_IN, WAIT_REASONS


def _events(result, request_id):
    rows = result.events.rows(result.requests)
    return [(s, k, a, b) for s, k, r, a, b in rows if r.request_id == request_id]


def _waits(result):
    return [
        (w[0], w[1].request_id if w[1] is not None else None, *w[2:]) for w in result.events.waits
    ]


def test_a_request_blocked_by_kv_blocks_waits_in_one_streak():
    # 4 blocks of 16. a: 40 + 10 tokens (3 blocks at admission, a 4th at 48 tokens, in the
    # decode of step 8). b: 20 + 2 tokens needs 2 blocks; 1 is free until a finishes at
    # the end of step 9 (its prefill at step 0 and 9 decodes), so b is blocked at the head
    # of the queue in steps 0..9 and admitted at step 10.
    res = run("fcfs", [("a", 0.0, 40, 10), ("b", 0.0, 20, 2)], gpu_blocks=4)
    assert _events(res, "a") == [(0, ADMITTED, 3, 40)]  # 3 blocks, a 40-token chunk
    assert _events(res, "b") == [(10, ADMITTED, 2, 20)]
    assert by_id(res)["b"].finish_s == pytest.approx(0.12)  # end of step 11
    # need 2 blocks, at most 1 free (0 after a's 4th block at step 8)
    assert _waits(res) == [("kv_blocks", "b", 0, 9, 10, 2, 1)]


def test_recompute_preemption_of_the_newest_then_a_wait_to_readmit():
    # 3 blocks of 4. a and b (3 + 6 tokens) take a block each at step 0; both need a second
    # one for the decode of step 1 and one is free: b, the newest, is recomputed. Its
    # re-prefill (3 prompt + 1 output tokens, 2 blocks) waits while a holds 2 blocks, then 3
    # from step 5 (a at 8 tokens); a finishes at step 5 (prefill + 5 decodes).
    res = run("fcfs", [("a", 0.0, 3, 6), ("b", 0.0, 3, 6)], gpu_blocks=3, block_size=4)
    assert _events(res, "b") == [
        (0, ADMITTED, 1, 3),
        (1, PREEMPTED, 0, "the newest running request"),  # mode 0: recompute
        (6, ADMITTED, 2, 4),  # prompt + its 1 output token again
    ]
    assert by_id(res)["b"].finish_s == pytest.approx(
        0.11
    )  # 2 tokens after the re-prefill, then 4 decodes
    assert _waits(res) == [("kv_blocks", "b", 2, 5, 4, 2, 1)]
    assert by_id(res)["b"].num_preemptions_recompute == 1


def test_swap_out_swap_in_and_the_queue_held_while_swapped_requests_wait():
    # As above with swap: b goes to CPU at step 1 and needs 2 blocks to come back (its 1 and
    # one for its next token, at 4 tokens); 1 is free until a finishes at step 5. c arrives
    # during step 1: fcfs does not admit while a request is swapped, so the whole queue is
    # held in steps 2..6 (b swapped in at step 6); c is admitted at step 7 (one token).
    res = run(
        "swap",
        [("a", 0.0, 3, 6), ("b", 0.0, 3, 6), ("c", 0.015, 3, 1)],
        gpu_blocks=3,
        block_size=4,
    )
    assert _events(res, "b") == [
        (0, ADMITTED, 1, 3),
        (1, PREEMPTED, 1, "the newest running request"),  # mode 1: swap
        (6, SWAPPED_IN, 2, 0),
    ]
    assert by_id(res)["b"].finish_s == pytest.approx(
        0.12
    )  # decodes at steps 6 and 8..11 (7 prefills c)
    assert _events(res, "c") == [(7, ADMITTED, 1, 3)]
    assert _waits(res) == [
        ("swap_in_blocks", "b", 2, 5, 4, 2, 1),
        ("swapped_first", None, 2, 6, 5, 0, 0),
    ]


def test_token_budget_and_max_num_seqs_reasons():
    # fcfs with a 100-token budget: a (60) is admitted at step 0, b (60) does not fit in the
    # 40 tokens left; at step 1 b is admitted (a decodes are not run: prefill-first).
    res = run("fcfs", [("a", 0.0, 60, 3), ("b", 0.0, 60, 3)], budget=100, gpu_blocks=64)
    assert _waits(res) == [("token_budget", "b", 0, 0, 1, 60, 40)]
    assert _events(res, "b")[0] == (1, ADMITTED, 4, 60)
    # max_num_seqs 1: b waits while a runs (steps 0..2: prefill + 2 decodes)
    res = run("fcfs", [("a", 0.0, 60, 3), ("b", 0.0, 60, 3)], max_num_seqs=1, gpu_blocks=64)
    assert _waits(res) == [("max_num_seqs", "b", 0, 2, 3, 1, 0)]
    assert _events(res, "b")[0] == (3, ADMITTED, 4, 60)


def test_chunked_prefill_records_each_chunk_and_a_spent_budget():
    # budget 64: a (100 tokens) is fed 64 + 36; b arrives at 0 too and gets no budget at
    # step 0 (a took it all); at step 1, a's 36 + b's first 28 tokens fill the 64.
    res = run("chunked_prefill", [("a", 0.0, 100, 2), ("b", 0.0, 50, 2)], gpu_blocks=64)
    assert _events(res, "a") == [(0, ADMITTED, 7, 64), (1, PREFILL, 36, 64)]
    assert _events(res, "b") == [(1, ADMITTED, 4, 28), (2, PREFILL, 22, 28)]
    assert _waits(res) == [("budget_spent", "b", 0, 0, 1, 0, 0)]


# --------------------------------------------------------------------------- properties


@pytest.mark.parametrize("policy", POLICIES)
@settings(PROFILE, max_examples=max(10, PROFILE.max_examples // 3))
@given(data=st.data())
def test_events_account_for_every_move_on_random_traces(policy, data):
    # tests/test_properties.py's random traces and limits: the events must agree with the
    # requests' counters and the steps' columns, whatever the policy decides.
    res, _, _ = replay_scenario(policy, data.draw(scenarios_for(policy), label="scenario"))
    rows = list(res.events.rows(res.requests))
    n_steps = len(res.steps["time_s"])
    assert [s for s, *_ in rows] == sorted(s for s, *_ in rows)  # recorded in step order
    assert all(0 <= s <= n_steps for s, *_ in rows)  # n_steps: a plan that only aborted
    kinds = Counter((r.request_id, k) for _, k, r, _, _ in rows)
    for r in res.requests:
        admitted = kinds[r.request_id, ADMITTED]
        assert kinds[r.request_id, PREEMPTED] == r.num_preemptions
        assert kinds[r.request_id, SWAPPED_IN] <= r.num_preemptions_swap
        if r.status.value == "finished":
            assert admitted == 1 + r.num_preemptions_recompute
            assert kinds[r.request_id, SWAPPED_IN] == r.num_preemptions_swap
        assert kinds[r.request_id, ABORTED] <= 1
    # every prefill token of steps.csv is in an admission's first chunk or a later chunk
    fed = sum(b if k == ADMITTED else a for _, k, _, a, b in rows if k in (ADMITTED, PREFILL))
    assert fed == int(res.steps["num_prefill_tokens"].sum())
    for reason, r, first, last, count, _, _ in res.events.waits:
        assert reason in WAIT_REASONS and 0 <= first <= last and 1 <= count <= last - first + 1
        assert (r is None) == (reason in ("swapped_first", "preempted_step", "not_tried"))


def test_repeat_counts_the_streaks_of_the_step_before():
    """EventLog.repeat(step) counts ``step`` in every streak that counted ``step - 1`` (a
    repeated plan records the same waits), and nothing when the step before counted none."""
    from sched_lab.core.events import EventLog

    log = EventLog()
    log.wait(3, "r1", "kv_blocks", 2, 1)
    log.wait_all(3, "swapped_first")
    log.repeat(4)
    log.repeat(5)
    assert log.waits == [["kv_blocks", "r1", 3, 5, 3, 2, 1], ["swapped_first", None, 3, 5, 3, 0, 0]]
    log.repeat(7)  # step 6 counted nothing
    assert [w[3:5] for w in log.waits] == [[5, 3], [5, 3]]
    log.wait(8, "r1", "kv_blocks")  # the same spell goes on
    assert log.waits[0][3:5] == [8, 4]
