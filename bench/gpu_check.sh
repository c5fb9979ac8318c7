#!/usr/bin/env bash
# The whole GPU check in one device call (issue 19): after `bash bench/gpu_wheels.sh` here,
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=420)
# installs the carried wheels, runs the CUDA tests (Triton compiled, logits against transformers,
# graphs against eager), then the 256 x 1024 offline benchmark with decode graphs and without.
# Everything lands under $OUT: device.txt, tests.log, junit.xml, offline*.log and their JSON results.
set -uo pipefail
OUT=${OUT:-/tmp/xinfer-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/install.log" 2>&1 || { echo "wheel install failed: see install.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; } \
  > "$OUT/device.txt" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_flashinfer_gpu.py \
  --junitxml "$OUT/junit.xml" 2>&1 | tee "$OUT/tests.log"
for mode in graphs eager graphs-process; do
  flags=""
  [ "$mode" = eager ] && flags="--enforce-eager"
  [ "$mode" = graphs-process ] && flags="--worker process"  # the scheduler's overlap, as when serving
  timeout 90 python3 -m bench.cli offline --scenario gpu-qwen3-0.6b-256x1024 $flags --output-dir "$OUT" \
    --result-name "offline-$mode" --no-plots --quiet 2>&1 | tee "$OUT/offline-$mode.log"
done
