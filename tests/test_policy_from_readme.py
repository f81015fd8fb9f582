"""A policy written from docs/policies.md alone ("Writing a policy") runs in the simulator
under sync and async scheduling with preemptions happening, using public names only; a hook
that returns a request it may not preempt stops the run with one line naming the hook."""

from __future__ import annotations

import copy
import re
import sys
import types
from pathlib import Path

import pytest

from sched_lab.config import validate
from sched_lab.core.errors import ConfigError
from sched_lab.core.scheduler import POLICIES, register_policy
from sched_lab.run.experiment import run_experiment

POLICIES_DOC = Path(__file__).resolve().parent.parent / "docs" / "policies.md"
NAME = "test_readme_policy_async"


@pytest.fixture
def readme_policy(monkeypatch):
    """The docs' example policy, registered as NAME (the file policies/shortest_prompt.py
    it tells a reader to write may exist already)."""
    text = POLICIES_DOC.read_text()
    code = re.search(r"```python\n(# policies/shortest_prompt\.py\n.*?)```", text, re.S).group(1)
    assert '@register_policy("shortest_prompt")' in code
    module = types.ModuleType(f"readme_{NAME}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    code = code.replace('"shortest_prompt"', f'"{NAME}"')
    exec(compile(code, "docs/policies.md", "exec"), vars(module))  # noqa: S102 - our docs
    yield module
    POLICIES.pop(NAME, None)


def config(policy: str | dict) -> dict:
    """40 requests at 200/s into 24 blocks of 16 tokens: KV pressure from the first steps.
    Some requests have a single output token: under asynchronous scheduling such a request is
    still running, its last token in flight, with few computed tokens, when a victim is
    chosen. The step time has a host part, so asynchronous scheduling overlaps it."""
    return {
        "name": "readme_policy",
        "trace": {
            "format": "synthetic",
            "num_requests": 40,
            "arrival": {"process": "poisson", "rate": 200.0},
            "prompt_len": {"uniform": [1, 64]},
            "output_len": {"uniform": [1, 64]},
            "seed": 0,
        },
        "model": "qwen3-0.6b",
        "cost_model": {"host_overhead_s": 0.0004, "host_per_seq_s": 2e-6},
        "kv_cache": {"block_size": 16, "num_gpu_blocks": 24},
        "policies": [policy],
    }


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_readme_policy_runs_with_preemptions(readme_policy, async_scheduling):
    policy = {"name": NAME, "async_scheduling": async_scheduling}
    (run,) = run_experiment(validate(config(policy)), progress=False)
    assert run.result.failure is None
    reqs = run.requests
    assert len(reqs) == 40
    assert (reqs["status"] == "finished").all()
    assert reqs["num_preemptions_recompute"].sum() > 0


def test_a_victim_whose_last_token_is_in_flight_stops_the_run(readme_policy):
    """The docs' rule chosen from ``running`` instead of ``preemptable()`` picks, in this
    trace with every request ending by "stop" (EOS: such a request stays running while its
    last token is in flight), a request whose last token is in flight: the run stops with
    one line naming the hook and the rule (not a KeyError later)."""

    class FromRunning(readme_policy.ShortestPrompt):
        def add(self, request, now_s):
            request.finish_reason = "stop"
            return super().add(request, now_s)

        def pick_victim(self):
            return min(reversed(self.running), key=self.num_computed_tokens)

    name = f"{NAME}_bad"
    register_policy(name)(FromRunning)
    try:
        policy = {"name": name, "async_scheduling": True}
        (run,) = run_experiment(validate(config(policy)), progress=False)
    finally:
        POLICIES.pop(name, None)
    assert run.result.failure is not None
    assert run.result.failure.startswith(
        f"SchedulerStuckError: policy '{name}': pick_victim() chose request "
    ), run.result.failure
    assert "its last token is in flight" in run.result.failure
    assert "self.preemptable()" in run.result.failure


@pytest.mark.parametrize(
    ("pick", "why"),
    [
        (lambda s: None, "pick_victim() returned None, not a request"),
        (lambda s: copy.copy(s.running[0]), "it is not one of self.running (a copy?)"),
        (lambda s: s.waiting[0] if s.waiting else s.running[0], "it is waiting, not running"),
    ],
)
def test_a_victim_that_is_no_running_request_stops_the_run(readme_policy, pick, why):
    """Whatever a pick_victim() hook returns that is not one of ``preemptable()`` (None, a
    copy of a request, a waiting request) stops the run with one line, sync and async."""

    class Bad(readme_policy.ShortestPrompt):
        def pick_victim(self):
            return pick(self)

    name = f"{NAME}_bad_pick"
    register_policy(name)(Bad)
    try:
        for async_scheduling in (False, True):
            policy = {"name": name, "async_scheduling": async_scheduling}
            (run,) = run_experiment(validate(config(policy)), progress=False)
            assert run.result.failure is not None
            assert run.result.failure.startswith(f"SchedulerStuckError: policy '{name}': ")
            assert why in run.result.failure, run.result.failure
    finally:
        POLICIES.pop(name, None)


def readme_block(first_line: str) -> str:
    text = POLICIES_DOC.read_text()
    return re.search(rf"```python\n({re.escape(first_line)}\n.*?)```", text, re.S).group(1)


def test_readme_options_example(monkeypatch):
    """The docs' options example: its option is set from the YAML entry, checked by
    check_options, and a misspelt key is refused."""
    name = f"{NAME}_short_first"
    code = readme_block("# policies/short_first.py").replace('"short_first"', f'"{name}"')
    module = types.ModuleType(f"readme_{name}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(code, "docs/policies.md", "exec"), vars(module))  # noqa: S102 - our docs
    try:
        (run,) = run_experiment(
            validate(config({"name": name, "threshold_tokens": 16})), progress=False
        )
        assert (run.requests["status"] == "finished").all()
        with pytest.raises(ConfigError, match=r"threshold_tokens: expected a finite number >= 0"):
            validate(config({"name": name, "threshold_tokens": -1}))
        typo = r"unknown key policies\[0\]\.threshold_token \(did you mean threshold_tokens\?\);"
        with pytest.raises(ConfigError, match=typo):
            validate(config({"name": name, "threshold_token": 16}))
    finally:
        POLICIES.pop(name, None)
