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


# ------------------------------------------------------------------ fast-forward
def test_repeated_decode_plans_skip_the_policy(monkeypatch):
    """Scheduler.repeat_decodes plans a step that repeats the decode-only step before it
    (no arrival, finish, preemption or swap in between) without the policy: a (40 + 10
    tokens) and b (20 + 2) with 4 blocks of 16, b blocked until a finishes at step 9 (as in
    tests/test_events.py). The policy plans steps 0 (prefill a), 1 (the first decode), 10
    (prefill b) and 11 (decode b); steps 2-9 repeat step 1, the 4th block of a included
    (step 8), and b's wait streak still counts every step, 0 to 9."""
    from sched_lab.policies.fcfs import FCFS

    planned = []
    schedule = FCFS.schedule

    def counted(self):
        planned.append(self.num_steps)
        return schedule(self)

    monkeypatch.setattr(FCFS, "schedule", counted)
    res = run("fcfs", [("a", 0.0, 40, 10), ("b", 0.0, 20, 2)], gpu_blocks=4)
    assert planned == [0, 1, 10, 11]
    assert res.steps["kv_used_blocks"].tolist() == [3] * 8 + [4, 4, 2, 2]
    assert res.events.waits == [["kv_blocks", by_id(res)["b"], 0, 9, 10, 2, 1]]


def test_fast_forward_is_declared_per_class():
    """A subclass inherits no fast_forward: edf (an fcfs with its own admission order) and
    the policies that reorder or count every step plan every step themselves."""
    from sched_lab.policies import get_policy

    names = ("fcfs", "swap", "chunked_prefill", "edf", "sjf", "priority", "vtc")
    assert {p for p in names if get_policy(p).fast_forward} == {"fcfs", "swap", "chunked_prefill"}


def test_advance_to_moves_the_clock_only_when_nothing_is_due():
    from sched_lab.sim.replay import SimEnvironment

    env = SimEnvironment()
    env.timeout(2.0)
    assert env.advance_to(1.5) and env.now == 1.5
    assert not env.advance_to(2.0)  # an event at 2.0 comes first
    assert env.now == 1.5
    env.run()
    assert env.now == 2.0 and env.advance_to(7.25) and env.now == 7.25
