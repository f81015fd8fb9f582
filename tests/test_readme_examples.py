"""The policy example of docs/policies.md and the Python API example of docs/python_api.md, run
as written (so they cannot rot)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

from helpers import by_id, run

from sched_lab.core import scheduler

DOCS = Path(__file__).resolve().parent.parent / "docs"
NAME = "test_readme_shortest_prompt"


def test_readme_policy_example_works(monkeypatch):
    text = (DOCS / "policies.md").read_text()
    code = re.search(r"```python\n(# policies/shortest_prompt\.py\n.*?)```", text, re.S).group(1)
    # Under a name of its own: a user who saved the example as policies/shortest_prompt.py
    # has registered "shortest_prompt" already.
    assert '@register_policy("shortest_prompt")' in code
    code = code.replace('"shortest_prompt"', f'"{NAME}"')
    module = types.ModuleType(f"readme_{NAME}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    try:
        exec(compile(code, "docs/policies.md", "exec"), module.__dict__)  # noqa: S102 - our docs
        # Budget 64 tokens, no chunking: "short" (4) is tried before "long" (60); both fit
        # the budget (64) and the 8 blocks of 16 tokens (1 + 4), so both start at once.
        res = run(
            NAME,
            [("long", 0.0, 60, 2), ("short", 0.0, 4, 2)],
            budget=64,
            max_model_len=64,
        )
        r = by_id(res)
        assert r["short"].first_scheduled_s == r["long"].first_scheduled_s == 0.0
        # "big" (60) arrives as early as "mid" (40) and is listed first, but mid is admitted
        # first; big does not fit the 24 tokens left and waits for the next step (10 ms).
        res = run(
            NAME,
            [("big", 0.0, 60, 1), ("mid", 0.0, 40, 1)],
            budget=64,
            max_model_len=64,
        )
        r = by_id(res)
        assert (r["mid"].first_scheduled_s, r["big"].first_scheduled_s) == (0.0, 0.01)
        # Victim: 4 blocks of 4 tokens. Step 1 prefills a (2 + 1 sampled = 3 tokens, 1 block)
        # and b (6 + 1 = 7 tokens, 2 blocks). Planning step 2, a (holding 4 slots' worth: its
        # next token is the 4th) and b (8th) both need a block and 1 is free: the default
        # would preempt b (newest); this policy preempts a (2 computed tokens vs b's 6). The
        # freed block goes to b, and a is never preempted again nor b at all.
        res = run(
            NAME,
            [("a", 0.0, 2, 6), ("b", 0.0, 6, 6)],
            gpu_blocks=4,
            block_size=4,
            budget=64,
            max_model_len=64,
        )
        r = by_id(res)
        assert (r["a"].num_preemptions, r["b"].num_preemptions) == (1, 0)
    finally:
        scheduler.POLICIES.pop(NAME, None)


def test_readme_python_api_example_works(tmp_path, monkeypatch, capsys):
    """docs/python_api.md's block as written, from a folder outside the checkout."""
    code = re.search(r"```python\n(.*?)```", (DOCS / "python_api.md").read_text(), re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/python_api.md", "exec"), {})  # noqa: S102 - our docs
    out = capsys.readouterr().out
    assert "chunked_prefill" in out and "fcfs" in out
    assert float(out.splitlines()[-1]) > 0  # the first run's p99_ttft_ms
    folder = tmp_path / "results" / "api_example"
    assert {"requests.csv", "steps.csv", "summary.json", "report.md"} <= {
        p.name for p in folder.iterdir()
    }
    import pandas as pd

    requests = pd.read_csv(folder / "requests.csv")
    assert len(requests) == 3 * 2000  # three policies, the first 2,000 requests each
