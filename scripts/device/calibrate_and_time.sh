#!/usr/bin/env bash
# One device-machine session (one GPU, 16 cores): the CUDA attention-backend tests, the kernel
# calibration (scripts/calibrate_gpu.py) and, on otherwise idle cores with one core per rank, the
# CPU DynMo timing (benchmarks/dynmo_cpu.py). Needs megatron-core carried as a wheel in .whl/
# (the device README); writes everything under $OUT.
set -u
OUT=${OUT:?set OUT to a folder for the results}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
log=$OUT/logs.txt
pin() { if command -v taskset > /dev/null; then taskset -c "$@"; else shift; "$@"; fi; }
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'mcore', m.__version__)"; nproc; } > "$log" 2>&1
note="device machine: $(nproc) cores, ranks pinned to cores 4-15 (taskset), OMP_NUM_THREADS=1 (one core per rank); a GPU job ran on cores 0-3 meanwhile"
( export OMP_NUM_THREADS=1
  pin 4-15 timeout 230 python3 benchmarks/dynmo_cpu.py --out "$OUT/dynmo_cpu" --note "$note" > "$OUT/dynmo.log" 2>&1
  echo "dynmo_cpu exit $?" >> "$OUT/dynmo.log"
  mkdir -p "$OUT/lo"
  pin 4-15 timeout 150 python3 benchmarks/dynmo_cpu.py --layers-only --out "$OUT/lo/dynmo_cpu_layers_only" --note "$note" >> "$OUT/dynmo.log" 2>&1
  echo "dynmo_cpu --layers-only exit $?" >> "$OUT/dynmo.log" ) &
echo "== gpu tests" > "$OUT/gpu.log"
pin 0-3 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/attention/test_gpu_backends.py >> "$OUT/gpu.log" 2>&1
echo "pytest exit $?" >> "$OUT/gpu.log"
echo "== calibration" >> "$OUT/gpu.log"
pin 0-3 timeout 240 python3 scripts/calibrate_gpu.py --hardware h100 --out "$OUT/calibration-sdpa.yaml" \
  --out-cudnn "$OUT/calibration-cudnn.yaml" --json-extra "$OUT/attention_blocks.json" >> "$OUT/gpu.log" 2>&1
echo "calibrate exit $?" >> "$OUT/gpu.log"
wait
cat "$OUT/gpu.log" "$OUT/dynmo.log" >> "$log"; rm -f "$OUT/gpu.log" "$OUT/dynmo.log"
tail -c 6000 "$log"
