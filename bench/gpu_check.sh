#!/usr/bin/env bash
# The whole GPU check in one device call (issue 19): after `bash bench/gpu_wheels.sh` here,
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
# installs the carried wheels, runs the 256 x 1024 offline benchmark with decode graphs (the headline),
# the CUDA tests (Triton compiled, logits against transformers, graphs against eager), the benchmark
# eager and with the worker in its own process (the scheduler's overlap, as when serving), then a
# profiled shorter run (bench/probe.py: host functions, a decode step's GPU time and kernels).
# Each step has its own time limit, so one that hangs costs only its share. $OUT gets log.txt (all
# output, in order) and the runs' JSON results: the device tool brings back at most 8 files.
# `bash bench/gpu_check.sh tests` (or offline, eager, process, profile) runs only the steps named.
set -uo pipefail
OUT=${OUT:-/tmp/xinfer-gpu}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
STEPS=${*:-offline tests eager process profile}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1
step() { echo; echo "=== $1 ($(date +%T))"; }
step install | tee -a "$LOG"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >> "$LOG" 2>&1 || { echo "wheel install failed: see log.txt" | tee -a "$LOG"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  nproc; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
} >> "$LOG" 2>&1
offline() {  # name, time limit, flags...
  local name=$1 limit=$2; shift 2
  step "offline-$name" | tee -a "$LOG"
  timeout "$limit" python3 -m bench.cli offline --scenario gpu-qwen3-0.6b-256x1024 --output-dir "$OUT" \
    --result-name "offline-$name" --no-plots --quiet "$@" 2>&1 | grep -v '^offline \[' | tee -a "$LOG"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}
for s in $STEPS; do
  case $s in
    offline) offline graphs 100 ;;
    tests) step tests | tee -a "$LOG"
           timeout 110 python3 -m pytest -q -p no:cacheprovider --timeout 60 tests/test_cuda.py \
             tests/test_flashinfer_gpu.py 2>&1 | tee -a "$LOG" ;;
    eager) offline eager 75 --enforce-eager ;;
    process) offline process 75 --worker process ;;
    profile) offline profile 75 --profile --num-seqs 256 --min-output-len 128 --max-output-len 128 ;;
  esac
done
