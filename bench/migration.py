"""A decode server SIGKILLed under a live stream: the stream moves, and ends as the uninterrupted run.

    python -m pdserve.bench.migration --random-weights llama/1b --device cuda [--cases json ngram]

For each case it starts a prefill server, two decode servers and `pdserve-router` (one worker,
health checks every 0.5 s), asks the case's request once without streaming (the twin), then streams
it, SIGKILLs the decode server running it (its running-requests gauge) once `--kill-after` chunks
are in, and reads the stream to its end. It reports, per case: whether the
streamed text equals the twin's, the finish reason, the longest gap between two chunks around the
kill (what the client saw while the stream moved), and the router's migration counter.

Cases: `json` (a chat completion with a json_schema response format: the grammar is replayed on
the new server), `ngram` (decode servers with --speculative ngram: a completion copying its prompt),
`greedy` (a plain completion). With `--device cuda` and two GPUs visible, decode server 0 and the
prefill server share GPU 0 and decode server 1 has GPU 1; on one GPU all three share it.
Prints one JSON line per case (and --json writes them all).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.bench.random_weights import model_path_from_args
from pdserve.common.ports import free_port
from pdserve.router.up import stop_processes

SCHEMA = {
    "type": "object",
    "properties": {"readings": {"type": "array", "items": {"type": "integer"}, "minItems": 60}},
    "required": ["readings"],
}
COPY_PROMPT = "Repeat this list exactly: " + ", ".join(f"item {i} is {i * 7 % 13}" for i in range(40))


def request_of(case: str, model: str, max_tokens: int) -> tuple[str, dict]:
    """(API, request body) of a case: greedy, long enough to be cut."""
    if case == "json":
        body = {
            "messages": [{"role": "user", "content": "Give sixty sensor readings as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "readings", "schema": SCHEMA}},
        }
        return "chat", {"model": model, "max_tokens": max_tokens, "temperature": 0, **body}
    prompt = COPY_PROMPT if case == "ngram" else "the moving stream"
    return "completions", {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def server_flags(case: str) -> list[str]:
    return ["--speculative", "ngram"] if case == "ngram" else []


def gpus_for(device: str) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of prefill, decode 0 and decode 1."""
    if device != "cuda":
        return [None, None, None]
    import torch

    return ["0", "0", "1"] if torch.cuda.device_count() >= 2 else ["0", "0", "0"]


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "a"), stderr=subprocess.STDOUT, env=env)


def start_server(
    role: str, model: str, device: str, gpu: str | None, fraction: float, flags, log: Path, ports=None
) -> tuple[subprocess.Popen, int, int]:
    """A prefill or decode server process, its gRPC and metrics ports (`ports`: those again, to
    restart a server where the router looks for it; None: free ones)."""
    port, metrics_port = ports or (free_port(), free_port())
    cmd = [sys.executable, "-m", f"pdserve.{role}.cli", "--model-path", model, "--device", device]
    cmd += ["--port", str(port), "--metrics-port", str(metrics_port), *flags]
    if device == "cuda":
        cmd += ["--mem-fraction-static", str(fraction)]
    env = os.environ | ({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})
    return start(cmd, log, env), port, metrics_port


def post(url: str, body: dict, timeout: float = 300.0) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def text_of(api: str, choice: dict) -> str:
    return choice["message"]["content"] if api == "chat" else choice["text"]


def stream(
    url: str, api: str, body: dict, kill, timeout: float = 300.0
) -> tuple[str, str | None, float, int, int | None]:
    """The streamed text, its finish reason, the longest gap between chunks after the kill (s), how
    many chunks came and how many characters had come before the kill; `kill(n)` is asked after each
    chunk until it has killed. Server-sent events read line by line (no client library: the GPU
    hosts' stack is minimal)."""
    request = urllib.request.Request(
        url, json.dumps(body | {"stream": True}).encode(), {"Content-Type": "application/json"}
    )
    text, finish, last, gap, n, killed_at, cut = "", None, None, 0.0, 0, None, None
    with urllib.request.urlopen(request, timeout=timeout) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now, chunk = time.monotonic(), json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream ended with an error: {chunk['error']}")
            if not chunk.get("choices"):
                continue
            choice = chunk["choices"][0]
            text += (choice["delta"].get("content") or "") if api == "chat" else choice["text"]
            finish = choice.get("finish_reason") or finish
            if killed_at is not None:
                gap = max(gap, now - max(last, killed_at))
            last, n = now, n + 1
            if killed_at is None and kill(n):
                killed_at, cut = time.monotonic(), len(text)
    return text, finish, gap, n, cut


def run_case(case: str, model: str, args, log_dir: Path) -> dict:
    procs = []
    try:
        gpus = gpus_for(args.device)
        shared = gpus[0] == gpus[2]
        # (--dtype float32: a bf16 stream prefilled again after its move rounds otherwise than its twin, and a
        # near tie may go the other way: docs/benchmarks/two-gpus.md, "Stream migration on two GPUs")
        flags = server_flags(case) + (["--dtype", args.dtype] if args.dtype else [])
        prefill, p_port, _ = start_server("prefill", model, args.device, gpus[0], 0.4, flags, log_dir / f"{case}-p.log")
        procs.append(prefill)
        wait_grpc(p_port, args.ready_timeout)
        decodes = []
        for i in range(2):
            # (device-wide: what the servers already on a GPU hold counts against a later one's)
            fraction = {(0, True): 0.6, (1, True): 0.85, (0, False): 0.8, (1, False): 0.8}[(i, shared)]
            proc, port, metrics_port = start_server(
                "decode", model, args.device, gpus[i + 1], fraction, flags, log_dir / f"{case}-d{i}.log"
            )
            procs.append(proc)
            wait_grpc(port, args.ready_timeout)
            decodes.append((proc, port, metrics_port))
        http = free_port()
        router = start(
            [sys.executable, "-m", "pdserve.router.cli", "--model-path", model, "--port", str(http), "--workers", "1"]
            + ["--prefill", f"127.0.0.1:{p_port}", "--decode", *(f"127.0.0.1:{p}" for _, p, _ in decodes)]
            + ["--decode-policy", "round_robin", "--health-check-interval", "0.5", "--health-check-timeout", "0.5"],
            log_dir / f"{case}-router.log",
        )
        procs.append(router)
        url = f"http://127.0.0.1:{http}"
        wait_ready(url + "/readiness", router, args.ready_timeout)
        api, body = request_of(case, model, args.max_tokens)
        endpoint = f"{url}/v1/chat/completions" if api == "chat" else f"{url}/v1/completions"
        twin = post(endpoint, body)["choices"][0]
        twin_text, twin_finish = text_of(api, twin), twin["finish_reason"]

        def kill(n: int) -> bool:
            """SIGKILL the decode server running the stream (its running-requests gauge)."""
            if n < args.kill_after:
                return False
            for proc, _, metrics_port in decodes:
                running = re.search(
                    r"^pdserve_running_requests\{[^}]*\} (\S+)$",
                    urllib_get(f"http://127.0.0.1:{metrics_port}/metrics"),
                    re.M,
                )
                if running and float(running.group(1)) > 0:
                    os.kill(proc.pid, signal.SIGKILL)
                    return True
            return False

        try:
            text, finish, gap, chunks, cut = stream(endpoint, api, body, kill)
            error = None
        except (OSError, RuntimeError) as e:
            text, finish, gap, chunks, cut, error = "", None, 0.0, 0, None, str(e)
        metrics = urllib_get(f"{url}/metrics")
        moves = re.findall(r'^pdserve_router_migrations_total\{reason="(\w+)"\} (\S+)$', metrics, re.M)
        return {
            "case": case,
            "equal": text == twin_text and finish == twin_finish,
            "finish": finish,
            "twin_finish": twin_finish,
            "chunks": chunks,
            "max_gap_after_kill_ms": round(gap * 1e3, 1),
            "migrations": {reason: float(n) for reason, n in moves},
            "error": error,
            "text_chars": len(text),
            "chars_before_kill": cut,
            # where the texts part (None: equal): at the kill, or before it (then not the move's doing)
            "first_difference": next(
                (i for i, (a, b) in enumerate(zip(text, twin_text)) if a != b),
                None if text == twin_text else min(len(text), len(twin_text)),
            ),
            "twin_chars": len(twin_text),
        }
    finally:
        stop_processes(list(reversed(procs)), grace_s=30)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} not ready in {timeout_s} s")


def wait_grpc(port: int, timeout_s: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                    return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server on {port} not ready in {timeout_s} s")


def urllib_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def model_and_log_dir(args) -> tuple[str, Path]:
    """The checkpoint (--model-path, else --random-weights' built once) and the log directory, made."""
    if not args.model_path and not args.random_weights:
        args.random_weights = "llama/tiny"
    model = model_path_from_args(args)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    return model, log_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.migration", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path")
    parser.add_argument("--random-weights", help="ARCH/SHAPE (default llama/tiny, without --model-path)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="", help="the servers' --dtype (default: theirs, bf16 on CUDA)")
    parser.add_argument("--cases", nargs="+", default=["json", "ngram"], choices=("json", "ngram", "greedy"))
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--kill-after", type=int, default=40, help="chunks the stream receives before the SIGKILL")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--log-dir", default="/tmp/pdserve-migration")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    model, log_dir = model_and_log_dir(args)
    results = []
    for case in args.cases:
        result = run_case(case, model, args, log_dir)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["equal"] and r["migrations"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
