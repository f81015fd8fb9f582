#!/usr/bin/env bash
# One device call: the GPU tests, the GPU replay example and the engine benchmarks, with
# everything written under $OUT (or ./gpu_out). Run on the H200 from the repo root:
#   bash benchmarks/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import simpy" 2>/dev/null; then  # the GPU image has no simpy: carried wheel
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt"
python3 -m backend.tools make-random-checkpoint --preset qwen3-0.6b --out checkpoints/qwen3-0.6b
python3 -m pytest -q -m gpu tests/ 2>&1 | tail -40 > "$OUT/gpu_tests.txt"
python3 run_experiment.py experiments/azure_gpu.yaml --out results/azure_gpu --no-progress 2>&1 | tail -30 > "$OUT/azure_gpu.txt"
tar czf "$OUT/azure_gpu.tgz" -C results azure_gpu
(cd benchmarks && python3 decode_roofline.py --presets qwen3-0.6b) > "$OUT/bench.txt" 2>&1
(cd benchmarks && python3 engine_throughput.py) >> "$OUT/bench.txt" 2>&1
echo done
