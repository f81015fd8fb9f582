"""benchmarks/serve_vs_inprocess.py's pieces that need no engine: its traces load through the
lab's BurstGPT loader as written, and the served model folder's word-level tokenizer makes one
token of each prompt word and text of every id."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from sched_lab.traces import load_table

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "serve_vs_inprocess", ROOT / "benchmarks" / "serve_vs_inprocess.py"
)
svi = importlib.util.module_from_spec(spec)
spec.loader.exec_module(svi)


def test_trace_round_trips_through_the_burstgpt_loader(tmp_path):
    path = tmp_path / "t.csv"
    svi.write_trace(path, [0.0, 0.25, 0.25, 1.5], [3, 5, 7, 9], [2, 4, 6, 8])
    table, rows = load_table({"format": "burstgpt", "path": str(path)}, tmp_path)
    assert rows == 4
    assert table.arrival_s.tolist() == [0.0, 0.25, 0.25, 1.5]
    assert table.prompt_len.tolist() == [3, 5, 7, 9]
    assert table.output_len.tolist() == [2, 4, 6, 8]


def test_workloads():
    arrival, prompt, output = svi.throughput_workload(256, tiny=False)
    assert (arrival == 0).all() and len(prompt) == len(output) == 256
    assert 100 <= prompt.min() and prompt.max() <= 1024 and 100 <= output.min()
    arrival, prompt, output = svi.ttft_workload(30, 512, 32, 2.0)
    assert arrival[0] == 0 and (np.diff(arrival) > 0).all()
    assert set(prompt) == {512} and set(output) == {32}


def test_served_folder_tokenizer_one_token_per_word(tmp_path):
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 300}))
    (ckpt / "model.safetensors").write_bytes(b"weights")
    served = svi.served_model_dir(ckpt, tmp_path)
    assert (served / "model.safetensors").read_bytes() == b"weights"  # a link to the file
    tok = transformers.AutoTokenizer.from_pretrained(served)
    assert tok.encode("hello hello hello") == [299, 299, 299]  # min(9707, 300 - 1), no BOS
    assert tok.decode([5, 7]) == "<5> <7>"
    assert svi.served_model_dir(served, tmp_path) == served  # has a tokenizer: as it is
