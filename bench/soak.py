"""Load for a long while, a server SIGKILLed and started again every few minutes: what the clients saw.

    python -m pdserve.bench.soak [--duration 1200] [--kill-every 120] [--concurrency 8] [--random-weights llama/tiny]

A prefill server, two decode servers and `pdserve-router` (one worker, health checks every 0.5 s) on
the CPU. First the greedy text of each of `--prompts` prompts (the twins); then `--concurrency`
client threads send those prompts (streamed or not, `max_tokens` drawn per request) for `--duration`
seconds, while every `--kill-every` seconds one server (prefill, decode 0, decode 1 in turn) is
SIGKILLed and started again on its ports. It checks, and prints as one JSON line:
  - every request ended within `--request-timeout` with its twin's text (a prefix of it: the twins
    ran to the longest budget) or a clear error (an HTTP error status, or an error event in the
    stream); a 200 with other text is a wrong answer, a request past the bound a hang;
  - after the load, every server's KV back to idle (used tokens, running and waiting requests 0);
  - the RSS of every process that was not restarted (the router's, at least) within 10% of its
    size once the warm-up load had run.
Exit status 0 when all hold. Not run in CI (bench/, minutes long): docs/benchmarks/faults.md has its figures.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import sys
import threading
import time
import urllib.error
from pathlib import Path

from pdserve.bench.migration import (
    model_and_log_dir,
    post,
    start,
    start_server,
    stream,
    urllib_get,
    wait_grpc,
    wait_ready,
)
from pdserve.common.ports import free_port
from pdserve.router.up import stop_processes

HEALTH = ["--health-check-interval", "0.5", "--health-check-timeout", "0.5"]


class Stack:
    """The three servers (restartable on their ports) and the router."""

    def __init__(self, model: str, log_dir: Path, ready_timeout: float, router_flags: list[str]):
        self.model, self.log_dir, self.ready_timeout = model, log_dir, ready_timeout
        self.servers: list[dict] = []
        for role, name in (("prefill", "prefill"), ("decode", "decode-0"), ("decode", "decode-1")):
            self.servers.append({"role": role, "name": name, "ports": (free_port(), free_port()), "restarts": 0})
            self.start(self.servers[-1])
        self.http = free_port()
        prefill, decodes = self.servers[0], self.servers[1:]
        self.router = start(
            [sys.executable, "-m", "pdserve.router.cli", "--model-path", model, "--port", str(self.http)]
            + ["--workers", "1", "--prefill", f"127.0.0.1:{prefill['ports'][0]}"]
            + ["--decode", *(f"127.0.0.1:{d['ports'][0]}" for d in decodes), *HEALTH, *router_flags],
            log_dir / "router.log",
        )
        self.url = f"http://127.0.0.1:{self.http}"
        wait_ready(self.url + "/readiness", self.router, ready_timeout)

    def start(self, server: dict) -> None:
        log = self.log_dir / f"{server['name']}.log"
        server["proc"], _, _ = start_server(server["role"], self.model, "cpu", None, 0.0, [], log, server["ports"])
        wait_grpc(server["ports"][0], self.ready_timeout)

    def kill_and_restart(self, server: dict) -> float:
        """SIGKILL, then the same server again on its ports; the seconds it was away."""
        at = time.monotonic()
        server["proc"].send_signal(signal.SIGKILL)
        server["proc"].wait(30)
        self.start(server)
        server["restarts"] += 1
        return time.monotonic() - at

    def stop(self) -> None:
        stop_processes([self.router, *(s["proc"] for s in self.servers)], grace_s=30)


def rss_mib(pid: int) -> float:
    """The resident size of a process and its children (a router's workers), MiB."""
    total = 0.0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            total += int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{p}/status").read_text()).group(1)) / 1024
            pids += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (OSError, AttributeError):
            continue
    return total


def idle(stack: Stack, timeout: float) -> dict[str, dict]:
    """Each server's KV used tokens, running and waiting requests, once all are 0 or at the timeout."""
    names = ("pdserve_kv_used_tokens", "pdserve_running_requests", "pdserve_waiting_requests")
    deadline = time.monotonic() + timeout
    while True:
        seen = {}
        for s in stack.servers:
            text = urllib_get(f"http://127.0.0.1:{s['ports'][1]}/metrics")
            seen[s["name"]] = {n: float(re.search(rf"^{n}\{{[^}}]*\}} (\S+)$", text, re.M).group(1)) for n in names}
        if all(v == 0 for counts in seen.values() for v in counts.values()) or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


class Load:
    """Client threads sending the prompts until told to stop; every outcome kept."""

    def __init__(self, url: str, model: str, twins: list[str], args):
        self.url, self.model, self.twins, self.args = url, model, twins, args
        self.outcomes: list[dict] = []
        self.lock, self.done = threading.Lock(), threading.Event()

    def one(self, rng: random.Random) -> dict:
        i = rng.randrange(len(self.twins))
        body = {
            "model": self.model,
            "prompt": prompt_of(i),
            "max_tokens": rng.randint(4, self.args.max_tokens),
            "temperature": 0,
            "ignore_eos": True,
        }
        streamed = rng.random() < 0.5
        at = time.monotonic()
        try:
            if streamed:
                text, finish, _, _, _ = stream(
                    f"{self.url}/v1/completions", "completions", body, lambda n: False, self.args.request_timeout
                )
            else:
                choice = post(f"{self.url}/v1/completions", body, self.args.request_timeout)["choices"][0]
                text, finish = choice["text"], choice["finish_reason"]
            # (a cut can end inside a character's bytes: the text then ends with U+FFFD where the twin's
            # next token completes it)
            kind = "ok" if self.twins[i].startswith(text.rstrip("\ufffd")) and finish == "length" else "wrong"
            detail = None if kind == "ok" else f"finish {finish}, {text[:60]!r} not a prefix of the twin"
        except urllib.error.HTTPError as e:
            kind, detail = "error", f"HTTP {e.code}: {e.read()[:200]!r}"
        except (OSError, RuntimeError) as e:  # an error event; a timeout or a broken connection
            kind = "hung" if "timed out" in str(e) else "error"
            detail = str(e)[:200]
        return {"kind": kind, "streamed": streamed, "s": time.monotonic() - at, "detail": detail}

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.done.is_set():
            outcome = self.one(rng)
            with self.lock:
                self.outcomes.append(outcome)
            if outcome["kind"] != "ok":
                time.sleep(0.5)  # a client backing off, not a loop of instant errors


def prompt_of(i: int) -> str:
    return f"soak prompt {i}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(8 + i % 24))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path")
    parser.add_argument("--random-weights", help="ARCH/SHAPE (default llama/tiny, without --model-path)")
    parser.add_argument("--duration", type=float, default=1200.0, help="seconds of load")
    parser.add_argument("--kill-every", type=float, default=120.0, help="seconds between two server kills")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--request-timeout", type=float, default=60.0, help="a request's bound, seconds")
    parser.add_argument("--ready-timeout", type=float, default=120.0)
    parser.add_argument(
        "--prefill-fallback",
        default="fail",
        choices=("fail", "local"),
        help="the router's: while the prefill server is away, requests fail (503) or decode servers prefill them",
    )
    parser.add_argument("--log-dir", default="/tmp/pdserve-soak")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    model, log_dir = model_and_log_dir(args)
    stack = Stack(model, log_dir, args.ready_timeout, ["--prefill-fallback", args.prefill_fallback])
    try:
        return run(stack, model, args)
    finally:
        stack.stop()


def run(stack: Stack, model: str, args) -> int:
    twins = []
    for i in range(args.prompts):
        body = {"model": model, "prompt": prompt_of(i), "max_tokens": args.max_tokens, "temperature": 0}
        twins.append(post(f"{stack.url}/v1/completions", body | {"ignore_eos": True})["choices"][0]["text"])
    load = Load(stack.url, model, twins, args)
    clients = [threading.Thread(target=load.client, args=(seed,), daemon=True) for seed in range(args.concurrency)]
    for c in clients:
        c.start()
    time.sleep(min(10.0, args.kill_every / 2))  # warm-up load: the sizes the RSS check starts from
    baseline = {"router": (stack.router.pid, rss_mib(stack.router.pid))}
    baseline |= {s["name"]: (s["proc"].pid, rss_mib(s["proc"].pid)) for s in stack.servers}
    start, kills, turn = time.monotonic(), [], 0
    while time.monotonic() - start < args.duration:
        time.sleep(min(args.kill_every, max(0.0, args.duration - (time.monotonic() - start))))
        if time.monotonic() - start >= args.duration:
            break
        victim = stack.servers[turn % len(stack.servers)]
        turn += 1
        kills.append({"server": victim["name"], "away_s": round(stack.kill_and_restart(victim), 1)})
        print(f"killed and restarted {victim['name']} ({kills[-1]['away_s']} s away)", flush=True)
    load.done.set()
    for c in clients:
        c.join(args.request_timeout + 30)
    kv = idle(stack, 30.0)
    current = {"router": stack.router.pid} | {s["name"]: s["proc"].pid for s in stack.servers}
    rss = {
        name: {"start_mib": round(before, 1), "end_mib": round(rss_mib(pid), 1)}
        for name, (pid, before) in baseline.items()
        if current[name] == pid  # (a restarted server starts afresh)
    }
    outcomes = load.outcomes
    counts = {k: sum(o["kind"] == k for o in outcomes) for k in ("ok", "error", "wrong", "hung")}
    late = [o for o in outcomes if o["s"] > args.request_timeout]
    report = {
        "duration_s": args.duration,
        "kill_every_s": args.kill_every,
        "prefill_fallback": args.prefill_fallback,
        "requests": len(outcomes),
        **counts,
        "past_bound": len(late),
        "slowest_s": round(max((o["s"] for o in outcomes), default=0.0), 2),
        "errors": sorted({o["detail"][:120] for o in outcomes if o["kind"] != "ok"})[:10],
        "kills": kills,
        "kv_at_end": kv,
        "rss": rss,
    }
    kv_idle = all(v == 0 for counts_ in kv.values() for v in counts_.values())
    rss_ok = all(r["end_mib"] <= 1.1 * r["start_mib"] for r in rss.values())
    report["verdict"] = {
        "no_wrong_answer": counts["wrong"] == 0,
        "none_past_bound": not late and counts["hung"] == 0,
        "kv_idle": kv_idle,
        "rss_within_10pct": rss_ok,
    }
    print(json.dumps(report), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if all(report["verdict"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
