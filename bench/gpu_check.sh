#!/usr/bin/env bash
# The whole GPU check in one device call (issue 19): after `bash bench/gpu_wheels.sh` here,
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=480)
# installs the carried wheels, runs the CUDA tests (Triton compiled, logits against transformers, graphs
# against eager), the 256 x 1024 offline benchmark with the worker in its own process as `xinfer serve`
# runs it (the headline: the scheduler plans a step while the worker runs the last), the same
# in-process, then a profiled decode-heavy run in-process (bench/probe.py: the host's functions, a
# decode graph's GPU time at a few contexts, an eager step's kernels). `eager` (--enforce-eager) runs
# only when named. Each step has its own time limit, so one that hangs costs only its share. $OUT gets
# log.txt (all output, in order) and the runs' JSON results: the device tool brings back at most 8 files.
# `bash bench/gpu_check.sh tests` (or process, inproc, eager, fp8, profile) runs only the steps named.
set -uo pipefail
OUT=${OUT:-/tmp/xinfer-gpu}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
STEPS=${*:-tests process inproc profile}
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
    tests) step tests | tee -a "$LOG"
           timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 90 tests/test_cuda.py \
             tests/test_flashinfer_gpu.py 2>&1 | tee -a "$LOG" ;;
    process) offline process 90 --worker process ;;
    inproc) offline inproc 90 ;;
    eager) offline eager 90 --enforce-eager ;;
    fp8) offline fp8 90 --worker process --kvcache-dtype fp8 ;;
    profile) offline profile 90 --profile --num-seqs 256 --min-input-len 512 --max-input-len 512 \
               --min-output-len 256 --max-output-len 256 ;;
  esac
done
