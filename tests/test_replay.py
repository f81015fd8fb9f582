"""The replay loop's order at equal times (lab/sim/replay.py): a plan made at time t sees
every request arriving at t, whatever other requests arrived before."""

from __future__ import annotations

from helpers import by_id, run

# fcfs (vLLM V0's prefill-first step), 1 s steps; A: prompt 4, 3 output tokens at t = 0;
# B: prompt 4, 2 output tokens, arriving at t = 1.0 exactly when A's prefill step ends.
A, B = ("A", 0.0, 4, 3), ("B", 1.0, 4, 2)
REJECTED = ("R", 0.5, 5000, 2)  # longer than max_model_len: rejected at its arrival


def schedule(requests):
    res = run("fcfs", requests, gpu_blocks=8, step_s=1.0, max_model_len=200)
    got = by_id(res)
    times = {i: (got[i].first_scheduled_s, got[i].finish_s) for i in ("A", "B")}
    return times, res.steps["time_s"].tolist(), res.steps["num_prefill_tokens"].tolist()


def test_arrival_at_a_step_end_is_seen_by_the_next_plan():
    # step [0,1): prefill A; t=1: B has arrived -> [1,2): prefill B (prefill-first);
    # [2,3): decode A and B (B's 2nd token: B ends at 3); [3,4): decode A (A ends at 4).
    times, starts, prefill = schedule([A, B])
    assert times == {"A": (0.0, 4.0), "B": (1.0, 3.0)}
    assert starts == [0.0, 1.0, 2.0, 3.0]
    assert prefill == [4, 4, 0, 0]


def test_a_rejected_arrival_moves_no_other_request():
    """R arrives mid-step and is rejected; before the fix the arrival process's next timeout
    was created after the step's, so B (t = 1.0) was seen one step late and ended at 4.0."""
    with_r = schedule([A, REJECTED, B])
    assert with_r == schedule([A, B])
    assert with_r[0]["B"] == (1.0, 3.0)


def test_a_queued_arrival_between_is_planned_with_the_equal_time_one():
    # C (prompt 4, 1 token) arrives at 0.25, mid-step: the plan at 1.0 prefills B and C
    # together (8 tokens); C ends at 2.0 and B still at 3.0.
    times, starts, prefill = schedule([A, ("C", 0.25, 4, 1), B])
    assert prefill == [4, 8, 0, 0]
    assert times == {"A": (0.0, 4.0), "B": (1.0, 3.0)}
