"""Many streams through a router of several workers, one worker SIGKILLed mid-run.

    python -m pdserve.bench.micro.worker_kill --streams 5000 --workers 4 [--random-weights llama/tiny] [--no-warm-spare]

Starts a prefill and a decode server and `pdserve-router --workers N` on CPU, asks each of a few
prompts once without streaming (the twins), then runs the streams, `--concurrency` at a time, each
on a connection of its own. Once `--kill-at` of them have started, the worker with the most streams
in flight is stopped (SIGSTOP), what it holds read from /proc (the router's side of each
connection, and the connections still in accept queues), and then SIGKILLed; so the run can say
which streams may fail. The run starts once the router's warm spare is warm (--no-warm-spare: the
router keeps none, and a fresh worker takes the dead one's place). It checks:
  - every stream that ended equals its twin token for token (the text, greedy), no answer is a 5xx;
  - every stream that broke was the killed worker's: held by it, waiting in an accept queue, or
    connected while it died (the kernel may give it a new connection until its socket closes);
    the rest of the in-flight streams, and every later one, succeed;
  - the supervisor has a new worker listening within 5 s of the SIGKILL (its socket in LISTEN in
    /proc; then 4 × N requests in a row succeed).
Prints one JSON line (and --json writes it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h11

from pdserve.bench.micro.proc_sockets import listeners_of, listening, peer_ports, tcp_sockets, unaccepted_peers
from pdserve.bench.migration import wait_grpc, wait_ready
from pdserve.common.ports import free_port
from pdserve.router.serve import SPARE_NAME, WORKER_NAME

TWINS = 32


def start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *args], stdout=open(log, "w"), stderr=subprocess.STDOUT)


def children_of(supervisor: int, name: str) -> set[int]:
    """The supervisor's processes called `name` (router/serve.py names them): children of its fork
    server, the supervisor's child (router/supervisor.py)."""
    out = subprocess.run(["pgrep", "-P", str(supervisor)], capture_output=True, text=True).stdout
    pids = [int(p) for p in out.split()]
    for parent in list(pids):
        pids += map(int, subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split())
    found = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.add(pid)
        except OSError:
            pass  # gone meanwhile
    return found


def workers_of(supervisor: int) -> set[int]:
    """Its workers, not the spare (nor multiprocessing's resource tracker)."""
    return children_of(supervisor, WORKER_NAME)


class Stream:
    def __init__(self, index: int):
        self.index, self.local_port, self.text, self.status, self.error = index, None, "", None, None
        self.started = self.done = False
        self.connecting_at = self.connected_at = None


async def run_stream(stream: Stream, port: int, body: bytes) -> None:
    """POST a streamed completion on a connection of its own; collect the text of its chunks."""
    try:
        stream.connecting_at = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        stream.local_port, stream.connected_at = writer.get_extra_info("sockname")[1], time.monotonic()
        conn = h11.Connection(h11.CLIENT)
        writer.write(
            conn.send(
                h11.Request(
                    method="POST",
                    target="/v1/completions",
                    headers=[
                        ("Host", f"127.0.0.1:{port}"),
                        ("Content-Type", "application/json"),
                        ("Content-Length", str(len(body))),
                    ],
                )
            )
        )
        writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        stream.started = True
        buffer, finished = b"", False
        while not finished:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await asyncio.wait_for(reader.read(1 << 16), 120)
                conn.receive_data(data)
                if not data:
                    break
            elif isinstance(event, h11.Response):
                stream.status = event.status_code
            elif isinstance(event, h11.Data):
                buffer += event.data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    line = line.strip()
                    if line.startswith(b"data:") and line != b"data: [DONE]":
                        chunk = json.loads(line[5:])
                        stream.text += "".join(c.get("text", "") for c in chunk.get("choices", []))
                    finished |= line == b"data: [DONE]"
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        if not finished:
            stream.error = "the stream ended without [DONE]"
        writer.close()
    except (OSError, asyncio.TimeoutError, h11.RemoteProtocolError) as e:
        stream.error = f"{type(e).__name__}: {e}"
    finally:
        stream.done = True


def completion(port: int, body: dict) -> str:
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


async def drive(port: int, supervisor: int, args) -> dict:
    loop = asyncio.get_running_loop()
    base = {"model": args.model_path, "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    prompts = [f"stream {i}: " + "the quick brown fox " * (i % 7) for i in range(TWINS)]
    twins = [await loop.run_in_executor(None, completion, port, {**base, "prompt": p}) for p in prompts]
    bodies = [json.dumps({**base, "prompt": p, "stream": True}).encode() for p in prompts]
    streams = [Stream(i) for i in range(args.streams)]
    gate = asyncio.Semaphore(args.concurrency)
    kill_at = int(args.kill_at * args.streams)
    report: dict = {}

    async def one(stream: Stream) -> None:
        async with gate:
            await run_stream(stream, port, bodies[stream.index % TWINS])

    async def killer() -> None:
        while sum(s.started for s in streams) < kill_at:
            await asyncio.sleep(0.01)
        pids = workers_of(supervisor)
        spares = children_of(supervisor, SPARE_NAME)  # warm ones
        counts = {pid: len(peer_ports(pid, port)) for pid in pids}
        victim = max(pids, key=counts.get)
        # Stopped first, so that what it holds can be read at leisure and cannot change: its streams
        # make no progress, and new connections the kernel gives it wait in its accept queue.
        os.kill(victim, signal.SIGSTOP)
        held = {pid: peer_ports(pid, port) for pid in pids}
        queued = unaccepted_peers(port)
        listener = listeners_of(victim, port)
        open_ = [s for s in streams if s.local_port is not None and not s.done]
        stopped_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        report.update(
            victim=victim,
            in_flight_at_kill=len(open_),
            spare_warm_at_kill=bool(spares),
            held_by_victim={s.index for s in open_ if s.local_port in held[victim]},
            unaccepted={s.index for s in open_ if s.local_port in queued},
            held_per_worker=sorted(len(p) for p in held.values()),
        )
        # Its sockets close as it exits (after its memory is torn down). NOTE: watched in the TCP
        # table, not in /proc/PID/fd: that shows the main thread's files, which it may let go
        # while its other threads still hold them (and the kernel still queues connections).
        while listener & {inode for *_, inode in tcp_sockets(port)}:
            await asyncio.sleep(0.001)
        closed_at = time.monotonic()
        report["sockets_closed_after_s"] = closed_at - killed_at
        # Connections made from the stop until its socket closed may be given to it by the kernel.
        report["connected_while_dying"] = {
            s.index
            for s in streams
            if s.connecting_at is not None
            and s.connecting_at <= closed_at
            and (s.connected_at or closed_at) >= stopped_at
        }
        while not (new := workers_of(supervisor) - pids):
            await asyncio.sleep(0.005)
        report["replaced_after_s"] = time.monotonic() - killed_at
        report["replaced_by_the_spare"] = new <= spares
        while not listening(min(new), port):
            await asyncio.sleep(0.005)
        report["listening_after_s"] = time.monotonic() - killed_at
        # Then 4 × workers requests in a row answered (each on a new connection, which the kernel
        # spreads over the listening workers, the new one included).
        body, in_a_row, refused = {**base, "prompt": prompts[0], "max_tokens": 2}, 0, []
        while in_a_row < 4 * args.workers and time.monotonic() - killed_at < 60:
            try:
                await loop.run_in_executor(None, completion, port, body)
                in_a_row += 1
            except OSError as e:
                refused.append(f"{time.monotonic() - killed_at:.3f} s: {e}")
                in_a_row = 0
        report["serving_after_s"] = time.monotonic() - killed_at
        report["probes_refused_after_kill"] = refused

    started = time.monotonic()
    kill = asyncio.create_task(killer())
    await asyncio.gather(*(one(s) for s in streams))
    await asyncio.wait_for(kill, 60)
    report["duration_s"] = time.monotonic() - started
    return {"streams": streams, "twins": twins, **report}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.bench.micro.worker_kill", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model-path")
    parser.add_argument("--random-weights", default="llama/tiny")
    parser.add_argument("--streams", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--kill-at", type=float, default=0.5, help="fraction of the streams started before the kill")
    parser.add_argument("--server-torch-threads", type=int, help="each CPU server's torch threads (default: torch's)")
    parser.add_argument(
        "--no-warm-spare", action="store_true", help="the router's flag: a fresh worker replaces the dead one"
    )
    parser.add_argument("--log-dir", default="/tmp/pdserve-worker-kill")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.model_path is None:
        from pdserve.bench.random_weights import random_weight_checkpoint

        args.model_path = str(random_weight_checkpoint(args.random_weights))
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    procs = []
    try:
        for role, port in (("prefill", p_port), ("decode", d_port)):
            procs.append(
                start(
                    [
                        f"pdserve.{role}.cli",
                        "--model-path",
                        args.model_path,
                        "--device",
                        "cpu",
                        "--port",
                        str(port),
                        "--log-level",
                        "warning",
                        *(["--torch-threads", str(args.server_torch_threads)] if args.server_torch_threads else []),
                    ],
                    logs / f"{role}.log",
                )
            )
        for port in (p_port, d_port):
            wait_grpc(port, 300)
        router = start(
            [
                "pdserve.router.cli",
                "--model-path",
                args.model_path,
                "--port",
                str(r_port),
                "--workers",
                str(args.workers),
                "--max-inflight",
                str(4 * args.concurrency),
                "--prefill",
                f"127.0.0.1:{p_port}",
                "--decode",
                f"127.0.0.1:{d_port}",
                "--log-level",
                "info",
                *(["--no-warm-spare"] if args.no_warm_spare else []),
            ],
            logs / "router.log",
        )
        procs.append(router)
        wait_ready(f"http://127.0.0.1:{r_port}/readiness", router, 120)
        while len(workers_of(router.pid)) < args.workers or not (
            args.no_warm_spare or children_of(router.pid, SPARE_NAME)
        ):
            assert router.poll() is None, f"the router exited with {router.returncode}"
            time.sleep(0.2)
        run = asyncio.run(drive(r_port, router.pid, args))
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    streams, twins, held, unaccepted = run["streams"], run["twins"], run["held_by_victim"], run["unaccepted"]
    dying = run["connected_while_dying"]
    broke = {s.index for s in streams if s.error is not None}
    http_errors = sorted({s.status for s in streams if s.status is not None and s.status != 200})
    mismatched = [s.index for s in streams if s.error is None and s.text != twins[s.index % TWINS]]
    result = {
        "streams": len(streams),
        "workers": args.workers,
        "concurrency": args.concurrency,
        "output_len": args.output_len,
        "duration_s": round(run["duration_s"], 1),
        "in_flight_at_kill": run["in_flight_at_kill"],
        "held_per_worker_at_kill": run["held_per_worker"],
        "held_by_killed_worker": len(held),
        "unaccepted_at_kill": len(unaccepted),
        "broken_streams": len(broke),
        "broken_held_by_the_killed_worker": len(broke & held),
        "broken_unaccepted_at_kill": len(broke & unaccepted),
        "broken_connected_while_it_died": len((broke - held - unaccepted) & dying),
        "broken_elsewhere": sorted(broke - held - unaccepted - dying)[:10],
        "errors_elsewhere": sorted({streams[i].error for i in broke - held - unaccepted - dying})[:5],
        "succeeded": len(streams) - len(broke),
        "equal_to_twin": len(streams) - len(broke) - len(mismatched),
        "mismatched": mismatched[:10],
        "http_errors": http_errors,
        "spare_warm_at_kill": run["spare_warm_at_kill"],
        "replaced_by_the_spare": run["replaced_by_the_spare"],
        "sockets_closed_after_s": round(run["sockets_closed_after_s"], 3),
        "replaced_after_s": round(run["replaced_after_s"], 2),
        "listening_again_after_s": round(run["listening_after_s"], 2),
        "probes_refused_after_kill": run["probes_refused_after_kill"],
        "serving_again_after_s": round(run["serving_after_s"], 2),
    }
    result["ok"] = (
        not result["broken_elsewhere"] and not mismatched and not http_errors and result["listening_again_after_s"] < 5
    )
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
