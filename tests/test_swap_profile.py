"""benchmarks/swap_profile.py runs on the CPU with a tiny model and writes its columns (the
times themselves are not checked: they depend on the machine)."""

from __future__ import annotations

import importlib.util

import pandas as pd
import pytest

pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")
import torch_threads  # noqa: E402, F401  (one torch thread unless OMP_NUM_THREADS says otherwise)
from conftest import ROOT  # noqa: E402


def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "swap_profile", ROOT / "benchmarks/swap_profile.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_ids_come_in_runs_one_id_apart(monkeypatch):
    assert bench(monkeypatch).cpu_ids(6, 2) == [0, 1, 3, 4, 6, 7]


def test_smoke_run_writes_a_row_per_direction_and_case(monkeypatch, tmp_path, capsys):
    out = tmp_path / "swap.csv"
    argv = ["--tiny", "--device", "cpu", "--block-sizes", "4", "8", "--run-lengths", "1", "4",
            "--blocks", "8", "--repeat", "1", "--warmup", "0", "--out", str(out)]  # fmt: skip
    assert bench(monkeypatch).main(argv) == 0
    df = pd.read_csv(out)
    assert tuple(df.columns) == bench(monkeypatch).COLUMNS
    assert len(df) == 2 * 2 * 2  # directions x block sizes x run lengths
    # 8 blocks in runs of 1: 8 copies; in runs of 4: 2 copies (each way)
    assert sorted(set(zip(df.run_length, df.num_runs))) == [(1, 8), (4, 2)]
    # the tiny model in bfloat16: 2 layers * (K, V) * 2 KV heads * 32 * 2 B = 512 B per token
    assert sorted(set(zip(df.block_size, df.bytes))) == [(4, 8 * 4 * 512), (8, 8 * 8 * 512)]
    printed = capsys.readouterr().out
    assert printed.count("fit swap_out") == 2 and printed.count("fit swap_in") == 2
