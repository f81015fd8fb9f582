"""benchmarks/sim_speed_vidur.py: the tiled trace of its scaling mode, and its lab-only table."""

import importlib.util
import json
import sys
from pathlib import Path

from test_benchmark_scripts import run_script

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location(
        "sim_speed_vidur", ROOT / "benchmarks" / "sim_speed_vidur.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_tiled_trace_shifts_each_copy_by_the_span_plus_one_mean_gap(tmp_path):
    # Arrivals at 0, 1 and 4 s: span 4 s, mean gap 2 s, so copy k starts at 6k s.
    csv = tmp_path / "t.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:00:00.0000000,10,1\n"
        "2023-11-16 18:00:01.0000000,20,2\n"
        "2023-11-16 18:00:04.0000000,30,3\n"
    )
    out = tmp_path / "tiled.jsonl"
    cfg = {"trace": {"format": "azure2023", "path": str(csv), "rate_scale": 2.0}}
    _script().tiled_trace(cfg, 8, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["timestamp"] for r in rows] == [
        0.0, 1000.0, 4000.0, 6000.0, 7000.0, 10000.0, 12000.0, 13000.0
    ]  # fmt: skip
    assert [r["input_length"] for r in rows[3:6]] == [10, 20, 30]
    assert [r["output_length"] for r in rows[6:]] == [1, 2]


def test_without_vidur_it_prints_the_labs_rows_only(tmp_path):
    out = run_script(
        "sim_speed_vidur.py", "--limit", "40", "--repeat", "1",
        "--vidur-python", str(tmp_path / "no-python"), "--work", str(tmp_path),
    )  # fmt: skip
    assert f"# no Vidur at {tmp_path / 'no-python'}" in out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| lab")]
    assert [r[0].split()[2] for r in rows][:1] == ["fcfs"]  # (and "--no-plots" rows, if any)
    assert {r[0].split()[2] for r in rows} == {"fcfs", "chunked_prefill"}
    assert "vidur" not in out.split("| run |")[1]
