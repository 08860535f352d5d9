#!/usr/bin/env bash
# Served against offline on one multi-GPU host (docs/benchmarks/router-and-host-cpu.md, "Serving at engine speed"):
#   the offline engine on GPU 0 (`pdserve bench offline`), the decode step at batch 256
#   (bench/micro/decode_step.py), then a prefill server on GPU 0 and a decode server on GPU 1 behind a
#   router in each ROUTERS configuration, each measured by `pdserve bench serve` with all prompts
#   at once and with 256 in flight. Results: one JSON per measurement under OUT.
#
# usage: bench/served_vs_offline.sh OUT [SHAPE [PROMPTS [INPUT_LEN [OUTPUT_LEN]]]]
#   ROUTERS="per-request:1 shared:1 shared:4"  (decode stream : router workers)
#   OLD_ROUTER=DIR  also measure a router run from DIR, a package root whose pdserve/ holds an
#                   older tree (its own decode stream, one process), first.
#   CONCURRENCY="0 256" CLIENT_WORKERS=8 DEVICE=cuda
#   P_GPU=0 D_GPU=1 SERVER_FLAGS=  (both servers), P_FLAGS= D_FLAGS=  (one server's)
#     one GPU: P_GPU=0 D_GPU=0 P_FLAGS="--mem-fraction-static 0.3" D_FLAGS="--mem-fraction-static 0.75"
#     (the fraction counts all the GPU's memory in use, the first server's included)
#   OFFLINE=0  skip the offline engine and the decode step (routers only)
#   PROFILE_SECONDS=S  py-spy the decode frontend and one router process for S seconds in each run
#   PYSPY_FLAGS="--native"  more py-spy record flags
set -euo pipefail
out=${1:?usage: $0 OUT [SHAPE [PROMPTS [INPUT_LEN [OUTPUT_LEN]]]]}
shape=${2:-gpt2/small}; prompts=${3:-1024}; input_len=${4:-256}; output_len=${5:-256}
routers=${ROUTERS:-"per-request:1 shared:1 shared:4"}
concurrency=${CONCURRENCY:-"0 256"}
client_workers=${CLIENT_WORKERS:-8}
device=${DEVICE:-cuda}  # cpu: a dry run of the script on a CPU box
mkdir -p "$out"
tag=$(echo "$shape" | tr / -)
ckpt=$(python3 -c "from pdserve.bench.random_weights import random_weight_checkpoint as c; print(c('$shape'))" | tail -n 1)

if [ "${OFFLINE:-1}" != 0 ]; then
  pdserve bench offline --random-weights "$shape" --num-prompts "$prompts" --input-len "$input_len" \
    --output-len "$output_len" --device "$device" --warmup 1 --repeats 3 --output-json "$out/offline-$tag.json" \
    > "$out/offline-$tag.log" 2>&1 || { tail -20 "$out/offline-$tag.log"; exit 1; }
  python3 -m pdserve.bench.micro.decode_step --random-weights "$shape" --batch-size 256 --input-len "$input_len" \
    --output-len "$output_len" --json "$out/decode-step-$tag.json" > "$out/decode-step-$tag.log" 2>&1 || true
fi

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT
CUDA_VISIBLE_DEVICES=${P_GPU:-0} prefill-server --device "$device" --model-path "$ckpt" ${SERVER_FLAGS:-} ${P_FLAGS:-} --port 31001 --log-level warning > "$out/prefill-$tag.log" 2>&1 &
pids+=($!)
CUDA_VISIBLE_DEVICES=${D_GPU:-1} decode-server --device "$device" --model-path "$ckpt" ${SERVER_FLAGS:-} ${D_FLAGS:-} --port 31002 --log-level warning > "$out/decode-$tag.log" 2>&1 &
pids+=($!)
python3 - <<'EOF'
import time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
for port in (31001, 31002):
    deadline = time.time() + 300
    while True:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                    break
        except grpc.RpcError:
            pass
        assert time.time() < deadline, f"server on {port} not ready"
        time.sleep(1)
EOF

measure() {  # NAME, then the router's command
  local name=$1; shift
  "$@" --model-path "$ckpt" --prefill 127.0.0.1:31001 --decode 127.0.0.1:31002 --port 31000 --max-inflight 8192 \
    --log-level warning > "$out/router-$name.log" 2>&1 &
  local router=$!
  pids+=("$router")  # (killed by cleanup if this run fails)
  for _ in $(seq 120); do curl -sf localhost:31000/readiness > /dev/null && break; sleep 0.5; done
  if [ -n "${PROFILE_SECONDS:-}" ]; then  # py-spy (collapsed stacks) of the decode frontend and a router process
    local worker; worker=$(pgrep -P "$router" | head -n 1 || true); worker=${worker:-$router}  # (no children: --workers 1)
    (sleep 6; py-spy record -r 250 -d "$PROFILE_SECONDS" ${PYSPY_FLAGS:-} -f raw -o "$out/pyspy-decode-$name.txt" -p "${pids[1]}" \
       > /dev/null 2>&1) &
    (sleep 6; py-spy record -r 250 -d "$PROFILE_SECONDS" ${PYSPY_FLAGS:-} -f raw -o "$out/pyspy-router-$name.txt" -p "$worker" \
       > /dev/null 2>&1) &
  fi
  pdserve bench serve --base-url http://127.0.0.1:31000 --model-path "$ckpt" --router-pid "$router" \
    --num-prompts "$prompts" --input-len "$input_len" --output-len "$output_len" --max-concurrency $concurrency \
    --client-workers "$client_workers" --warmup 4 --output-json "$out/serve-$tag-$name.json" \
    > "$out/serve-$tag-$name.log" 2>&1 || tail -5 "$out/serve-$tag-$name.log"
  kill -TERM "$router"; wait "$router" 2>/dev/null || true
}

if [ -n "${OLD_ROUTER:-}" ]; then
  measure old env PYTHONPATH="$OLD_ROUTER:${PYTHONPATH:-}" python3 -m pdserve.router.cli
fi
for r in $routers; do
  measure "${r%%:*}-w${r##*:}" pdserve-router --decode-stream "${r%%:*}" --workers "${r##*:}"
done
