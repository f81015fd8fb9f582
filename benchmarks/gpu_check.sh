#!/usr/bin/env bash
# One device call: the GPU tests and the engine benchmarks of issue 4, with everything written
# under $OUT (or ./gpu_out). Run on the H200 from the repo root:
#   bash benchmarks/gpu_check.sh            # tests + benchmarks
#   SKIP_TESTS=1 bash benchmarks/gpu_check.sh
# Each step has its own time limit, so one slow step cannot eat the others' time.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
if ! python3 -c "import simpy" 2>/dev/null; then  # the GPU image has no simpy: carried wheel
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 300 python3 -m pytest -q -m gpu tests/ 2>&1 | tail -20 > "$OUT/gpu_tests.txt"
fi
cd benchmarks
{
  timeout 150 python3 engine_throughput.py
  timeout 90 python3 decode_roofline.py --presets qwen3-0.6b
  timeout 60 python3 swap_bandwidth.py --preset qwen3-0.6b
  timeout 200 python3 decode_roofline.py --presets llama-3.1-8b  # makes the 8B checkpoint
  timeout 90 python3 prefill_mfu.py --preset llama-3.1-8b
  timeout 60 python3 swap_bandwidth.py --preset llama-3.1-8b
  timeout 60 python3 decode_kernels.py --preset qwen3-0.6b --batch 32
} > "$OUT/bench.txt" 2>&1  # no logging config: the runner's INFO lines are off, warnings show
echo done
