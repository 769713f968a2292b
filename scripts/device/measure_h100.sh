#!/usr/bin/env bash
# One device-machine session (one H100) for issue 9's cost model: pinned host<->device copy
# bandwidth for offload pricing (scripts/measure_offload_bandwidth.py), the bytes one train-model
# layer saves for backward (scripts/measure_gpu_memory.py) and the kernel calibration
# (scripts/calibrate_gpu.py). Needs torch with CUDA and PyYAML only (no megatron-core, no
# flash-attn, no Transformer Engine); writes everything under $OUT. Each step has its own
# timeout (270 s in all) and its exit status and duration go to $OUT/logs.txt.
set -u
OUT=${OUT:?set OUT to a folder for the results}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log=$OUT/logs.txt
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,pcie.link.gen.max,pcie.link.width.max --format=csv
  nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; echo "nproc $(nproc)"; } > "$log" 2>&1

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "== $name (limit ${limit} s, $(date -u +%T))" >> "$log"
  timeout "$limit" "$@" >> "$log" 2>&1
  echo "$name exit $? after $((SECONDS - start)) s" >> "$log"
}

step offload 60 python3 scripts/measure_offload_bandwidth.py --hardware h100 --out "$OUT/offload_bandwidth.json"
step layer_memory 60 python3 scripts/measure_gpu_memory.py --out "$OUT/layer_memory.json"
step calibration 150 python3 scripts/calibrate_gpu.py --hardware h100 --out "$OUT/calibration-sdpa.yaml" \
  --out-cudnn "$OUT/calibration-cudnn.yaml" --json-extra "$OUT/attention_blocks.json"
tail -c 6000 "$log"
