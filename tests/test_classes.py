"""Workload classes (traces/classes.py, ``trace:`` as a list), their config checks, the
per-class and fairness metrics (lab/results/fairness.py), hand-computed."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import run_experiment
from sched_lab.config import validate
from sched_lab.core.errors import ConfigError
from sched_lab.core.request import Request
from sched_lab.results import fairness
from sched_lab.traces.classes import load_classes

HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def azure(tmp_path, name: str, rows: list[tuple[int, int, int]]) -> str:
    """An azure2023 file: (seconds after 18:17:00, prompt, output) per row."""
    lines = [f"2023-11-16 18:17:{s:02d},{p},{o}" for s, p, o in rows]
    path = tmp_path / name
    path.write_text(HEAD + "\n".join(lines) + "\n")
    return str(path)


def two_classes(tmp_path) -> list[dict]:
    # chat at 0, 1, 2 s with a dropped row (0 output tokens) at 1 s; batch at 0, 3, 4 s at
    # rate_scale 2: 0, 1.5, 2.0.
    chat = azure(tmp_path, "chat.csv", [(0, 5, 2), (1, 5, 3), (1, 5, 0), (2, 6, 2)])
    batch = azure(tmp_path, "batch.csv", [(10, 7, 4), (13, 7, 4), (14, 8, 4)])
    return [
        {"name": "chat", "priority": 0, "tenant": "u1", "slo": {"ttft_s": 0.5},
         "format": "azure2023", "path": chat},
        {"name": "batch", "priority": 2, "tenant": "u2", "format": "azure2023", "path": batch,
         "rate_scale": 2.0},
    ]  # fmt: skip


def test_classes_merge_by_arrival_then_class_then_row(tmp_path):
    reqs, rows = load_classes(two_classes(tmp_path), tmp_path, ttft_slo_s=9.0)
    assert rows == 7
    got = [(r.request_id, r.arrival_s) for r in reqs]
    assert got[0] == ("chat:0", 0.0) and got[1] == ("batch:0", 0.0)  # tie: class order
    assert [i for i, _ in got] == [
        "chat:0", "batch:0", "chat:1", "chat:2", "batch:1", "chat:3", "batch:2"
    ]  # fmt: skip
    assert got[4][1] == 1.5 and got[5][1] == 2.0 and got[6][1] == 2.0  # tie at 2: chat first
    assert reqs[3].status.value == "dropped"  # right after the row before it in its class
    by = {r.request_id: r for r in reqs}
    assert (by["chat:1"].class_name, by["chat:1"].tenant, by["chat:1"].priority) == (
        "chat",
        "u1",
        0,
    )
    assert (by["batch:2"].priority, by["batch:2"].ttft_slo_s) == (2, 9.0)
    assert by["chat:3"].ttft_slo_s == 0.5
    again, _ = load_classes(two_classes(tmp_path), tmp_path, ttft_slo_s=9.0)
    assert [(r.request_id, r.arrival_s) for r in again] == got


def test_a_class_trace_error_names_the_class(tmp_path):
    classes = two_classes(tmp_path)
    classes[1]["limit"] = 0
    with pytest.raises(
        Exception, match=r"^trace\[1\] \(class 'batch'\)\.limit: expected an integer"
    ):
        load_classes(classes, tmp_path)


def test_a_typo_of_a_class_key_names_the_class_keys(tmp_path):
    classes = two_classes(tmp_path)
    classes[0]["priorty"] = 1
    with pytest.raises(
        Exception,
        match=r"^trace\[0\] \(class 'chat'\): unknown key 'priorty' \(did you mean 'priority'\?\); "
        r"a class's own keys: name, priority, tenant, slo, periods, lora_name, cache_salt$",
    ):
        load_classes(classes, tmp_path)


def test_periods_lay_a_class_trace_onto_its_on_time(tmp_path):
    # chat's own clock: 0, 1, (dropped at 1), 2. On [10, 11.5) then from 20 on: 1.5 s of
    # trace time in the first period (0 -> 10, 1 -> 11), the rest from 20 (2 -> 20 + 0.5).
    # batch (no periods) keeps 0, 1.5, 2.0.
    classes = two_classes(tmp_path)
    classes[0]["periods"] = [[10, 11.5], [20, None]]
    reqs, rows = load_classes(classes, tmp_path)
    got = [(r.request_id, r.arrival_s) for r in reqs]
    assert rows == 7
    assert got[:5] == [("batch:0", 0.0), ("batch:1", 1.5), ("batch:2", 2.0),
                       ("chat:0", 10.0), ("chat:1", 11.0)]  # fmt: skip
    assert got[5][0] == "chat:2" and reqs[5].status.value == "dropped"
    assert got[6] == ("chat:3", 20.5)


def test_periods_cut_what_lies_past_their_on_time(tmp_path):
    # On [5, 6.5) only: 1.5 s of chat's clock; chat:3 (at 2 on its clock) is cut, the
    # dropped row before it stays.
    classes = two_classes(tmp_path)
    classes[0]["periods"] = [[5, 6.5]]
    reqs, _ = load_classes(classes, tmp_path)
    chat = [(r.request_id, r.arrival_s) for r in reqs if r.class_name == "chat"]
    assert [i for i, _ in chat] == ["chat:0", "chat:1", "chat:2"]
    assert chat[:2] == [("chat:0", 5.0), ("chat:1", 6.0)]


def test_periods_in_yaml_round_trip_and_run(tmp_path):
    classes = two_classes(tmp_path)
    classes[1]["periods"] = [[0, 1], [3, None]]  # batch: 0 -> 0; 1.5 -> 3.5; 2.0 -> 4.0
    cfg = config(tmp_path, classes)
    assert cfg.to_dict()["trace"][1]["periods"] == [[0.0, 1.0], [3.0, None]]
    assert validate({**cfg.to_dict(), "name": "c"}, "again", tmp_path).trace == cfg.trace
    reqs, _ = load_classes(cfg.trace.to_dict(), tmp_path)
    assert [r.arrival_s for r in reqs if r.class_name == "batch"] == [0.0, 3.5, 4.0]


def test_a_class_gives_its_requests_its_adapter_and_cache_salt(tmp_path):
    classes = two_classes(tmp_path)
    classes[0] |= {"cache_salt": "u1-salt"}
    classes[1] |= {"lora_name": "sql", "cache_salt": "u2-salt"}
    cfg = config(tmp_path, classes)
    assert cfg.to_dict()["trace"][1]["lora_name"] == "sql"
    reqs, _ = load_classes(cfg.trace.to_dict(), tmp_path)
    names = {(r.class_name, r.lora_name, r.cache_salt) for r in reqs}
    assert names == {("chat", "", "u1-salt"), ("batch", "sql", "u2-salt")}


def config(tmp_path, trace, policies=("fcfs",), **top):
    return validate(
        {"name": "c", "trace": trace, "policies": list(policies), **top}, "exp.yaml", tmp_path
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"priority": "1"},
            r"exp.yaml: trace\[0\].priority: expected an integer \(lower runs first\), got '1'$",
        ),
        ({"priority": 1.5}, r"trace\[0\].priority: expected an integer"),
        ({"format": None}, r"exp.yaml: trace\[0\]: class 'chat' has no trace: give its 'format'"),
        ({"name": "batch"}, r"trace\[1\].name: expected a name used by no other class"),
        (
            {"rate_scale": [1, 2]},
            r"trace\[0\].rate_scale: expected a number \(one load per class\)",
        ),
        ({"slo": {"ttft_s": -1}}, r"trace\[0\].slo.ttft_s: expected a finite number > 0"),
        ({"cache_salt": 3}, r"exp.yaml: trace\[0\].cache_salt: expected a non-empty string, got 3$"),
        ({"lora_name": ""}, r"exp.yaml: trace\[0\].lora_name: expected a non-empty string"),
        ({"path": "nope.csv"}, r"trace\[0\].path: 'nope.csv': no such file"),
        ({"periods": "0-60"}, r"exp.yaml: trace\[0\] \(class 'chat'\).periods: expected a "
         r"non-empty list of \[start_s, end_s\] pairs in seconds of the run, 0 <= start_s < "
         r"end_s, sorted and disjoint \(the last end_s may be null: open\), got '0-60'$"),
        ({"periods": []}, r"trace\[0\] \(class 'chat'\).periods: expected a non-empty list"),
        ({"periods": [[0, "60s"]]},
         r"trace\[0\] \(class 'chat'\).periods\[0\]: expected \[start_s, end_s\], two numbers"),
        ({"periods": [[60, 60]]}, r"trace\[0\] \(class 'chat'\).periods\[0\]: expected a non-empty"),
        ({"periods": [[-1, 60]]}, r"trace\[0\] \(class 'chat'\).periods\[0\]: expected a non-empty"),
        ({"periods": [[0, 60], [30, 90]]},
         r"trace\[0\] \(class 'chat'\).periods\[1\]: expected a non-empty list"),
        ({"periods": [[0, None], [120, 180]]},
         r"trace\[0\] \(class 'chat'\).periods\[0\]: expected a non-empty list"),
    ],
)  # fmt: skip
def test_bad_classes_are_one_line(tmp_path, change, message):
    classes = two_classes(tmp_path)
    classes[0].update(change)
    classes[0] = {k: v for k, v in classes[0].items() if v is not None}
    with pytest.raises(ConfigError, match=message) as e:
        config(tmp_path, classes)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "policy, message",
    [
        ({"name": "vtc", "tenant_weights": {"u3": 2}},
         r"policies\[0\].tenant_weights: unknown tenant 'u3'; the trace's tenants: u1, u2$"),
        ({"name": "vtc", "tenant_weights": {"u1": 0}}, r"tenant_weights.u1: expected a number > 0"),
        ({"name": "sjf", "predictor": "noisy", "sigma": -0.25},
         r"policies\[0\].sigma: expected a finite number >= 0, got -0.25$"),
        ({"name": "sjf", "sigma": 0.5},
         r"policies\[0\].sigma: expected 0 with predictor oracle \(use noisy\), got 0.5$"),
        ({"name": "sjf", "predictor": "psychic"}, r"predictor: expected one of oracle, noisy, bucketed"),
        ({"name": "sjf", "buckets": [100, 10]}, r"buckets: expected increasing bucket edges"),
        ({"name": "priority", "priority_preemption": "yes"}, r"priority_preemption: expected true or false"),
        ({"name": "fcfs", "preemption_victim": "oldest"}, r"policies\[0\].preemption_victim: expected one of"),
        ({"name": "edf", "ttft_s": "1s"}, r"policies\[0\].ttft_s: expected a finite number >= 0 or null"),
    ],
)  # fmt: skip
def test_bad_policy_options_are_one_line(tmp_path, policy, message):
    with pytest.raises(ConfigError, match=message) as e:
        config(tmp_path, two_classes(tmp_path), [policy])
    assert "\n" not in str(e.value)


def test_results_per_class_and_single_trace_unchanged(tmp_path):
    cfg = config(tmp_path, two_classes(tmp_path), ["fcfs", "priority"], slo={"ttft_s": 5.0})
    assert cfg.trace.tenants == {"u1", "u2"}
    assert cfg.to_dict()["trace"][1]["rate_scale"] == 2.0  # round-trips as a list
    assert validate({**cfg.to_dict(), "name": "c"}, "again", tmp_path).trace == cfg.trace
    (tmp_path / "exp.yaml").write_text(json.dumps(cfg.to_dict()))
    out = tmp_path / "out"
    assert (
        run_experiment.main([str(tmp_path / "exp.yaml"), "--out", str(out), "--no-progress"]) == 0
    )
    req = pd.read_csv(out / "requests.csv")
    assert list(req.columns[-4:]) == ["class", "tenant", "priority", "recomputed_tokens"]
    assert set(req.loc[req.request_id.str.startswith("batch"), "priority"]) == {2}
    summary = json.loads((out / "summary.json").read_text())["fcfs"]
    assert set(summary["classes"]) == {"chat", "batch"}
    chat = summary["classes"]["chat"]
    assert (chat["num_prompts"], chat["dropped"], chat["slo"]) == (3, 1, {"ttft_s": 0.5})
    assert summary["classes"]["batch"]["slo"] == {"ttft_s": 5.0}
    assert summary["tenants"]["u2"]["num_prompts"] == 3
    assert "## Per class" in (out / "report.md").read_text()
    assert (out / "tenant_service.png").is_file() and (out / "ttft_by_class.png").is_file()
    # One trace: no class columns or keys.
    single = config(tmp_path, {"format": "azure2023", "path": two_classes(tmp_path)[0]["path"]})
    (tmp_path / "one.yaml").write_text(json.dumps(single.to_dict()))
    out1 = tmp_path / "out1"
    assert (
        run_experiment.main([str(tmp_path / "one.yaml"), "--out", str(out1), "--no-progress"]) == 0
    )
    assert "class" not in pd.read_csv(out1 / "requests.csv").columns
    assert "classes" not in json.loads((out1 / "summary.json").read_text())["fcfs"]


def test_limit_is_shared_among_classes(tmp_path):
    cfg = config(tmp_path, two_classes(tmp_path)).with_trace(limit=4)
    assert [c["limit"] for c in cfg.trace.classes] == [2, 2]


# ----------------------------------------------------------------------------- fairness
def test_jain_index_and_max_service_difference():
    # Windows of 1 s. A serves 4, 4, 0 and is backlogged in the first two; B serves 2, 2, 2,
    # backlogged throughout. Jain per window with both: (4 + 2)^2 / (2 (16 + 4)) = 0.9; the
    # third has one backlogged tenant only. A - B over windows 0-1: 2 + 2 = 4.
    edges = np.array([0.0, 1.0, 2.0, 3.0])
    service = {"A": np.array([4.0, 4.0, 0.0]), "B": np.array([2.0, 2.0, 2.0])}
    backlog = {"A": np.array([True, True, False]), "B": np.array([True, True, True])}
    f = fairness.fairness(edges, service, backlog)
    assert f["jain_index"] == {"mean": pytest.approx(0.9), "min": pytest.approx(0.9), "windows": 2}
    assert f["max_service_difference"] == 4.0
    # The difference is over intervals: +3 then -5 gives a swing of 5 (from window 1 to 2).
    service = {"A": np.array([5.0, 0.0, 0.0]), "B": np.array([2.0, 5.0, 0.0])}
    backlog = {"A": np.array([True, True, True]), "B": np.array([True, True, True])}
    assert fairness.fairness(edges, service, backlog)["max_service_difference"] == 5.0


def test_service_charges_the_prompt_at_admission_and_each_token_when_produced():
    # 120 s, so windows of 1 s. a (tenant A, prompt 10): admitted at 0.5, tokens at 1.5
    # and 2.5 -> 10 in window 0, 2 in windows 1 and 2. b (B, prompt 4) admitted at 2.2 and
    # aborted before a token: its prompt is charged (VTC charged it at admission).
    a, b = Request("a", 0.2, 10, 2, tenant="A"), Request("b", 2.0, 4, 3, tenant="B")
    a.first_scheduled_s, b.first_scheduled_s, b.finish_s = 0.5, 2.2, 2.4

    class Tokens:
        def token_times(self, r):
            return np.array([1.5, 2.5] if r is a else [])

    edges, service, _ = fairness.tenant_service([a, b], Tokens(), 120.0)
    assert edges[1] == 1.0
    assert service["A"][:4].tolist() == [10.0, 2.0, 2.0, 0.0] and service["A"].sum() == 14.0
    assert service["B"][:4].tolist() == [0.0, 0.0, 4.0, 0.0] and service["B"].sum() == 4.0


def test_backlogged_means_waiting_through_the_whole_window():
    # Waiting intervals [0.5, 2.5) and [2.5, 3.2): windows [0, 1) no (starts at 0.5),
    # [1, 2) and [2, 3) yes (the hand-over at 2.5 leaves no gap), [3, 4) no.
    a, b = Request("a", 0.5, 1, 1), Request("b", 2.5, 1, 1)
    a.first_scheduled_s, b.first_scheduled_s = 2.5, 3.2
    got = fairness._backlogged([a, b], np.array([0.0, 1.0, 2.0, 3.0, 4.0]))
    assert got.tolist() == [False, True, True, False]


def test_docs_workload_classes_yaml_is_valid():
    import re
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parent.parent / "docs" / "traces.md").read_text()
    zoo = text[text.index("## Workload classes") :]
    block = re.search(r"```yaml\n(.*?)```", zoo, re.S).group(1)
    cfg = validate({"name": "readme", **yaml.safe_load(block)}, "docs/traces.md")
    assert [c["name"] for c in cfg.trace.classes] == ["chat", "batch"]
    assert [p.name for p in cfg.policies] == ["fcfs", "priority", "sjf", "vtc"]
