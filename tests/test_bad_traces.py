"""Traces that used to give a traceback, a misleading message or garbage with exit 0: time
zones in Azure timestamps, binary files, the prompts YAML's protections, and numbers so
extreme that the answer cannot be meaningful. Each is one exact line (or exact values)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from sched_lab.core.errors import TraceError
from sched_lab.traces import load_trace

ROOT = Path(__file__).resolve().parents[1]
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
SYNTHETIC = {
    "format": "synthetic",
    "num_requests": 3,
    "arrival": {"rate": 1.0},
    "prompt_len": 4,
    "output_len": 2,
}


def error(spec: dict[str, Any]) -> str:
    with pytest.raises(TraceError) as info:
        load_trace(spec, ROOT)
    message = str(info.value)
    assert "\n" not in message
    return message


def azure(tmp_path: Path, *stamps: str) -> str:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE_HEADER + "".join(f"{s},{10 + i},{5 + i}\n" for i, s in enumerate(stamps)))
    return str(path)


# --- Azure timestamps with offsets from UTC (the 2024 trace writes +00:00) ----------------


def test_offsets_are_converted_to_utc(tmp_path: Path) -> None:
    # UTC instants: 00:00:00.011, 00:00:00.511 (02:00 at +02:00), 00:00:01.0115 (19:30 the
    # day before at -04:30: earlier as text, later as an instant), 00:00:02 (Z).
    path = azure(
        tmp_path,
        "2024-05-10 00:00:00.011+00:00",
        "2024-05-10 02:00:00.511+02:00",
        "2024-05-09 19:30:01.0115-04:30",
        "2024-05-10T00:00:02Z",
    )
    requests = load_trace({"format": "azure2023", "path": path}, ROOT)
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 1.0005, 1.989]
    assert [r.prompt_len for r in requests] == [10, 11, 12, 13]


def test_offset_without_colon_and_100ns_ticks(tmp_path: Path) -> None:
    # 18:17:03.9799600 UTC, then 23:47:04.0319600 at +0530 = 18:17:04.0319600 UTC.
    path = azure(tmp_path, "2023-11-16 18:17:03.9799600+0000", "2023-11-16 23:47:04.0319600+0530")
    requests = load_trace({"format": "azure2023", "path": path}, ROOT)
    assert [r.arrival_s for r in requests] == [0.0, 0.052]


@pytest.mark.parametrize(
    ("stamps", "message"),
    [
        (
            ("2024-05-10 00:00:00", "2024-05-10 00:00:01+00:00"),
            "azure.csv: row 2, column 'TIMESTAMP': expected no offset from UTC, as in row 1, "
            "got '2024-05-10 00:00:01+00:00'",
        ),
        (
            ("2024-05-10 00:00:00+00:00", "2024-05-10 00:00:01"),
            "azure.csv: row 2, column 'TIMESTAMP': expected an offset from UTC, as in row 1, "
            "got '2024-05-10 00:00:01'",
        ),
        (
            ("2024-05-10 00:00:00+00:00", "2024-05-10 00:00:01+25:00"),
            "azure.csv: row 2, column 'TIMESTAMP': expected a timestamp like "
            "'2023-11-16 18:17:03.9799600', got '2024-05-10 00:00:01+25:00'",
        ),
        # 23:47:16.854775807 is the last nanosecond of the int64 clock; at -01:00 it is past it.
        (
            ("2262-04-11 22:00:00+00:00", "2262-04-11 23:47:16.854775807-01:00"),
            "azure.csv: row 2, column 'TIMESTAMP': expected a timestamp like "
            "'2023-11-16 18:17:03.9799600', got '2262-04-11 23:47:16.854775807-01:00'",
        ),
        # Parsed to the microsecond, year 3000 fits pandas but not the nanosecond clock (it
        # used to wrap around to 1830 and read as 'time goes backwards').
        (
            ("2023-11-16 18:17:03", "3000-01-01 00:00:00"),
            "azure.csv: row 2, column 'TIMESTAMP': expected a time from 1677-09-21 to 2262-04-11 UTC "
            "(the nanosecond clock), got '3000-01-01 00:00:00'",
        ),
        # Both on the clock, but 561 years apart: more than 2**63 ns (it used to wrap around).
        (
            ("1700-01-01 00:00:00+00:00", "2261-01-01 00:00:00+00:00"),
            "azure.csv: row 2, column 'TIMESTAMP': expected a time within 292 years (2**63 ns) of "
            "row 1 ('1700-01-01 00:00:00+00:00'), got '2261-01-01 00:00:00+00:00'",
        ),
    ],
    ids=[
        "naive-then-offset",
        "offset-then-naive",
        "bad-offset",
        "past-clock-in-utc",
        "year-3000",
        "561-years",
    ],
)
def test_bad_timestamps(tmp_path: Path, stamps: tuple[str, ...], message: str) -> None:
    assert error({"format": "azure2023", "path": azure(tmp_path, *stamps)}) == message


# --- files that are not text ---------------------------------------------------------------

BINARY = [
    (b"PAR1\x15\x04\x15\x10\x15\x14L\x15\x04\x15\x00\x12\x00", "a Parquet file"),
    (b"\x93NUMPY\x01\x00v\x00{'descr'", "byte 7 is NUL: binary data"),  # numpy .npy
    (b"\x1f\x8b\x08\x00" + b"\x00" * 12, "gzip-compressed: decompress it first"),
    (b"PK\x03\x04" + b"\x00" * 12, "zip-compressed: decompress it first"),
    (
        (AZURE_HEADER + "2023-11-16 18:17:03,1,1 \xe9\n").encode("latin-1"),
        "byte 64 is not UTF-8: binary data, or text in another encoding",
    ),
]


@pytest.mark.parametrize(("data", "why"), BINARY, ids=["parquet", "npy", "gzip", "zip", "latin-1"])
@pytest.mark.parametrize(("fmt", "kind"), [("azure2023", "CSV"), ("mooncake", "JSONL")])
def test_binary_file_is_not_a_text_file(
    tmp_path: Path, fmt: str, kind: str, data: bytes, why: str
) -> None:
    path = tmp_path / "trace.bin"
    path.write_bytes(data)
    assert error({"format": fmt, "path": str(path)}) == f"trace.bin: not a text {kind} file ({why})"


def test_directory_and_fifo_as_trace(tmp_path: Path) -> None:
    assert error({"format": "azure2023", "path": str(tmp_path)}) == (
        f"trace file {tmp_path} is a directory, expected a file (trace.path = '{tmp_path}')"
    )
    fifo = tmp_path / "fifo.csv"
    os.mkfifo(fifo)
    assert error({"format": "azure2023", "path": str(fifo)}) == (
        f"trace file {fifo} is not a regular file (a FIFO or device would block or never "
        f"end), expected a file (trace.path = '{fifo}')"
    )


# --- the prompts YAML: the experiment YAML's protections -----------------------------------


def prompts_error(tmp_path: Path, data: bytes) -> tuple[str, str]:
    path = tmp_path / "prompts.yaml"
    path.write_bytes(data)
    return error({"format": "prompts", "path": str(path), "tokenizer": "none"}), str(path)


@pytest.mark.parametrize(
    ("data", "tail"),
    [
        ("- {prompt: caf\xe9, output_len: 4}\n".encode("latin-1"), "not UTF-8 text (byte 14)"),
        (
            b"- " + b"[" * 5000 + b"]" * 5000 + b"\n",
            "line 1 is not valid YAML (" + "[0]" * 25 + "[0...: nested more than 64 levels deep)",
        ),
        (
            b"- {prompt: [unclosed, output_len: 4}\n",
            "line 1 is not valid YAML (expected ',' or ']', but got '}')",
        ),
        (b"prompt: hello\n", "expected a non-empty list of {prompt, output_len, arrival_s}"),
        (
            b"- {prompt: hello, output_len: 4, temperature: 0.5}\n",
            "item 1: expected keys prompt, output_len, arrival_s (and optional lora_name, "
            "cache_salt); got {'output_len': 4, 'prompt': 'hello', 'temperature': 0.5}",
        ),
        (
            b"- {prompt: hello, output_len: 4, cache_salt: 7}\n",
            "item 1: cache_salt: expected a non-empty string, got 7",
        ),
        (
            b"- {prompt: " + b"x" * 500 + b", output_len: 0}\n",
            "item 1: output_len: expected an integer in 1..1,099,511,627,776, got 0",
        ),
    ],
    ids=["latin-1", "deep", "bad-yaml", "not-a-list", "unknown-key", "salt", "long-prompt-bad-len"],
)
def test_bad_prompts_file(tmp_path: Path, data: bytes, tail: str) -> None:
    message, path = prompts_error(tmp_path, data)
    assert message == f"{path}: {tail}"


def test_prompts_alias_bomb_is_one_short_line(tmp_path: Path) -> None:
    # 9 ** 9 = 387M strings if expanded; the loader may refuse the aliases, or build the
    # shared lists: either way the message is one short line, and quick.
    lines = ["- &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"- &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    t0 = time.perf_counter()
    message, path = prompts_error(tmp_path, ("\n".join(lines) + "\n").encode())
    assert time.perf_counter() - t0 < 5
    assert message.startswith(f"{path}:") and len(message) < len(path) + 200, message


def test_prompts_fifo_and_directory(tmp_path: Path) -> None:
    fifo = tmp_path / "prompts.yaml"
    os.mkfifo(fifo)
    assert error({"format": "prompts", "path": str(fifo), "tokenizer": "x"}).startswith(
        f"trace file {fifo} is not a regular file"
    )
    assert error({"format": "prompts", "path": str(tmp_path), "tokenizer": "x"}).startswith(
        f"trace file {tmp_path} is a directory"
    )


# --- numbers too extreme to mean anything --------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {**SYNTHETIC, "num_requests": 10**12},
            "trace.num_requests: expected at most 10,000,000, got 1,000,000,000,000 (each request is "
            "replayed from memory, ~1 KB per policy; split the workload into several runs)",
        ),
        (
            {**SYNTHETIC, "prompt_len": {"lognormal": {"mean": 1000, "sigma": 1e200}}},
            "trace.prompt_len.lognormal: sigma 1e+200 with mean 1000 puts 100% of the samples outside "
            "1..1,099,511,627,776 tokens (clipped there, so the lengths would not have mean 1000); "
            "expected a sigma that keeps most samples inside",
        ),
        # mu = ln(1000) - 8 = -1.09; P(sample < 0.5) = Phi((ln 0.5 - mu) / 4) = Phi(0.099) = 54%.
        (
            {**SYNTHETIC, "output_len": {"lognormal": {"mean": 1000, "sigma": 4}}},
            "trace.output_len.lognormal: sigma 4 with mean 1000 puts 54% of the samples outside "
            "1..1,099,511,627,776 tokens (clipped there, so the lengths would not have mean 1000); "
            "expected a sigma that keeps most samples inside",
        ),
        # 3 requests at 1e-12 req/s: the third arrives after ~4e12 s, where float64 spacing is
        # 2**-11 s = 0.00049 s.
        (
            {**SYNTHETIC, "arrival": {"rate": 1e-12}},
            "trace.arrival.rate: 1e-12 req/s puts the last arrival at 4.06e+12 s; expected arrivals "
            "within 4.29e+09 s, where float64 seconds still resolve 1 us (at 4.06e+12 s the spacing "
            "is 0.00049 s, longer than a step)",
        ),
        (
            {**SYNTHETIC, "rate_scale": 1e-12},
            "trace.rate_scale: 1e-12 puts the last arrival at 4.06e+12 s; expected arrivals within "
            "4.29e+09 s, where float64 seconds still resolve 1 us (at 4.06e+12 s the spacing is "
            "0.00049 s, longer than a step)",
        ),
        # Arrivals 0, 3.29 s, 4.06 s: the 0.763 s gap / 1e308 is subnormal (< 2.2e-308).
        (
            {**SYNTHETIC, "rate_scale": 1e308},
            "trace.rate_scale: 1e+308 shrinks the 0.763 s gap between requests 1 and 2 to 7.63e-309 s, "
            "below float64's smallest normal number: the arrival times cannot be kept",
        ),
    ],
    ids=["num_requests", "sigma-huge", "sigma-4", "rate", "rate_scale-tiny", "rate_scale-huge"],
)
def test_extreme_numbers(spec: dict[str, Any], message: str) -> None:
    assert error(spec) == message


def test_sigma_that_keeps_most_samples_is_accepted() -> None:
    # sigma 3.8 with mean 1000: P(sample < 0.5) = Phi((ln 0.5 - ln 1000 + 7.22) / 3.8) = 46%.
    requests = load_trace(
        {**SYNTHETIC, "prompt_len": {"lognormal": {"mean": 1000, "sigma": 3.8}}}, ROOT
    )
    assert len(requests) == 3


def test_rate_scale_that_keeps_the_clock_is_accepted() -> None:
    requests = load_trace({**SYNTHETIC, "rate_scale": 1e-6}, ROOT)  # last arrival 4.06e6 s
    assert [round(r.arrival_s) for r in requests] == [0, 3293528, 4056659]


# --- found by a break-it pass -----------------------------------------------------------


def test_gamma_rate_times_burstiness_underflow() -> None:
    spec = {"format": "synthetic", "num_requests": 5, "prompt_len": 10, "output_len": 5,
            "arrival": {"process": "gamma", "rate": 1e-200, "burstiness": 1e-200}}  # fmt: skip
    assert error(spec) == (
        "trace.arrival: rate 1e-200 x burstiness 1e-200 is too small: the mean inter-arrival "
        "time 1 / (rate x burstiness) overflows float64"
    )


@pytest.mark.parametrize("arrays", [64, 200, 3000])
def test_deeply_nested_jsonl_line(tmp_path: Path, arrays: int) -> None:
    # the object and 64 arrays in it: 65 levels, one over the limit, refused the same way
    # whether json's recursion limit is reached (3000) or not (64, 200)
    path = tmp_path / "deep.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 100, "output_length": 5, "x": '
                    + "[" * arrays + "]" * arrays + "}\n")  # fmt: skip
    assert error({"format": "mooncake", "path": str(path)}) == (
        "deep.jsonl: line 1: JSON nested more than 64 levels deep"
    )


def test_jsonl_line_nested_64_levels_is_read(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 100, "output_length": 5, "x": '
                    + "[" * 63 + "]" * 63 + ', "s": "' + "[" * 100 + '"}\n')  # fmt: skip
    requests = load_trace({"format": "mooncake", "path": str(path)}, ROOT)
    assert [(r.prompt_len, r.output_len) for r in requests] == [(100, 5)]


def test_arrivals_beyond_the_clock_at_rate_scale_1(tmp_path: Path) -> None:
    path = tmp_path / "far.csv"
    path.write_text("Timestamp,Request tokens,Response tokens\n0,100,50\n1e17,100,50\n")
    assert error({"format": "burstgpt", "path": str(path)}).startswith(
        "trace: the trace's own clock puts the last arrival at 1e+17 s; expected arrivals "
        "within 4.29e+09 s"
    )


def test_a_cache_salt_that_is_not_a_string_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "salt.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5, "cache_salt": "a"}\n'
        '{"timestamp": 1, "input_length": 10, "output_length": 5, "cache_salt": 3}\n'
    )
    assert error({"format": "mooncake", "path": str(path)}) == (
        "salt.jsonl: line 2, key 'cache_salt': expected a non-empty string, got 3"
    )


def test_a_nan_or_surrogate_cache_name_is_one_line(tmp_path: Path) -> None:
    # NaN is no string (only null or an absent key means none); a lone surrogate is valid
    # JSON but no UTF-8 text (results could not be written after the replay).
    path = tmp_path / "nan.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "cache_salt": NaN}\n')
    assert error({"format": "mooncake", "path": str(path)}) == (
        "nan.jsonl: line 1, key 'cache_salt': expected a non-empty string, got NaN"
    )
    path = tmp_path / "sur.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5, "lora_name": "a\\ud800"}\n'
    )
    assert error({"format": "mooncake", "path": str(path)}) == (
        "sur.jsonl: line 1, key 'lora_name': expected UTF-8 text, got a string with a lone "
        "surrogate ('a\\ud800')"
    )
