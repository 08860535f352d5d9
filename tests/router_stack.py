"""A router process in front of real servers, and raw HTTP against it, for the tests that act as a
careless or hostile client would (tests/test_api_fuzz.py, tests/test_router_overload.py).

Raw http.client, not the openai client: these tests send bodies no SDK would build, and read the
status, headers and error body of every answer."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from pdserve.common.ports import free_port


class RouterProcess:
    """`pdserve-router --workers 1` on a free port, ready when /readiness says so."""

    def __init__(self, model: str, prefills, decodes, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # NOTE: a file, not a pipe: a router that logs more than a pipe holds (tracebacks) while
        # nobody reads it would block in its next write, and look hung.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.router.cli",
                "--model-path",
                model,
                "--port",
                str(self.port),
                "--workers",
                "1",
                *(["--prefill", *(p.address for p in prefills)] if prefills else []),
                "--decode",
                *(d.address for d in decodes),
                "--log-level",
                "warning",
                *flags,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def output(self) -> str:
        """What the router has logged so far."""
        self.log.seek(0)
        return self.log.read()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/readiness", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert self.proc.poll() is None, "router exited:\n" + self.output()
            assert time.monotonic() < deadline, "router not ready"
            time.sleep(0.2)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def worker_errors(self) -> dict[str, float]:
        """Failures the router blamed on each server (worker url -> count), from /metrics."""
        found = re.findall(r'pdserve_router_worker_errors\{role="\w+",worker="([^"]+)"\} (\S+)', self.metrics())
        return {url: float(v) for url, v in found}

    def unhealthy(self) -> list[str]:
        """Servers the router does not route to now (health check failed or circuit open)."""
        # (with --workers > 1 every process has its own series, labelled with its pid)
        found = re.findall(
            r'pdserve_router_worker_healthy\{(?:pid="\d+",)?role="\w+",worker="([^"]+)"\} (\S+)', self.metrics()
        )
        return [url for url, v in found if float(v) == 0]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


class Answer:
    """One HTTP answer: status, headers, the body as JSON (or None) and, for SSE, its events."""

    def __init__(self, status: int, headers: dict, raw: bytes, events: list | None):
        self.status, self.headers, self.raw, self.events = status, headers, raw, events
        try:
            self.json = json.loads(raw) if events is None else None
        except ValueError:
            self.json = None

    def __repr__(self) -> str:
        return f"Answer({self.status}, {self.raw[:300]!r})"


def send(url: str, path: str, body: bytes | dict, timeout: float = 120.0) -> Answer:
    """POST `body` (bytes as they are, anything else as JSON) and read the whole answer; an SSE
    answer is read to its end, its `data:` events parsed (the literal "[DONE]" kept as a string)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        headers = {k.lower(): v for k, v in response.getheaders()}
        if not headers.get("content-type", "").startswith("text/event-stream"):
            return Answer(response.status, headers, response.read(), None)
        events, raw = [], b""
        for line in response:
            raw += line
            if line.startswith(b"data: "):
                payload = line[len(b"data: ") :].strip()
                events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
        return Answer(response.status, headers, raw, events)
    finally:
        conn.close()


def openai_error_problem(answer: Answer) -> str | None:
    """What is wrong with a 4xx answer's body, or None when it is OpenAI's error shape."""
    body = answer.json
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not error["message"]:
        return f"{answer.status} without an OpenAI error body: {answer.raw[:200]!r}"
    if not isinstance(error.get("type"), str) or not {"param", "code"} <= error.keys():
        return f"{answer.status} error body lacks type/param/code: {body}"
    return None


def pdserve_up(
    model: str | None, *flags: str, timeout: float = 180.0, sigint_ignored: bool = False, own_group: bool = False
) -> tuple[subprocess.Popen, int, str]:
    """`pdserve up --model-path MODEL --device cpu` on a free port: (the process, the router's port,
    the line that says it is up). Stop it with SIGINT (Ctrl-C), then wait for exit code 0.
    `model` None: no --model-path (the default model). `sigint_ignored`: started as a shell starts a
    background job, with SIGINT ignored. `own_group`: in a process group of its own, as a terminal
    starts it (os.killpg(proc.pid, SIGINT) is then a Ctrl-C: every process of it gets SIGINT)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.common.cli",
            "up",
            *(["--model-path", model] if model is not None else []),
            "--device",
            "cpu",
            "--port",
            str(port),
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None,
        process_group=0 if own_group else None,
    )
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "pdserve up exited:\n" + "".join(lines)
        lines.append(line)
        if "pdserve is up" in line:
            return proc, port, line
    proc.kill()
    raise TimeoutError("pdserve up not ready:\n" + "".join(lines))
