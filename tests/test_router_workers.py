"""`pdserve-router --workers N`: N processes on one port (SO_REUSEPORT) under a supervisor.

Exact choices of prefix_hash (what cache_aware becomes with several processes: every process must
send a prefix to the same server), the supervisor's restart rules and its warm spare with fake
workers, and the real thing: a router of 2 workers before a decode and 2 prefill servers, driven by
the `openai` client, with one worker SIGKILLed under load and its place taken by the warm spare.
"""

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.common.ports import free_port
from pdserve.router.config import RouterConfig, default_workers
from pdserve.router.policies import PREFIX_HASH_TOKENS, PrefixHash, WorkerView, make_policy
from pdserve.router.serve import SPARE_NAME, WARMING_NAME, WORKER_NAME, wait_for_promotion

REPO = Path(__file__).resolve().parent.parent
HEALTH_CHECK_INTERVAL_S = 0.5  # the real router's (the fixture's)


def w(url, load=0, inflight=0, healthy=True):
    return WorkerView(url=url, healthy=healthy, load=load, inflight=inflight)


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(50000) for _ in range(rng.randrange(1, 200))] for _ in range(n)]


# --- prefix_hash: rendezvous hashing of the prompt's first block ---------------------------------

SERVERS = [w(f"10.0.0.{i}:50051") for i in range(5)]


def test_prefix_hash_same_prefix_same_server_in_independent_policies():
    one, other = PrefixHash(), PrefixHash()
    shuffled = random.Random(1).sample(SERVERS, len(SERVERS))  # another process may list them otherwise
    for prompt in prompts(300):
        assert one.pick(SERVERS, prompt).url == other.pick(shuffled, prompt).url
    # only the first PREFIX_HASH_TOKENS tokens decide: a shared system prompt keeps its server
    system = list(range(1000, 1000 + PREFIX_HASH_TOKENS))
    assert len({one.pick(SERVERS, system + tail).url for tail in prompts(50, seed=2)}) == 1
    # and the prompts spread: every server gets some of 300 different prefixes
    assert {one.pick(SERVERS, p).url for p in prompts(300)} == {s.url for s in SERVERS}


def test_prefix_hash_is_the_same_in_another_process():
    """Not Python's hash(), which each process salts differently (PYTHONHASHSEED)."""
    code = (
        "import json, sys; from pdserve.router.policies import PrefixHash, WorkerView; "
        "from tests.test_router_workers import SERVERS, prompts; "
        "print(json.dumps([PrefixHash().pick(SERVERS, p).url for p in prompts(100)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    ).stdout
    assert json.loads(out) == [PrefixHash().pick(SERVERS, p).url for p in prompts(100)]


def test_prefix_hash_removing_a_server_moves_only_its_share():
    policy = PrefixHash()
    before = {i: policy.pick(SERVERS, p).url for i, p in enumerate(prompts(1000))}
    gone = SERVERS[2].url
    for remaining in ([s for s in SERVERS if s.url != gone], [w(s.url, healthy=s.url != gone) for s in SERVERS]):
        after = {i: policy.pick(remaining, p).url for i, p in enumerate(prompts(1000))}
        moved = {i for i in before if before[i] != after[i]}
        assert moved == {i for i in before if before[i] == gone}  # exactly its prompts moved
        assert 100 < len(moved) < 300  # about a fifth
        assert len({after[i] for i in moved}) == 4  # and they spread over the other four


def test_prefix_hash_falls_back_to_least_load_when_its_server_is_overloaded():
    policy = PrefixHash()
    prompt = list(range(100))
    home = policy.pick(SERVERS, prompt).url
    others = sorted(s.url for s in SERVERS if s.url != home)

    def loaded(home_load, other_load, home_inflight=0):
        return [
            w(s.url, load=home_load, inflight=home_inflight) if s.url == home else w(s.url, load=other_load)
            for s in SERVERS
        ]

    # 40 vs 5: the difference 35 > 32 and 40 > 1.5 * 5 -> the least loaded (ties by url)
    assert policy.pick(loaded(40, 5), prompt).url == others[0]
    assert policy.pick(loaded(30, 5, home_inflight=10), prompt).url == others[0]  # inflight counts too
    assert policy.pick(loaded(37, 5), prompt).url == home  # a difference of exactly 32 is not overload
    assert policy.pick(loaded(200, 140), prompt).url == home  # 200 <= 1.5 * 140: not overload either


def test_prefix_hash_never_picks_an_unhealthy_server():
    policy = PrefixHash()
    assert policy.pick([], [1]) is None
    assert policy.pick([w("a:1", healthy=False)], [1]) is None
    for prompt in prompts(50):
        home = policy.pick(SERVERS, prompt).url
        rest = [w(s.url, healthy=s.url != home) for s in SERVERS]
        assert policy.pick(rest, prompt).url != home


def test_prefix_hash_serves_both_roles():
    assert isinstance(make_policy("prefix_hash", "prefill"), PrefixHash)
    assert isinstance(make_policy("prefix_hash", "decode"), PrefixHash)  # prefix-aware transfers: any policy


# --- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cores, workers", [(1, 1), (2, 1), (3, 1), (4, 2), (16, 8), (64, 8)])
def test_default_workers_is_half_the_cores_from_1_to_8(monkeypatch, cores, workers):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert default_workers() == workers


def test_cache_aware_runs_as_prefix_hash_with_several_workers(monkeypatch):
    assert RouterConfig("/m", prefill_policy="cache_aware", workers=1).resolve().prefill_policy == "cache_aware"
    assert RouterConfig("/m", prefill_policy="cache_aware", workers=2).resolve().prefill_policy == "prefix_hash"
    assert RouterConfig("/m", prefill_policy="least_load", workers=2).resolve().prefill_policy == "least_load"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    resolved = RouterConfig("/m", prefill_policy="cache_aware").resolve()  # --workers 0: from the cores
    assert (resolved.workers, resolved.prefill_policy) == (4, "prefix_hash")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--workers", "-1"], "--workers must be >= 0"),
        (["--port", "0", "--workers", "2"], "--port 0 (any free port) needs --workers 1"),
    ],
)
def test_bad_workers_values_exit_2(capsys, extra, message):
    from pdserve.router.cli import main

    assert main(["--model-path", "/m", "--prefill", "p:1", "--decode", "d:1", *extra]) == 2
    assert message in capsys.readouterr().err


# --- the supervisor, with fake workers ---------------------------------------------------------


def flaky_worker(config, index, ready, metrics_dir):
    """Worker 1 serves until stopped; worker 0 serves once, dies, and then fails every start.

    Each start appends "INDEX EVENT METRICS_DIR" to the file `config.model_path`/starts."""
    log = os.path.join(config.model_path, "starts")

    def note(event):
        with open(log, "a") as f:
            f.write(f"{index} {event} {metrics_dir}\n")

    note("start")
    with open(log) as f:
        starts = [line.split()[:2] for line in f].count([str(index), "start"])
    if index == 0 and starts > 1:
        sys.exit(3)
    ready.send("ready")
    note("ready")
    if index == 1:
        signal.pause()  # until the supervisor's SIGTERM
    while "1 ready" not in open(log).read():  # die only once the first start is over
        time.sleep(0.05)
    time.sleep(0.3)
    os._exit(1)


def test_a_worker_that_keeps_failing_to_start_stops_the_supervisor(tmp_path):
    code = (
        "import sys; from pdserve.router.config import RouterConfig; from pdserve.router.supervisor import Supervisor; "
        "from tests.test_router_workers import flaky_worker; "
        f"sys.exit(Supervisor(RouterConfig({str(tmp_path)!r}, ('127.0.0.1:1',), ('127.0.0.1:2',), port={free_port()}, "
        "workers=2, no_warm_spare=True), flaky_worker).run())"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "error: router worker 0" in done.stderr and "5th failed start in a row; stopping" in done.stderr
    assert done.stderr.count("starting it again") == 5  # once after it served, then after 4 failed starts
    lines = [line.split() for line in (tmp_path / "starts").read_text().splitlines()]
    assert [event for index, event, _ in lines if index == "0"].count("start") == 6
    metrics_dirs = {d for *_, d in lines}
    assert len(metrics_dirs) == 1 and not os.path.exists(metrics_dirs.pop())  # removed at exit
    assert time.monotonic() - started < 30


def patient_worker(config, index, ready, metrics_dir):
    """Notes each SIGTERM and SIGINT in `config.model_path`/signals; exits on SIGINT, or 3 s after a SIGTERM."""
    received = []

    def note(signum, frame):
        received.append(signum)
        with open(os.path.join(config.model_path, "signals"), "a") as f:
            f.write(f"{index} {signal.Signals(signum).name}\n")

    signal.signal(signal.SIGTERM, note)
    signal.signal(signal.SIGINT, note)
    ready.send("ready")
    with open(os.path.join(config.model_path, "signals"), "a") as f:
        f.write(f"{index} ready\n")
    while signal.SIGINT not in received:
        if signal.SIGTERM in received:
            time.sleep(3)
            break
        time.sleep(0.05)


def test_signals_reach_the_workers_as_uvicorn_expects_them(tmp_path):
    """The first signal goes on as SIGTERM (drain), a repeated SIGTERM not at all (`pdserve up` sends
    one after a Ctrl-C), a later SIGINT as SIGINT (stop now); the supervisor exits 0 after them."""
    code = (
        "import sys; from pdserve.router.config import RouterConfig; from pdserve.router.supervisor import Supervisor; "
        "from tests.test_router_workers import patient_worker; "
        f"sys.exit(Supervisor(RouterConfig({str(tmp_path)!r}, ('127.0.0.1:1',), ('127.0.0.1:2',), port={free_port()}, "
        "workers=2, no_warm_spare=True), patient_worker).run())"
    )
    supervisor = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "signals"

    def lines():
        return sorted(log.read_text().splitlines()) if log.exists() else []

    wait_for("both workers ready", lambda: lines() == ["0 ready", "1 ready"], 30)
    supervisor.send_signal(signal.SIGINT)  # a Ctrl-C (here to the supervisor alone)
    wait_for("SIGTERM passed on", lambda: len(lines()) == 4, 5)
    supervisor.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert lines() == ["0 SIGTERM", "0 ready", "1 SIGTERM", "1 ready"]
    supervisor.send_signal(signal.SIGINT)
    assert supervisor.wait(10) == 0, supervisor.stderr.read()
    assert lines() == ["0 SIGINT", "0 SIGTERM", "0 ready", "1 SIGINT", "1 SIGTERM", "1 ready"]


def note(config, line):
    with open(os.path.join(config.model_path, "events"), "a") as f:
        f.write(f"{line} {os.getpid()}\n")


def lasting_worker(config, index, ready, metrics_dir):
    """Serves (says ready) until killed; notes "INDEX start|ready PID" in `config.model_path`/events."""
    note(config, f"{index} start")
    ready.send("ready")
    note(config, f"{index} ready")
    signal.pause()


def slow_spare(config, pipe, metrics_dir):
    """Warms for 1 s, then waits as the real spare does; promoted, it serves as lasting_worker.
    Notes "spare warm|gone PID" and "INDEX promoted|ready PID"."""
    time.sleep(1)
    note(config, "spare warm")
    index = wait_for_promotion(pipe)  # says "warm"
    if index is None:
        note(config, "spare gone")
        return
    note(config, f"{index} promoted")
    pipe.send("ready")
    note(config, f"{index} ready")
    signal.pause()


def broken_spare(config, pipe, metrics_dir):
    sys.exit(2)


def alive(pid: int) -> bool:
    """Whether `pid` exists (a zombie its parent has not reaped yet counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def supervise(tmp_path, worker, spare) -> subprocess.Popen:
    code = (
        "import sys; from pdserve.router.config import RouterConfig; from pdserve.router.supervisor import Supervisor; "
        f"from tests.test_router_workers import {worker}, {spare}; "
        f"sys.exit(Supervisor(RouterConfig({str(tmp_path)!r}, ('127.0.0.1:1',), ('127.0.0.1:2',), port={free_port()}, "
        f"workers=2), {worker}, {spare}).run())"
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True)


def events(tmp_path) -> list[tuple[str, str, int]]:
    """(who, event, pid) in order: who is a slot index or "spare"."""
    path = tmp_path / "events"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(who, event, int(pid)) for who, event, pid in map(str.split, lines)]


def test_a_dead_worker_is_replaced_by_the_warm_spare(tmp_path):
    """Promoted at once into the dead worker's slot, and a new spare started; without a warm spare
    the slot gets a fresh worker; a dead spare is started again; on stop the spare is not promoted."""
    supervisor = supervise(tmp_path, "lasting_worker", "slow_spare")

    def seen(who, event):
        return [pid for w, e, pid in events(tmp_path) if (w, e) == (who, event)]

    # the spare starts with the workers: wait for both (the order is theirs)
    wait_for("a warm spare", lambda: len(seen("spare", "warm")) == 1, 30)
    wait_for("both serving", lambda: {w for w, e, _ in events(tmp_path) if e == "ready"} == {"0", "1"}, 30)
    [spare] = seen("spare", "warm")
    [victim] = seen("0", "start")
    os.kill(victim, signal.SIGKILL)
    wait_for("the spare serving slot 0", lambda: seen("0", "ready")[1:] == [spare], 2)
    assert seen("0", "promoted") == [spare] and seen("0", "start") == [victim]  # no fresh start
    wait_for("another warm spare", lambda: len(seen("spare", "warm")) == 2, 30)
    second = seen("spare", "warm")[1]

    # the warm spare dies, and then worker 1: the next spare is still warming, so slot 1 starts afresh
    os.kill(second, signal.SIGKILL)
    # NOTE: once the supervisor has reaped the dead spare (it joins it), it knows it is gone: killed
    # at once, worker 1 could die first in the supervisor's eyes and be handed the dead spare.
    wait_for("the dead spare reaped", lambda: not alive(second), 10)
    [one] = seen("1", "start")
    os.kill(one, signal.SIGKILL)
    wait_for("a fresh worker 1", lambda: len(seen("1", "ready")) == 2, 30)
    assert len(seen("1", "start")) == 2 and not seen("1", "promoted")
    wait_for("a third warm spare", lambda: len(seen("spare", "warm")) == 3, 30)

    supervisor.send_signal(signal.SIGTERM)  # the workers and the spare: never promoted now
    assert supervisor.wait(30) == 0, supervisor.stderr.read()
    stderr = supervisor.stderr.read()
    assert (
        "worker 0 (pid %d) was killed by SIGKILL; the warm spare (pid %d) takes its place" % (victim, spare) in stderr
    )
    assert "worker 1 (pid %d) was killed by SIGKILL; starting it again" % one in stderr
    assert "spare (pid %d) was killed by SIGKILL; starting another" % second in stderr
    assert [e for w, e, _ in events(tmp_path) if e == "promoted"] == ["promoted"]
    assert not any(Path(f"/proc/{pid}").exists() for *_, pid in events(tmp_path))


def test_a_spare_that_keeps_failing_is_given_up_and_the_router_serves_on(tmp_path):
    supervisor = supervise(tmp_path, "lasting_worker", "broken_spare")
    try:
        line = ""
        while "no spare from now on" not in line:  # (warnings and errors reach stderr: logging's last resort)
            line = supervisor.stderr.readline()
            assert line, "the supervisor exited"
        assert "5th time in a row" in line and supervisor.poll() is None
        [zero] = [pid for w, e, pid in events(tmp_path) if (w, e) == ("0", "start")]
        os.kill(zero, signal.SIGKILL)  # started afresh
        wait_for("a fresh worker 0", lambda: [w for w, e, _ in events(tmp_path) if e == "ready"].count("0") == 2, 30)
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(30) == 0
    finally:
        if supervisor.poll() is None:
            supervisor.kill()


# --- the real thing: 2 router workers, a decode and 2 prefill servers --------------------------


def children_named(supervisor: int, *names: str) -> set[int]:
    """The supervisor's worker and spare processes by name (router/serve.py names them): children of
    its fork server, which is the supervisor's child (router/supervisor.py)."""
    parents, named = {}, set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            name = Path(f"/proc/{entry}/comm").read_text().strip()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        if name in names:
            named.add(int(entry))
    return {pid for pid in named if parents.get(parents.get(pid)) == supervisor}


def worker_pids(supervisor: int) -> set[int]:
    """The supervisor's worker processes (not the spare, nor multiprocessing's resource tracker)."""
    return children_named(supervisor, WORKER_NAME)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def connections(pid: int, port: int) -> int:
    """Established TCP connections `pid` holds on its local `port` (the HTTP clients it serves)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if int(cols[1].split(":")[1], 16) == port and cols[3] == "01" and cols[9] in inodes:
            count += 1
    return count


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:  # a new connection each
        return r.read().decode()


def sample(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def serving_pids(text: str) -> set[int]:
    """Workers that wrote their gauges, i.e. serve (pdserve_router_worker_healthy is 'liveall')."""
    return {
        int(line.split('pid="')[1].split('"')[0])
        for line in text.splitlines()
        if line.startswith("pdserve_router_worker_healthy{") and line.endswith(" 1.0")
    }


def wait_for(what, check, timeout):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not {what} after {timeout} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def router(tiny_models):
    from tests.test_servers import Server

    model = tiny_models("llama")
    decode = Server("decode", model, "--max-total-tokens", "32768")  # test_a_killed_worker's streams all at once
    prefills = [Server("prefill", model), Server("prefill", model)]
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    supervisor = None
    try:
        for s in (decode, *prefills):
            s.wait_ready()
        supervisor = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.router.cli",
                "--model-path",
                model,
                "--port",
                str(port),
                "--workers",
                "2",
                "--prefill",
                *(p.address for p in prefills),
                "--decode",
                decode.address,
                "--prefill-policy",
                "cache_aware",
                "--health-check-interval",
                str(HEALTH_CHECK_INTERVAL_S),
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

        def up():
            assert supervisor.poll() is None, _read(log)
            try:
                return len(serving_pids(scrape(port))) == 2
            except OSError:
                return False

        wait_for("2 workers serving", up, 90)

        def ready():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readiness", timeout=5) as r:
                    return json.load(r)["ready"]
            except OSError:  # (a 503 too)
                return False

        wait_for("the router ready", ready, 90)
        # Ready only once both workers serve and the spare has warmed (router/supervisor.py): no
        # process of the router is still loading its tokenizer when the first burst comes.
        assert len(worker_pids(supervisor.pid)) == 2 and len(children_named(supervisor.pid, SPARE_NAME)) == 1
        yield model, port, supervisor
        everyone = (WORKER_NAME, SPARE_NAME, WARMING_NAME)
        wait_for("the workers and the spare", lambda: len(children_named(supervisor.pid, *everyone)) == 3, 30)
        pids = children_named(supervisor.pid, *everyone)
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(60) == 0, _read(log)
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    finally:
        if supervisor is not None and supervisor.poll() is None:
            supervisor.kill()
        for s in (decode, *prefills):
            s.stop()


def _read(log) -> str:
    log.seek(0)
    return log.read()


def test_streams_equal_their_non_streamed_twins_across_workers(router):
    import openai

    # (here, not at the top: the fake workers' processes import this module; that one imports torch)
    from tests.test_router_reliability import completion_text

    model, port, supervisor = router
    pids = worker_pids(supervisor.pid)
    assert len(pids) == 2
    cpu = {pid: cpu_seconds(pid) for pid in pids}
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=120, max_retries=0)
    texts = [f"twin {i} " + "word " * (i % 11) for i in range(240)]

    def one(prompt, stream):
        return completion_text(client, model, prompt, stream)

    async def main():  # an API error (a 5xx) raises: none may happen
        streamed = await asyncio.gather(*(one(p, True) for p in texts))
        plain = await asyncio.gather(*(one(p, False) for p in texts))
        await client.close()
        return streamed, plain

    streamed, plain = asyncio.run(main())
    assert streamed == plain and all(streamed)
    used = {pid: cpu_seconds(pid) - cpu[pid] for pid in pids}  # the kernel spread the connections
    assert min(used.values()) > 0.25 * sum(used.values()), used


def test_cache_aware_sends_a_prefix_to_one_prefill_server_from_every_worker(router):
    """Each request on its own connection, so the kernel spreads them over both workers; every
    repeat of a prefix finds it cached, whichever worker routed the first."""
    model, port, _ = router
    # NOTE: the servers' loads come with the health checks; a burst of the test before can leave one
    # prefill server's report high enough that prefix_hash falls back to least_load (as it should
    # for a loaded server) until the next check: wait for two.
    time.sleep(2 * HEALTH_CHECK_INTERVAL_S)
    for group in range(6):
        shared = [0] + [100 + 7 * group + i for i in range(PREFIX_HASH_TOKENS + 16)]
        for repeat in range(5):
            body = json.dumps({"model": model, "prompt": shared + [5 + repeat], "max_tokens": 1, "temperature": 0})
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=body.encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as r:
                cached = json.loads(r.read())["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert (cached >= PREFIX_HASH_TOKENS) if repeat else cached == 0, (group, repeat, cached)


def test_metrics_sum_requests_over_workers(router):
    model, port, supervisor = router
    before = scrape(port)
    body = json.dumps({"model": model, "prompt": "count me", "max_tokens": 2, "temperature": 0}).encode()
    for _ in range(30):  # urllib: a new connection each, spread over both workers by the kernel
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            assert r.status == 200
    want = sample(before, 'pdserve_router_requests_total{status="200"}') + 30
    for _ in range(8):  # whichever worker answers the scrape reports both
        text = scrape(port)
        assert sample(text, 'pdserve_router_requests_total{status="200"}') == want
        assert sample(text, "pdserve_router_e2e_latency_seconds_count") >= want
        assert serving_pids(text) == worker_pids(supervisor.pid)
    # in flight: what each worker wrote last, at most a second ago (the other worker's requests of
    # the tests before may still show)
    wait_for("0 in flight", lambda: sample(scrape(port), "pdserve_router_inflight_requests") == 0, 5)


def test_a_killed_worker_fails_only_its_connections_and_is_replaced(router):
    import openai

    model, port, supervisor = router
    # the spare started with the workers, and was warm before the router said ready
    wait_for("a warm spare", lambda: len(children_named(supervisor.pid, SPARE_NAME)) == 1, 60)
    [spare] = children_named(supervisor.pid, SPARE_NAME)
    before = sample(scrape(port), 'pdserve_router_requests_total{status="200"}')
    prompts_ = [f"long story {i}" for i in range(4)]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=120, max_retries=0)
    # Streams long enough that none ends before the kill, which comes once all have started.
    streams, kw = 24, dict(model=model, max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
    victim, survivor = sorted(worker_pids(supervisor.pid))
    state = {}

    async def one(i, started: asyncio.Event, go: asyncio.Event, ready: list):
        text = ""
        try:
            chunks = await client.completions.create(prompt=prompts_[i % 4], stream=True, **kw)
            async for c in chunks:
                text += c.choices[0].text if c.choices else ""
                if not started.is_set():
                    started.set()
                    ready.append(i)
                    if len(ready) == streams:
                        go.set()
            return text
        except openai.APIStatusError:
            raise  # an HTTP error answer (a 5xx): never
        except Exception as e:  # the connection broke under it (the HTTP library's own error type)
            return e

    async def serving_again():
        """Seconds from the kill until the spare, promoted, reports in /metrics (it listens, and its
        health checks and gauges run), scraped while the survivor's streams go on."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                if spare in serving_pids(await loop.run_in_executor(None, scrape, port)):
                    return time.monotonic() - state["killed_at"]
            except OSError:  # a scrape the kernel gave the killed worker's socket just before it closed
                pass
            assert time.monotonic() - state["killed_at"] < 60, "the spare never served"
            await asyncio.sleep(0.05)

    async def main():
        refs = await asyncio.gather(*(client.completions.create(prompt=p, **kw) for p in prompts_))
        want = [r.choices[0].text for r in refs]
        ready, go = [], asyncio.Event()
        tasks = [asyncio.create_task(one(i, asyncio.Event(), go, ready)) for i in range(streams)]
        await asyncio.wait_for(go.wait(), 60)  # every stream has its first tokens: all its connections are up
        state["held"] = {pid: connections(pid, port) for pid in (victim, survivor)}
        os.kill(victim, signal.SIGKILL)
        state["killed_at"] = time.monotonic()
        state["running"] = sum(not t.done() for t in tasks)
        watch = asyncio.create_task(serving_again())
        results = await asyncio.gather(*tasks)
        state["serving_after_s"] = await watch
        await client.close()
        return want, results

    want, results = asyncio.run(main())
    held = state["held"]
    assert state["running"] == streams  # (the streams are long enough)
    assert held[victim] + held[survivor] == streams and held[victim] > 0 and held[survivor] > 0, held
    failed = [r for r in results if isinstance(r, Exception)]
    succeeded = [(i, r) for i, r in enumerate(results) if not isinstance(r, Exception)]
    assert len(failed) == held[victim] and len(succeeded) == held[survivor], (held, failed)
    assert all(text == want[i % 4] for i, text in succeeded)

    # the warm spare took the dead worker's place at once: serving within 5 s of the kill (a worker
    # started afresh takes 12-14 s on a loaded host), and the port kept serving all along
    assert state["serving_after_s"] < 5, state
    assert worker_pids(supervisor.pid) == {survivor, spare}
    assert serving_pids(scrape(port)) == {survivor, spare}
    # the dead worker's requests still count; its live gauges are gone
    # (a stream is counted when its response starts: all were, in the killed worker's file too)
    assert sample(scrape(port), 'pdserve_router_requests_total{status="200"}') == before + 4 + streams
    # and another spare warms, neither serving nor counted as a worker
    wait_for("a new spare", lambda: len(children_named(supervisor.pid, SPARE_NAME, WARMING_NAME) - {spare}) == 1, 5)
    body = json.dumps({"model": model, "prompt": "again", "max_tokens": 2, "temperature": 0}).encode()
    for _ in range(20):
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            assert r.status == 200


# --- failing starts ----------------------------------------------------------------------------


def run_router(*flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.router.cli",
            "--prefill",
            "127.0.0.1:1",
            "--decode",
            "127.0.0.1:2",
            "--log-level",
            "warning",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_fails_at_once(tiny_models, workers):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        done = run_router("--model-path", tiny_models("llama"), "--port", str(port), "--workers", workers)
    assert done.returncode == 2
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert time.monotonic() - started < 15


def test_a_second_router_on_the_port_of_a_running_one_fails(router):
    """The workers' SO_REUSEPORT would let another of our processes join the port: the check doesn't."""
    model, port, _ = router
    done = run_router("--model-path", model, "--port", str(port), "--workers", "2")
    assert done.returncode == 2 and "Address already in use" in done.stderr


def test_a_bad_model_path_fails_the_first_start(tmp_path):
    started = time.monotonic()
    done = run_router("--model-path", str(tmp_path / "nope"), "--port", str(free_port()), "--workers", "2")
    assert done.returncode == 2
    assert "has no config.json" in done.stderr and "while starting; stopping" in done.stderr
    assert time.monotonic() - started < 20
