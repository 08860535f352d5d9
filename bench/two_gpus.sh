#!/usr/bin/env bash
# Two GPUs, one host (docs/benchmarks/two-gpus.md, "Two GPUs"): the offline engine on one GPU, then `pdserve up`
# in each LAYOUT measured by `pdserve bench serve --base-url` in the same call, all prompts at once and
# CONCURRENCY in flight. Results: one JSON per measurement under OUT, and each stack's log (its placement
# and KV-path lines, the servers' start-up).
#
# usage: bench/two_gpus.sh OUT [SHAPE [PROMPTS [INPUT_LEN [OUTPUT_LEN]]]]
#   LAYOUTS="one-gpu two-gpu two-gpu-nixl"  (names below; replicas: two colocated servers; one-gpu-nixl)
#   CONCURRENCY="0 256" CLIENT_WORKERS=8 OFFLINE=1 PORT=30000
set -euo pipefail
out=${1:?usage: $0 OUT [SHAPE [PROMPTS [INPUT_LEN [OUTPUT_LEN]]]]}
shape=${2:-gpt2/small}; prompts=${3:-1024}; input_len=${4:-256}; output_len=${5:-256}
layouts=${LAYOUTS:-"one-gpu two-gpu two-gpu-nixl"}
port=${PORT:-30000}
mkdir -p "$out"
tag=$(echo "$shape" | tr / -)
ckpt=$(python3 -c "from pdserve.bench.random_weights import random_weight_checkpoint as c; print(c('$shape'))" | tail -n 1)

if [ "${OFFLINE:-1}" != 0 ]; then
  CUDA_VISIBLE_DEVICES=0 pdserve bench offline --model-path "$ckpt" --num-prompts "$prompts" --input-len "$input_len" \
    --output-len "$output_len" --warmup 1 --repeats 3 --output-json "$out/offline-$tag.json" \
    > "$out/offline-$tag.log" 2>&1 || { tail -20 "$out/offline-$tag.log"; exit 1; }
  tail -4 "$out/offline-$tag.log"
fi

flags_of() {
  case $1 in
    one-gpu) echo "--gpus 0" ;;                                   # both roles on GPU 0 under MPS
    one-gpu-nixl) echo "--gpus 0 --server-args=--kv-transfer-path=nixl" ;;
    two-gpu) echo "" ;;                                           # the default on two GPUs
    two-gpu-nixl) echo "--server-args=--kv-transfer-path=nixl" ;; # as between hosts
    replicas) echo "--num-prefill 0 --num-decode 2" ;;
    *) echo "unknown layout $1" >&2; exit 2 ;;
  esac
}

for layout in $layouts; do
  log="$out/up-$tag-$layout.log"
  # shellcheck disable=SC2046
  pdserve up --model-path "$ckpt" --port "$port" $(flags_of "$layout") > "$log" 2>&1 &
  up=$!
  ready=0
  for _ in $(seq 300); do
    if curl -sf "http://127.0.0.1:$port/readiness" > /dev/null; then ready=1; break; fi
    kill -0 $up 2>/dev/null || break
    sleep 1
  done
  if [ $ready = 1 ]; then
    grep -h "placement\|GPU\|KV prefill\|layout:" "$log" || true
    pdserve bench serve --base-url "http://127.0.0.1:$port" --model-path "$ckpt" --num-prompts "$prompts" \
      --input-len "$input_len" --output-len "$output_len" --max-concurrency ${CONCURRENCY:-0 256} \
      --client-workers "${CLIENT_WORKERS:-8}" --warmup 4 --output-json "$out/serve-$tag-$layout.json" \
      > "$out/serve-$tag-$layout.log" 2>&1 || echo "layout $layout: bench failed"
    grep -h "==== \|output: .* tok/s\|TTFT ms\|failed: [1-9]" "$out/serve-$tag-$layout.log" || true
  else
    echo "layout $layout: not ready"; tail -30 "$log"
  fi
  kill -TERM $up 2>/dev/null || true
  wait $up 2>/dev/null || true
done
