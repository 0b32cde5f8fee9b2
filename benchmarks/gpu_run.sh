#!/usr/bin/env bash
# The device check as one prepared script, for a lent GPU machine (the `run` tool of this project):
#   run(command="bash benchmarks/gpu_run.sh", timeout_s=540)
# The GPU tests first (about half a minute), then gpu_check.py --quick (about 2-4 minutes); each
# writes into $OUT as it goes, so a run cut short by its limit keeps what it measured. The image's
# python3 has torch, numpy, tensorboard and pytest; gradwatch runs from the checkout (no install).
set -uo pipefail
OUT="${OUT:-/tmp/gradwatch-gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__)'; } 2>&1 | tee "$OUT/device.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
timeout 330 python3 benchmarks/gpu_check.py --quick --json "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
