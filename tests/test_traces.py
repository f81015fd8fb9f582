"""Tests for traces/: the loaders on the shipped files, exact values on tiny files, the common
options, synthetic arrivals, and one test per malformed input (message substring asserted)."""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from sched_lab.core.errors import TraceError, UserError
from sched_lab.traces import load_trace
from sched_lab.traces.arrivals import ArrivalProcess
from sched_lab.traces.readers import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "traces" / "data"
BAD = Path(__file__).resolve().parent / "data" / "bad_traces"

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
SARATHI = "traces/data/sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv"


def load(**spec: Any) -> list:
    return load_trace(spec, ROOT)


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def azure_file(tmp_path: Path, seconds: list[int]) -> str:
    """An Azure-format file with one request at each whole second after 18:17:00."""
    rows = [f"2023-11-16 18:17:{s:02d}.0000000,{100 + i},{10 + i}\n" for i, s in enumerate(seconds)]
    return write(tmp_path, "azure.csv", AZURE_HEADER + "".join(rows))


def ids(requests: list) -> list[str]:
    return [r.request_id for r in requests]


def arrivals(requests: list) -> list[float]:
    return [r.arrival_s for r in requests]


def replayed(requests: list) -> list:
    return [r for r in requests if r.status.value != "dropped"]


def dropped_rows(requests: list) -> dict[str, str]:
    """request id -> reason of the dropped rows (checking they have no arrival time)."""
    out = {r.request_id: r.reason for r in requests if r.status.value == "dropped"}
    assert all(math.isnan(r.arrival_s) for r in requests if r.request_id in out)
    return out


# --- the shipped files ---------------------------------------------------------------------

SHA256 = {  # from traces/data/ATTRIBUTION.md (and the lab's SOURCES.md)
    "azure2023_conv.csv": "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
    "azure2023_code.csv": "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
    "burstgpt1_first400rows.csv": "7865fda5dac50938a84dfccb06c405e2f5202969ecfbd671c8399de00f4335f0",
    "burstgpt3_first400rows.csv": "5465fc4c38b0815b8f75d126a120c229ae93632d62e3adf1792f5e8401a73559",
    "mooncake_conversation_trace.jsonl": (
        "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"
    ),
    "sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv": (
        "6d6c296302a853e2669a674a96f269283e60c57e60363bd450588a1066919f9f"
    ),
    "vidur_arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv": (
        "9d3580538d915ca75e4aaaa54590b42dbb17abc6d74c8913310cf07c232adcdc"
    ),
}


@pytest.mark.parametrize("name", sorted(SHA256))
def test_data_files_are_unmodified(name: str) -> None:
    assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == SHA256[name]


def test_azure_conv_real_file() -> None:
    requests = load(format="azure2023", path="traces/data/azure2023_conv.csv")
    assert len(requests) == 19_366
    assert requests[0].arrival_s == 0.0
    assert requests[-1].arrival_s == pytest.approx(3501.721937, abs=1e-9)  # span ~3502 s
    assert ids(requests)[:3] == ["0", "1", "2"] and requests[-1].request_id == "19365"
    assert (requests[0].prompt_len, requests[0].output_len) == (374, 44)
    assert np.all(np.diff(arrivals(requests)) >= 0)


def test_azure_code_real_file() -> None:
    requests = load(format="azure2023", path="traces/data/azure2023_code.csv")
    assert len(requests) == 8_819
    # The first three rows of the file: 03.9799600, 04.0319600, 04.0781490.
    assert arrivals(requests)[:3] == pytest.approx([0.0, 0.052, 0.098189], abs=1e-9)


def test_mooncake_real_file() -> None:
    requests = load(format="mooncake", path="traces/data/mooncake_conversation_trace.jsonl")
    assert len(requests) == 12_031
    assert requests[0].hash_ids == list(range(14))
    assert requests[-1].arrival_s == pytest.approx(3536.999, abs=1e-9)  # last timestamp, ms
    # 512-token blocks: every request carries ceil(input / 512) hashes (SOURCES.md §3).
    assert all(len(r.hash_ids) == math.ceil(r.prompt_len / 512) for r in requests)


@pytest.mark.parametrize(
    ("name", "kept", "dropped", "dropped_id"),
    [
        ("burstgpt1_first400rows.csv", 383, 17, "20"),  # 17 failed rows, all 0/0/0
        ("burstgpt3_first400rows.csv", 399, 1, "115"),
    ],
)
def test_burstgpt_real_files_drop_failed_rows(
    name: str,
    kept: int,
    dropped: int,
    dropped_id: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="sched_lab.traces"):
        every = load(format="burstgpt", path=f"traces/data/{name}")
    requests = replayed(every)
    assert len(every) == 400 and len(requests) == kept
    assert dropped_id not in ids(requests)
    assert f"{name}: dropped {dropped} of 400 rows with 'Response tokens' == 0" in caplog.text
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in requests)
    reasons = dropped_rows(every)
    assert len(reasons) == dropped
    assert reasons[dropped_id] == (
        f"not replayed: 'Response tokens' == 0 in {name} (failed requests in the source)"
    )


def test_burstgpt_model_filter_real_file() -> None:
    # burstgpt1 has 80 GPT-4 rows, 3 of them failed.
    every = load(
        format="burstgpt",
        path="traces/data/burstgpt1_first400rows.csv",
        models=["GPT-4"],
    )
    requests = replayed(every)
    assert len(every) == 80 and len(requests) == 77 and len(dropped_rows(every)) == 3
    assert requests[0].request_id == "2" and requests[0].arrival_s == 0.0


def test_lengths_real_file_sequential() -> None:
    requests = load(format="lengths", path=SARATHI, num_requests=1000, arrival={"rate": 10.0})
    assert ids(requests) == [str(i) for i in range(1000)]
    assert (requests[0].prompt_len, requests[0].output_len) == (
        74,
        918,
    )  # first data row


# --- exact values on tiny files ------------------------------------------------------------


def test_azure_exact_arrivals(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "a.csv",
        AZURE_HEADER + "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:04.0319600,3180,8",
    )
    requests = load(format="azure2023", path=path)
    assert arrivals(requests) == pytest.approx([0.0, 0.052], abs=1e-9)
    assert [(r.prompt_len, r.output_len) for r in requests] == [(4808, 10), (3180, 8)]


def test_azure_zero_output_rows_dropped_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(
        tmp_path,
        "z.csv",
        AZURE_HEADER + "2023-11-16 18:17:01,5,0\n"
        "2023-11-16 18:17:02,6,3\n2023-11-16 18:17:05,7,0\n",
    )
    with caplog.at_level(logging.INFO, logger="sched_lab.traces"):
        every = load(format="azure2023", path=path)
    assert ids(every) == ["0", "1", "2"]  # every row, in source order
    requests = replayed(every)
    assert ids(requests) == ["1"]
    assert requests[0].arrival_s == 0.0  # re-based to the first replayed request
    assert "z.csv: dropped 2 of 3 rows with 'GeneratedTokens' == 0" in caplog.text
    why = "not replayed: 'GeneratedTokens' == 0 in z.csv (a request needs >= 1 output token)"
    assert dropped_rows(every) == {"0": why, "2": why}


def test_burstgpt_zero_request_tokens_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(
        tmp_path,
        "b.csv",
        BURSTGPT_HEADER + "10,ChatGPT,5,5,10,API log\n"
        "12,GPT-4,0,7,7,API log\n13,GPT-4,0,0,0,API log\n20,GPT-4,3,4,7,API log\n",
    )
    with caplog.at_level(logging.INFO, logger="sched_lab.traces"):
        every = load(format="burstgpt", path=path)
    requests = replayed(every)
    assert ids(requests) == ["0", "3"] and arrivals(requests) == [0.0, 10.0]
    assert "dropped 1 of 4 rows with 'Response tokens' == 0" in caplog.text
    assert "dropped 1 of 3 rows with 'Request tokens' == 0" in caplog.text
    assert dropped_rows(every) == {  # the first rule that applies names the row's reason
        "1": "not replayed: 'Request tokens' == 0 in b.csv (a prompt needs >= 1 token)",
        "2": "not replayed: 'Response tokens' == 0 in b.csv (failed requests in the source)",
    }


def test_burstgpt3_layout_and_filters(tmp_path: Path) -> None:
    header = (
        "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,"
        "Total tokens,Log Type\n"
    )
    path = write(
        tmp_path,
        "b3.csv",
        header + "100.0,s1,4,GPT-4,9,3,12,Conversation log\n"
        "102.0,,2,ChatGPT,8,2,10,API log\n103.5,,2,GPT-4,7,1,8,API log\n",
    )
    requests = load(format="burstgpt", path=path, models=["GPT-4"], log_types=["API log"])
    assert ids(requests) == ["2"] and arrivals(requests) == [0.0]
    # The window is on the file's clock (first row = 0 s) even with filters.
    requests = load(format="burstgpt", path=path, models=["GPT-4"], start_s=3.5)
    assert ids(requests) == ["2"]


def test_mooncake_exact_values(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(
        tmp_path,
        "m.jsonl",
        '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]}\n'
        '{"timestamp": 1500, "input_length": 10, "output_length": 0, "hash_ids": [9]}\n'
        '{"timestamp": 3000, "input_length": 20, "output_length": 2}\n',
    )
    with caplog.at_level(logging.INFO, logger="sched_lab.traces"):
        requests = replayed(load(format="mooncake", path=path))
    assert ids(requests) == ["0", "2"] and arrivals(requests) == [0.0, 3.0]
    assert requests[0].hash_ids == [7, 8] and requests[1].hash_ids is None
    assert "m.jsonl: dropped 1 of 3 rows with 'output_length' == 0" in caplog.text


def test_jsonl_integers_of_at_most_100_digits(tmp_path: Path) -> None:
    # Lines with no run of 101 digits skip the per-integer check; a longer run in a string
    # takes the checked path and is read as before.
    keys = ["timestamp", "input_length", "output_length"]
    ok, digits = "9" * 100, "1" * 150
    path = write(
        tmp_path,
        "m.jsonl",
        f'{{"timestamp": {ok}, "input_length": 3, "output_length": 2}}\n'
        f'{{"timestamp": 5, "input_length": 4, "output_length": 1, "note": "{digits}"}}\n',
    )
    frame, lines = read_jsonl(Path(path), keys)
    assert list(frame["timestamp"]) == [10**100 - 1, 5] and lines == [1, 2]
    assert list(frame["input_length"]) == [3, 4] and list(frame.columns) == keys
    bad = write(
        tmp_path, "b.jsonl", f'{{"timestamp": 1{ok}, "input_length": 3, "output_length": 2}}\n'
    )
    with pytest.raises(
        TraceError,
        match=r"^b\.jsonl: line 1: an integer of 101 digits \(199999999999\.\.\.\); "
        r"at most 100 are accepted$",
    ):
        read_jsonl(Path(bad), keys)


def test_mooncake_lora_name_and_cache_salt_per_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "m.jsonl",
        '{"timestamp": 0, "input_length": 8, "output_length": 1, "cache_salt": "t1"}\n'
        '{"timestamp": 1000, "input_length": 8, "output_length": 0, "lora_name": "x"}\n'
        '{"timestamp": 2000, "input_length": 8, "output_length": 1, "lora_name": "sql",'
        ' "cache_salt": null}\n'
        '{"timestamp": 3000, "input_length": 8, "output_length": 1}\n',
    )
    requests = load(format="mooncake", path=path, start_s=0.5)  # rows 1 (dropped) to 3
    assert [(r.lora_name, r.cache_salt) for r in requests] == [("x", ""), ("sql", ""), ("", "")]
    assert [r.cache_salt for r in load(format="mooncake", path=path)][:1] == ["t1"]


# --- common options: window, limit, rate_scale ---------------------------------------------


def test_window_is_half_open_and_rebased(tmp_path: Path) -> None:
    path = azure_file(tmp_path, [0, 1, 2, 3, 4, 5])
    requests = load(format="azure2023", path=path, start_s=1, end_s=4)
    assert ids(requests) == ["1", "2", "3"]
    assert arrivals(requests) == [0.0, 1.0, 2.0]


def test_window_then_limit_then_rate_scale(tmp_path: Path) -> None:
    path = azure_file(tmp_path, [0, 1, 3, 6, 10])
    requests = load(format="azure2023", path=path, start_s=1, limit=3, rate_scale=2.0)
    assert ids(requests) == ["1", "2", "3"]
    assert arrivals(requests) == [0.0, 1.0, 2.5]  # gaps 2 s and 3 s halved


def test_dropped_rows_follow_the_window_and_limit(tmp_path: Path) -> None:
    # Rows at 0..5 s; rows 1, 2 and 4 have 0 output tokens (dropped, not replayed).
    rows = [(0, 3), (1, 0), (2, 0), (3, 4), (4, 0), (5, 6)]
    text = "".join(f"2023-11-16 18:17:0{t}.0000000,10,{out}\n" for t, out in rows)
    path = write(tmp_path, "d.csv", AZURE_HEADER + text)
    # Window [1, 6): the first replayed request (row 3, at 3 s) arrives at 0.
    every = load(format="azure2023", path=path, start_s=1)
    assert ids(every) == ["1", "2", "3", "4", "5"]
    assert ids(replayed(every)) == ["3", "5"] and arrivals(replayed(every)) == [0.0, 2.0]
    assert set(dropped_rows(every)) == {"1", "2", "4"}
    # limit: the first N replayed requests and the dropped rows among them.
    every = load(format="azure2023", path=path, limit=2)
    assert ids(every) == ["0", "1", "2", "3"] and ids(replayed(every)) == ["0", "3"]
    for limit in (3, 100):  # no fewer replayed requests than there are: every row
        assert ids(load(format="azure2023", path=path, limit=limit)) == [str(i) for i in range(6)]
    with pytest.raises(TraceError, match="keeps no request"):  # only dropped rows in it
        load(format="azure2023", path=path, start_s=1, end_s=3)


def test_rate_scale_divides_interarrival_times(tmp_path: Path) -> None:
    path = azure_file(tmp_path, [0, 1, 3])
    assert arrivals(load(format="azure2023", path=path, rate_scale=0.5)) == [
        0.0,
        2.0,
        6.0,
    ]


def test_yaml_example_from_an_experiment() -> None:
    spec = yaml.safe_load(
        "{format: azure2023, path: traces/data/azure2023_conv.csv, limit: 1000,"
        " start_s: 0, end_s: 600, rate_scale: 2.0, seed: 0}"
    )
    requests = load_trace(spec, ROOT)
    unscaled = load_trace({**spec, "rate_scale": 1.0}, ROOT)
    assert len(requests) == 1000 and ids(requests) == [str(i) for i in range(1000)]
    assert arrivals(requests) == pytest.approx([t / 2 for t in arrivals(unscaled)], abs=1e-12)


def test_absolute_and_relative_paths_agree(tmp_path: Path) -> None:
    relative = load(format="azure2023", path="traces/data/azure2023_code.csv", limit=5)
    absolute = load(format="azure2023", path=str(DATA / "azure2023_code.csv"), limit=5)
    assert arrivals(relative) == arrivals(absolute) and ids(relative) == ids(absolute)


# --- synthetic arrivals and lengths --------------------------------------------------------


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_gamma_arrivals_mean_and_cv(burstiness: float) -> None:
    rate = 4.0
    times = ArrivalProcess(rate, burstiness).sample(20_000, np.random.default_rng(0))
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    # Standard error of the mean gap is (1/rate) * CV / sqrt(n) <= 0.36% here; allow 3%.
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once() -> None:
    requests = load(
        format="synthetic",
        num_requests=4,
        arrival={"rate": math.inf},
        prompt_len=8,
        output_len=2,
    )
    assert arrivals(requests) == [0.0] * 4


SYNTHETIC = {
    "format": "synthetic",
    "num_requests": 2000,
    "arrival": {"process": "gamma", "rate": 5.0, "burstiness": 0.5},
    "prompt_len": {"lognormal": {"mean": 1000, "sigma": 0.5}},
    "output_len": {"uniform": [1, 4]},
}


def test_same_spec_and_seed_give_identical_requests() -> None:
    first, second = load_trace(SYNTHETIC, ROOT), load_trace(dict(SYNTHETIC), ROOT)
    key = [(r.request_id, r.arrival_s, r.prompt_len, r.output_len) for r in first]
    assert key == [(r.request_id, r.arrival_s, r.prompt_len, r.output_len) for r in second]
    other = load_trace({**SYNTHETIC, "seed": 1}, ROOT)
    assert arrivals(other) != arrivals(first)


def test_synthetic_length_distributions() -> None:
    requests = load_trace(SYNTHETIC, ROOT)
    prompts = np.array([r.prompt_len for r in requests])
    outputs = {r.output_len for r in requests}
    assert ids(requests)[:2] == ["0", "1"]
    assert outputs == {1, 2, 3, 4}  # inclusive bounds, all hit in 2000 draws
    assert prompts.min() >= 1 and prompts.mean() == pytest.approx(1000, rel=0.05)
    requests = load(
        format="synthetic",
        num_requests=50,
        arrival={"rate": 1.0},
        prompt_len={"choice": [16, 32]},
        output_len=7,
    )
    assert {r.prompt_len for r in requests} == {16, 32} and {r.output_len for r in requests} == {7}


def test_changing_lengths_keeps_arrivals() -> None:
    other = load_trace({**SYNTHETIC, "output_len": 3}, ROOT)
    assert arrivals(other) == arrivals(load_trace(SYNTHETIC, ROOT))


def test_lengths_shuffle_is_seeded_and_uses_each_row_once() -> None:
    spec = {
        "format": "lengths",
        "path": SARATHI,
        "num_requests": 500,
        "sample": "shuffle",
        "arrival": {"process": "poisson", "rate": 2.0},
        "seed": 3,
    }
    first, second = load_trace(spec, ROOT), load_trace(spec, ROOT)
    assert ids(first) == ids(second) and arrivals(first) == arrivals(second)
    assert len(set(ids(first))) == 500 and ids(first) != [str(i) for i in range(500)]


# --- malformed files: one clear line each --------------------------------------------------

BAD_FILES = [
    ("azure2023", "empty.csv", "empty.csv: empty file (no data rows)"),
    (
        "azure2023",
        "azure_header_only.csv",
        "azure_header_only.csv: empty file (no data rows)",
    ),
    (
        "azure2023",
        "azure_missing_column.csv",
        (
            "azure_missing_column.csv: missing column 'GeneratedTokens'; "
            "expected columns: TIMESTAMP, ContextTokens, GeneratedTokens"
        ),
    ),
    (
        "azure2023",
        "azure_prompt_not_number.csv",
        (
            "azure_prompt_not_number.csv: row 2, column 'ContextTokens': "
            "expected an integer token count, got 'abc'"
        ),
    ),
    (
        "azure2023",
        "azure_prompt_negative.csv",
        (
            "azure_prompt_negative.csv: row 3, column 'ContextTokens': "
            "expected a token count >= 1, got '-5'"
        ),
    ),
    (
        "azure2023",
        "azure_prompt_zero.csv",
        "azure_prompt_zero.csv: row 1, column 'ContextTokens': expected a token count >= 1, got '0'",
    ),
    (
        "azure2023",
        "azure_prompt_empty.csv",
        (
            "azure_prompt_empty.csv: row 2, column 'ContextTokens': "
            "expected an integer token count, got '' (empty)"
        ),
    ),
    (
        "azure2023",
        "azure_output_negative.csv",
        (
            "azure_output_negative.csv: row 2, column 'GeneratedTokens': "
            "expected a token count >= 0, got '-1'"
        ),
    ),
    (
        "azure2023",
        "azure_output_fraction.csv",
        (
            "azure_output_fraction.csv: row 2, column 'GeneratedTokens': "
            "expected an integer token count, got '8.5'"
        ),
    ),
    (
        "azure2023",
        "azure_timestamp_nan.csv",
        (
            "azure_timestamp_nan.csv: row 2, column 'TIMESTAMP': expected a timestamp like "
            "'2023-11-16 18:17:03.9799600', got 'NaN'"
        ),
    ),
    (
        "azure2023",
        "azure_timestamp_unparsable.csv",
        "azure_timestamp_unparsable.csv: row 3, column 'TIMESTAMP': expected a timestamp",
    ),
    (
        "azure2023",
        "azure_timestamp_bad_date.csv",
        "azure_timestamp_bad_date.csv: row 2, column 'TIMESTAMP': expected a timestamp",
    ),
    (
        "azure2023",
        "azure_unsorted.csv",
        (
            "azure_unsorted.csv: row 3, column 'TIMESTAMP': time goes backwards "
            "('2023-11-16 18:17:04.0000000' after '2023-11-16 18:17:04.0319600')"
        ),
    ),
    (
        "azure2023",
        "azure_extra_field.csv",
        "azure_extra_field.csv: cannot parse as CSV",
    ),
    (  # pandas would rename the second one and the first would be used without a word
        "azure2023",
        "azure_repeated_column.csv",
        "azure_repeated_column.csv: column 'ContextTokens' appears more than once in the header",
    ),
    (
        "azure2023",
        "azure_all_output_zero.csv",
        (
            "azure_all_output_zero.csv: no request left after dropping rows with "
            "'GeneratedTokens' == 0"
        ),
    ),
    (
        "burstgpt",
        "burstgpt_timestamp_empty.csv",
        (
            "burstgpt_timestamp_empty.csv: row 2, column 'Timestamp': expected a finite number, "
            "got '' (empty)"
        ),
    ),
    (
        "burstgpt",
        "burstgpt_unsorted.csv",
        "burstgpt_unsorted.csv: row 3, column 'Timestamp': time goes backwards ('40' after '45')",
    ),
    (
        "burstgpt",
        "burstgpt_request_negative.csv",
        (
            "burstgpt_request_negative.csv: row 2, column 'Request tokens': "
            "expected a token count >= 0, got '-3'"
        ),
    ),
    (
        "burstgpt",
        "burstgpt_missing_column.csv",
        (
            "burstgpt_missing_column.csv: missing column 'Request tokens'; "
            "expected columns: Timestamp, Request tokens, Response tokens"
        ),
    ),
    (
        "mooncake",
        "mooncake_bad_json.jsonl",
        "mooncake_bad_json.jsonl: line 2: not valid JSON",
    ),
    (
        "mooncake",
        "mooncake_missing_key.jsonl",
        (
            "mooncake_missing_key.jsonl: line 3: missing key 'output_length'; "
            "expected keys: timestamp, input_length, output_length"
        ),
    ),
    (
        "mooncake",
        "mooncake_input_not_number.jsonl",
        (
            "mooncake_input_not_number.jsonl: line 2, key 'input_length': "
            "expected an integer token count, got 'many'"
        ),
    ),
    (
        "mooncake",
        "mooncake_unsorted.jsonl",
        "mooncake_unsorted.jsonl: line 2, key 'timestamp': time goes backwards (0 after 3000)",
    ),
    (
        "mooncake",
        "mooncake_bad_hash_ids.jsonl",
        "mooncake_bad_hash_ids.jsonl: line 1, key 'hash_ids': expected a list of integers",
    ),
    (
        "mooncake",
        "mooncake_timestamp_null.jsonl",
        "mooncake_timestamp_null.jsonl: line 1, key 'timestamp': expected a finite number, got null",
    ),
    (
        "lengths",
        "lengths_prefill_zero.csv",
        (
            "lengths_prefill_zero.csv: row 2, column 'num_prefill_tokens': "
            "expected a token count >= 1, got '0'"
        ),
    ),
]


@pytest.mark.parametrize(("fmt", "name", "message"), BAD_FILES, ids=[b[1] for b in BAD_FILES])
def test_malformed_file(fmt: str, name: str, message: str) -> None:
    spec: dict[str, Any] = {"format": fmt, "path": str(BAD / name)}
    if fmt == "lengths":
        spec["arrival"] = {"rate": 1.0}
    with pytest.raises(TraceError) as info:
        load_trace(spec, ROOT)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, UserError)


def test_missing_file_names_the_path() -> None:
    with pytest.raises(
        TraceError, match="trace file not found: .*nope.csv .*trace.path = 'nope.csv'"
    ):
        load(format="azure2023", path="nope.csv")


# --- malformed specs -----------------------------------------------------------------------

AZURE = {"format": "azure2023", "path": "traces/data/azure2023_code.csv"}
LENGTHS = {"format": "lengths", "path": SARATHI, "arrival": {"rate": 1.0}}
SMALL_SYNTHETIC = {
    "format": "synthetic",
    "num_requests": 3,
    "arrival": {"rate": 1.0},
    "prompt_len": 4,
    "output_len": 2,
}

BAD_SPECS = [
    (["azure2023"], "trace: expected a mapping, got ['azure2023'] (list)"),
    ({"path": "x.csv"}, "trace: missing required key 'format'"),
    (
        {"format": "azure"},
        (
            "trace.format: unknown format 'azure'; known formats: azure2023, burstgpt, lengths, "
            "mooncake, prompts, synthetic"
        ),
    ),
    (
        {**AZURE, "limt": 10},
        (
            "trace: unknown key 'limt' (did you mean 'limit'?); allowed keys: end_s, format, "
            "hash_block_size, limit, path, prefix, rate_scale, seed, start_s"
        ),
    ),
    ({**SMALL_SYNTHETIC, "path": "x.csv"}, "trace: unknown key 'path'"),
    (
        {**AZURE, "limit": "ten"},
        "trace.limit: expected an integer >= 1, got 'ten' (str)",
    ),
    ({**AZURE, "limit": 0}, "trace.limit: expected an integer >= 1, got 0 (int)"),
    ({**AZURE, "seed": 1.5}, "trace.seed: expected an integer >= 0, got 1.5 (float)"),
    (
        {**AZURE, "rate_scale": 0},
        "trace.rate_scale: expected a number > 0 (finite), got 0 (int)",
    ),
    (
        {**AZURE, "rate_scale": -2.0},
        "trace.rate_scale: expected a number > 0 (finite), got -2.0",
    ),
    (
        {**AZURE, "rate_scale": "2x"},
        "trace.rate_scale: expected a number > 0 (finite), got '2x'",
    ),
    (
        {**AZURE, "start_s": -1},
        "trace.start_s: expected a number >= 0 (finite), got -1 (int)",
    ),
    (
        {**AZURE, "start_s": 10, "end_s": 10},
        "trace.end_s: must be greater than start_s (10), got 10",
    ),
    (
        {**AZURE, "start_s": 5000},
        (
            "trace window start_s=5000, end_s=inf keeps no request; the trace's requests arrive "
            "from 0 s to 3435.95 s"
        ),
    ),
    ({**AZURE, "path": 3}, "trace.path: expected a file path (string), got 3 (int)"),
    ({"format": "azure2023"}, "trace: missing required key 'path'"),
    (
        {
            "format": "burstgpt",
            "path": "traces/data/burstgpt1_first400rows.csv",
            "models": ["gpt-4"],
        },
        (
            "trace.models: 'gpt-4' does not occur in column 'Model' of burstgpt1_first400rows.csv; "
            "values present: ChatGPT, GPT-4"
        ),
    ),
    (
        {
            "format": "burstgpt",
            "path": "traces/data/burstgpt1_first400rows.csv",
            "models": "GPT-4",
        },
        "trace.models: expected a non-empty list of strings, got 'GPT-4' (str)",
    ),
    (
        {**LENGTHS, "num_requests": 40_000},
        (
            "trace.num_requests: 40000 is more than the 30731 usable rows of "
            "sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
        ),
    ),
    (
        {**LENGTHS, "sample": "random"},
        "trace.sample: expected one of sequential, shuffle; got 'random' (str)",
    ),
    (
        {**LENGTHS, "arrival": {"rate": 1.0, "shape": 2}},
        "trace.arrival: unknown key 'shape'; allowed keys: burstiness, process, rate",
    ),
    (
        {**LENGTHS, "arrival": {"process": "poisson", "rate": 1.0, "burstiness": 2}},
        "trace.arrival.burstiness: a poisson process has burstiness 1, got 2",
    ),
    (
        {**LENGTHS, "arrival": {"process": "weibull", "rate": 1.0}},
        "trace.arrival.process: expected one of poisson, gamma; got 'weibull' (str)",
    ),
    (
        {**LENGTHS, "arrival": {"process": "gamma"}},
        "trace.arrival: missing required key 'rate'",
    ),
    (
        {**LENGTHS, "arrival": {"rate": 0}},
        "trace.arrival.rate: expected a number > 0, got 0 (int)",
    ),
    (
        {**SMALL_SYNTHETIC, "prompt_len": 0},
        "trace.prompt_len: expected one of: an integer; {uniform: [lo, hi]}",
    ),
    (
        {**SMALL_SYNTHETIC, "output_len": {"uniform": [5, 2]}},
        "trace.output_len.uniform: expected lo <= hi, got [5, 2]",
    ),
    (
        {**SMALL_SYNTHETIC, "output_len": {"lognormal": {"mean": 100}}},
        "trace.output_len.lognormal: missing required key 'sigma'",
    ),
    (
        {**SMALL_SYNTHETIC, "prompt_len": {"choice": []}},
        "trace.prompt_len.choice: expected a non-empty list of integers in "
        "1..1,099,511,627,776, got []",
    ),
    (  # lengths beyond MAX_TOKENS (2**40) would overflow int64 sums downstream
        {**SMALL_SYNTHETIC, "prompt_len": 10**23},
        "(token counts in 1..1,099,511,627,776), got 100000000000000000000000",
    ),
    (
        {**SMALL_SYNTHETIC, "prompt_len": {"uniform": [1, 2**41]}},
        "trace.prompt_len.uniform: expected [lo, hi], integers in 1..1,099,511,627,776, got",
    ),
    (
        {**SMALL_SYNTHETIC, "prompt_len": {"lognormal": {"mean": 1e19, "sigma": 0}}},
        "trace.prompt_len.lognormal.mean: expected at most 1,099,511,627,776, got 1e+19",
    ),
    (  # finite but faster than any server accepts requests: .inf says "all at once"
        {**SMALL_SYNTHETIC, "arrival": {"rate": 1e7}},
        "trace.arrival.rate: expected at most 1e+06 requests/s (arrivals under a microsecond "
        "apart), or .inf for every request at t = 0; got 1e+07",
    ),
    (  # 1e-310 req/s: the mean gap overflows to inf
        {**SMALL_SYNTHETIC, "arrival": {"rate": 1e-310}},
        "trace.arrival: rate 1e-310 x burstiness 1 is too small: the mean inter-arrival time 1 / (rate x burstiness) overflows float64",
    ),
    (
        {**SMALL_SYNTHETIC, "rate_scale": 1e-320},
        "trace: request 1 would arrive at inf s: rate_scale 9.99989e-321 is too small",
    ),
    (
        {key: v for key, v in SMALL_SYNTHETIC.items() if key != "num_requests"},
        "trace: missing required key 'num_requests'",
    ),
]


@pytest.mark.parametrize(("spec", "message"), BAD_SPECS, ids=[b[1][:40] for b in BAD_SPECS])
def test_malformed_spec(spec: Any, message: str) -> None:
    with pytest.raises(TraceError) as info:
        load_trace(spec, ROOT)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
