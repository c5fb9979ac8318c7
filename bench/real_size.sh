#!/usr/bin/env bash
# xinfer against llama-server at the sizes CPU users serve (issue 52): Qwen3-0.6B-, Qwen3-4B- and
# Llama-3.1-8B-shaped models with random weights, as GGUF files made by llama.cpp's own converter and
# quantizer, the same file for both servers, servers in turn (xinfer-bench compare --serve).
#   bench/real_size.sh make  DIR LLAMA_TOOLS TOKENIZER_DIR   shaped HF folders, bf16 / Q4_K_M / Q8_0 GGUF files
#   bench/real_size.sh run   DIR LLAMA_SERVER_DIR OUT         the comparisons; results in OUT/<tag>/
#   bench/real_size.sh bf16  DIR VLLM_VENV OUT                the HF bf16 folders against vLLM-CPU
# LLAMA_TOOLS from ../shared/peers/llama-tools.sh, LLAMA_SERVER_DIR from ../shared/peers/llama-server.sh
# build, VLLM_VENV from ../shared/peers/vllm-cpu.sh install; TOKENIZER_DIR an HF folder with
# tokenizer.json and config.json (its vocab sets the shapes') and a chat template (the chat scenarios
# need one: tokenizer_config.json / chat_template.jinja, copied into each folder).
# Every figure names the CPU: compare writes the machine's flags into each result.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
case "${1:-}" in
make)
  dir=$2 tools=$3 tok=$4
  mkdir -p "$dir"
  for s in qwen3-0.6b qwen3-4b llama-3.1-8b; do
    [ -f "$dir/$s-q4_k_m.gguf" ] && continue
    "$PY" ../shared/peers/shaped_model.py "$s" "$tok" "$dir/$s-hf"
    PYTHONPATH="$tools/src/gguf-py" "$PY" "$tools/src/convert_hf_to_gguf.py" "$dir/$s-hf" --outfile "$dir/$s-bf16.gguf" --outtype bf16
    "$tools/llama-quantize" "$dir/$s-bf16.gguf" "$dir/$s-q4_k_m.gguf" Q4_K_M
    [ "$s" = qwen3-0.6b ] && "$tools/llama-quantize" "$dir/$s-bf16.gguf" "$dir/$s-q8_0.gguf" Q8_0
    [ "$s" = qwen3-0.6b ] || rm -f "$dir/$s-bf16.gguf"  # 7.5 and 15 GB; the HF folder stays (vLLM-CPU reads it)
  done ;;
run)
  dir=$2 llama=$3 out=$4
  xinfer=".venv/bin/xinfer serve --port 8001 --max-num-seqs 64"
  ls_="$llama/llama-server -c 32768 -np 64 --no-kv-unified -cb -t $(nproc) -tb $(nproc) --host 127.0.0.1 --port 8002"
  cmp() {  # MODEL SCENARIO TAG XINFER_FLAGS LLAMA_FLAGS [compare flags]
    local m=$1 sc=$2 tag=$3 xe=$4 le=$5
    shift 5
    .venv/bin/xinfer-bench compare --scenario "$sc" --repeats 1 --tokenizer "$dir/qwen3-0.6b-hf" \
      --target xinfer=http://127.0.0.1:8001/v1 --serve "xinfer=$xinfer --model $m $xe" \
      --target llama=http://127.0.0.1:8002/v1 --serve "llama=$ls_ -m $m $le" \
      --output-dir "$out/$tag" --no-plots "$@"
  }
  # 4,096 tokens of context on both (llama-server: one slot), memory and load time the figures that matter
  cmp "$dir/llama-3.1-8b-q4_k_m.gguf" cpu-chat-1 8b-c1 "--max-model-len 4096 --kv-cache-gb 0.5" "-c 4096 -np 1" --num-requests 3
  for q in q4_k_m q8_0; do
    for c in 1 16 64; do cmp "$dir/qwen3-0.6b-$q.gguf" "cpu-chat-$c" "0.6b-$q-c$c" "" ""; done
  done
  cmp "$dir/qwen3-4b-q4_k_m.gguf" cpu-chat-1 4b-c1 "" "" --num-requests 4
  cmp "$dir/qwen3-4b-q4_k_m.gguf" cpu-chat-16 4b-c16 "" "" --num-requests 16 ;;
bf16)
  dir=$2 venv=$3 out=$4
  vcmp() {  # MODEL SCENARIO TAG [compare flags]
    local m=$1 sc=$2 tag=$3
    shift 3
    .venv/bin/xinfer-bench compare --scenario "$sc" --repeats 1 --tokenizer "$dir/qwen3-0.6b-hf" \
      --target xinfer=http://127.0.0.1:8001/v1 --serve "xinfer=.venv/bin/xinfer serve --port 8001 --max-num-seqs 64 --model $m" \
      --target vllm=http://127.0.0.1:8003/v1 --serve "vllm=../shared/peers/vllm-cpu.sh serve $venv $m 8003" \
      --serve-timeout 600 --output-dir "$out/$tag" --no-plots "$@"
  }
  for c in 1 16 64; do vcmp "$dir/qwen3-0.6b-hf" "cpu-chat-$c" "0.6b-bf16-c$c"; done
  vcmp "$dir/qwen3-4b-hf" cpu-chat-1 4b-bf16-c1 --num-requests 3
  vcmp "$dir/qwen3-4b-hf" cpu-chat-16 4b-bf16-c16 --num-requests 16 ;;
*) echo "usage: $0 make DIR LLAMA_TOOLS TOKENIZER_DIR | run DIR LLAMA_SERVER_DIR OUT | bf16 DIR VLLM_VENV OUT" >&2; exit 2 ;;
esac
