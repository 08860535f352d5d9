#!/usr/bin/env bash
# One GPU, both roles (docs/benchmarks/one-gpu.md, "One GPU"): the offline engine, then local stacks on the one
# GPU measured by `pdserve bench serve` in the same call — one colocated server, and a prefill + a
# decode server under the private MPS daemon at each SM split — all prompts at once and CONCURRENCY in
# flight. Results: one JSON per measurement under OUT, and each stack's log (the servers' start-up
# breakdowns, the placement and MPS lines).
#
# usage: bench/one_gpu.sh OUT [SHAPE [PROMPTS [INPUT_LEN [OUTPUT_LEN]]]]
#   STACKS="colocated=0:1:never mps=1:1:always"   (bench/sweep.py's NAME=PREFILL:DECODE:POLICY[:P/D])
#   CONCURRENCY="0 256" CLIENT_WORKERS=8 OFFLINE=1 MPS=auto ROUTER_WORKERS=0 (as pdserve up: from the cores)
#   SERVE_ARGS="--stream-interval 4" (more `bench serve` flags; NAME_SUFFIX tells the result files apart)
set -euo pipefail
out=${1:?usage: $0 OUT [SHAPE [PROMPTS [INPUT_LEN [OUTPUT_LEN]]]]}
shape=${2:-gpt2/small}; prompts=${3:-1024}; input_len=${4:-256}; output_len=${5:-256}
stacks=${STACKS:-"colocated=0:1:never mps=1:1:always"}
mkdir -p "$out"
tag=$(echo "$shape" | tr / -)

if [ "${OFFLINE:-1}" != 0 ]; then
  pdserve bench offline --random-weights "$shape" --num-prompts "$prompts" --input-len "$input_len" \
    --output-len "$output_len" --warmup 1 --repeats 3 --output-json "$out/offline-$tag.json" \
    > "$out/offline-$tag.log" 2>&1 || { tail -20 "$out/offline-$tag.log"; exit 1; }
  tail -4 "$out/offline-$tag.log"
fi
for stack in $stacks; do
  name=${stack%%=*}${NAME_SUFFIX:-}
  # (one stack per bench call: each JSON stands alone, and a stack that fails leaves the others' results)
  pdserve bench serve --random-weights "$shape" --num-prompts "$prompts" --input-len "$input_len" \
    --output-len "$output_len" --max-concurrency ${CONCURRENCY:-0 256} --client-workers "${CLIENT_WORKERS:-8}" \
    --warmup 4 --router-workers "${ROUTER_WORKERS:-0}" --mps "${MPS:-auto}" --stacks "$stack" ${SERVE_ARGS:-} \
    --output-json "$out/serve-$tag-$name.json" \
    > "$out/serve-$tag-$name.log" 2>&1 || { echo "stack $name failed:"; tail -20 "$out/serve-$tag-$name.log"; }
  grep -h "started:\|GPU sharing\|serving .* after\|==== rate\|output: .* tok/s\|TTFT ms\|failed: [1-9]" "$out/serve-$tag-$name.log" || true
done
