"""Servers sharing a GPU (router/gpu_sharing.py, router/layout.py, `pdserve up`), without a GPU: a fake
nvidia-cuda-mps-control stands in for NVIDIA's (its `-f` daemon records its environment and waits for
a `quit` sent through its pipe directory, as the real one's control program sends it), so the tests
see what `pdserve up` starts, with which environment, and that the daemon is stopped on every exit
path: a normal stop, Ctrl-C, a server that crashes at start or later, an error at start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.router import gpu_sharing
from pdserve.router import up as up_module
from pdserve.router.gpu_sharing import (
    DEFAULT_SM_SHARES,
    GpuSharing,
    MPSDaemon,
    MPSUnavailable,
    SMShares,
    parse_sm_shares,
    shared_gpus,
)
from pdserve.router.layout import (
    ONE_GPU_DEFAULT,
    PAIRS_MAX_WEIGHTS_SHARE,
    PAIRS_WHY,
    SPLIT_WHY,
    Layout,
    checkpoint_bytes,
    choose_layout,
    without_mps,
)
from pdserve.router.placement import plan_placement

# A stand-in for nvidia-cuda-mps-control. `-f`: the daemon (BEHAVIOUR: ok, fail, mute, deaf);
# no argument: the control program, which passes a "quit" on standard input to the daemon.
FAKE_CONTROL = r"""#!{python}
import json, os, sys, time
pipe, log = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), os.environ.get("CUDA_MPS_LOG_DIRECTORY", "")
behaviour = "{behaviour}"
if sys.argv[1:] == ["-f"]:
    if behaviour == "fail":
        open(os.path.join(log, "control.log"), "w").write("[fake] cannot find a GPU\n")
        sys.exit(3)
    with open(os.path.join(log, "record.json"), "w") as f:
        json.dump({{"pid": os.getpid(), "env": {{k: v for k, v in os.environ.items() if k.startswith("CUDA")}}}}, f)
    if behaviour != "mute":
        open(os.path.join(pipe, "control"), "w").close()
    while not os.path.exists(os.path.join(pipe, "quit")) or behaviour == "deaf":
        time.sleep(0.02)
    open(os.path.join(log, "quit-received"), "w").close()
else:
    if sys.stdin.read().strip() == "quit":
        open(os.path.join(pipe, "quit"), "w").close()
"""


def fake_control(tmp_path: Path, behaviour: str = "ok") -> str:
    path = tmp_path / f"fake-mps-{behaviour}" / "nvidia-cuda-mps-control"
    path.parent.mkdir(exist_ok=True)
    path.write_text(FAKE_CONTROL.format(python=PYTHON, behaviour=behaviour))
    path.chmod(0o755)
    return str(path)


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "mps-log" / "record.json").read_text())


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # (a zombie until its parent reaps it: wait() in stop() does)
    return Path(f"/proc/{pid}/status").exists() and "zombie" in Path(f"/proc/{pid}/status").read_text()


ONE_GPU_PAIR = plan_placement([0], 1, 1, 1, 1)
PYTHON = sys.executable  # (the fixture below swaps sys.executable for a fake router)


# ---- flags and plans ----------------------------------------------------------------------------


def test_sm_shares_parse_and_refuse_what_is_not_a_percentage():
    assert parse_sm_shares("100:100") == SMShares(100, 100) and parse_sm_shares("50:100") == DEFAULT_SM_SHARES
    assert parse_sm_shares("60:100") == SMShares(prefill=60, decode=100)
    assert str(SMShares(60, 100)) == "60:100" and SMShares(60, 90).of("decode") == 90
    for bad in ("60", "60:100:1", "0:100", "60:101", "a:b", "-5:100", ""):
        with pytest.raises(ValueError, match="--sm-shares"):
            parse_sm_shares(bad)


def test_shared_gpus_are_those_holding_two_servers():
    assert shared_gpus(ONE_GPU_PAIR) == {0}
    assert shared_gpus(plan_placement([0, 1], 1, 1, 1, 1)) == set()
    assert shared_gpus(plan_placement([0, 1], 1, 1, 1, 2)) == {0}  # D TP2 on 0,1 and P on 0
    assert shared_gpus(plan_placement([], 1, 1, 1, 1)) == set()  # CPU


def test_the_layout_from_the_flags_and_the_one_gpu_default():
    assert choose_layout(0, None, None) == Layout(1, "always", "the default: one prefill server")
    assert choose_layout(2, None, "auto")[:2] == (1, "auto")
    # the two-GPU study's winner: the one-GPU pair on each GPU
    small = 0.02  # the weights' share of a GPU
    assert choose_layout(2, None, None, weights_share=small) == Layout(2, "always", PAIRS_WHY.format(n=2), num_decode=2)
    four = choose_layout(4, None, None, weights_share=small)
    assert (four.num_prefill, four.disagg_policy, four.num_decode) == (4, "always", 4)
    assert choose_layout(2, None, None, 3, weights_share=small) == Layout(1, "always", SPLIT_WHY, num_decode=3)
    assert choose_layout(2, None, None, tp=2, weights_share=small) == Layout(1, "always", SPLIT_WHY)  # TP: both GPUs
    assert choose_layout(2, 1, None) == Layout(1, "always", "as asked", asked=True)
    assert choose_layout(2, 0, None, num_decode=2) == Layout(0, "never", "as asked", asked=True, num_decode=2)
    one_gpu = choose_layout(1, None, None)
    assert (one_gpu.disagg_policy, one_gpu.num_prefill) == ONE_GPU_DEFAULT == ("always", 1) and not one_gpu.asked
    assert choose_layout(1, 1, None) == Layout(1, "always", "as asked", asked=True)
    assert choose_layout(1, 0, None)[:2] == (0, "never")  # --num-prefill 0 alone: decode servers prefill
    assert choose_layout(4, None, "never")[:2] == (0, "never")
    with pytest.raises(ValueError, match="--num-prefill 0 needs --disagg-policy never"):
        choose_layout(1, 0, "always")
    with pytest.raises(ValueError, match="--num-prefill must be >= 0"):
        choose_layout(1, -1, None)


def test_without_mps_a_default_pair_turns_colocated_the_pairs_split_and_an_asked_one_stays():
    default_pair = Layout(1, "auto", "the default: one prefill server")
    fallback = without_mps(default_pair, "no control program")
    assert fallback[:2] == (0, "never") and "no control program" in fallback.why
    asked = Layout(1, "always", "as asked", asked=True)
    assert without_mps(asked, "no control program") is asked
    colocated = Layout(0, "never", "x")
    assert without_mps(colocated, "why") is colocated
    # the pairs on several GPUs: a prefill server on one GPU, a decode server on each other one
    for gpus in (2, 3):
        split = without_mps(choose_layout(gpus, None, None, weights_share=0.02), "no control program", gpus)
        assert (split.num_prefill, split.disagg_policy, split.num_decode) == (1, "always", gpus - 1)
        assert "no control program" in split.why


# ---- the daemon ---------------------------------------------------------------------------------


def test_the_daemon_is_private_and_each_server_on_the_shared_gpu_gets_its_pipe_and_share(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "5")  # the launcher's own: no server inherits it
    plan = plan_placement([0, 1], 1, 1, 2, 1)  # D0 on 0, D1 on 1, P on 0
    sharing = GpuSharing.start(plan, str(tmp_path), "auto", SMShares(60, 100), control=fake_control(tmp_path))
    try:
        assert sharing.shared == {0} and sharing.daemon is not None and not sharing.unavailable
        daemon_env = record(tmp_path)["env"]
        assert daemon_env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps-pipe")
        assert daemon_env["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "mps-log")
        assert daemon_env["CUDA_MPS_ENABLE_PER_CTX_DEVICE_MULTIPROCESSOR_PARTITIONING"] == "1"
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in daemon_env
        assert oct((tmp_path / "mps-pipe").stat().st_mode & 0o777) == "0o700"
        visible = ["GPU-aaaa", "GPU-bbbb"]  # the launcher's CUDA_VISIBLE_DEVICES, as names
        env = {s.role + str(s.index): sharing.server_env(s, visible) for s in plan}
        # On the shared GPU: the daemon's numbering (it sees what the launcher sees, from 0).
        assert env["decode0"]["CUDA_VISIBLE_DEVICES"] == "0" and env["prefill0"]["CUDA_VISIBLE_DEVICES"] == "0"
        for name in ("decode0", "prefill0"):
            assert env[name]["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps-pipe")
            assert env[name]["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "mps-log")
        assert env["prefill0"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "60"
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env["decode0"]  # 100%: no cap
        # A server with its GPU to itself: its GPU by name, and no MPS at all.
        assert env["decode1"]["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb"
        assert not any(k.startswith("CUDA_MPS_PIPE") for k in env["decode1"])
        assert "MPS on GPU 0" in sharing.describe() and "prefill 60%, decode 100%" in sharing.describe()
        pid = record(tmp_path)["pid"]
    finally:
        sharing.stop()
    assert (tmp_path / "mps-log" / "quit-received").exists() and gone(pid)


def test_no_daemon_when_no_gpu_is_shared_or_mps_is_off(tmp_path):
    control = fake_control(tmp_path)
    apart = GpuSharing.start(plan_placement([0, 1], 1, 1, 1, 1), str(tmp_path), "on", control=control)
    assert apart.daemon is None and "none" in apart.describe()
    off = GpuSharing.start(ONE_GPU_PAIR, str(tmp_path), "off", control=control)
    assert off.daemon is None and "time-sliced (--mps off)" in off.describe()
    assert not (tmp_path / "mps-log" / "record.json").exists()
    with pytest.raises(ValueError, match="--mps"):
        GpuSharing.start(ONE_GPU_PAIR, str(tmp_path), "maybe", control=control)


def test_a_daemon_that_cannot_start_is_a_warning_under_auto_and_an_error_under_on(tmp_path):
    control = fake_control(tmp_path, "fail")
    sharing = GpuSharing.start(ONE_GPU_PAIR, str(tmp_path), "auto", control=control)
    assert sharing.daemon is None and "exited with code 3" in sharing.unavailable
    assert "cannot find a GPU" in sharing.unavailable  # the daemon's own log, quoted
    assert "time-sliced" in sharing.describe() and "5.4x" in sharing.describe()  # and what it costs
    assert sharing.server_env(ONE_GPU_PAIR[0], ["0"])["CUDA_VISIBLE_DEVICES"] == "0"
    with pytest.raises(MPSUnavailable, match="exited with code 3"):
        GpuSharing.start(ONE_GPU_PAIR, str(tmp_path), "on", control=control)
    missing = (
        GpuSharing.start(ONE_GPU_PAIR, str(tmp_path), "auto", control=None)
        if not gpu_sharing.shutil.which(gpu_sharing.CONTROL)
        else None
    )
    if missing is not None:
        assert "not on PATH" in missing.unavailable


def test_a_daemon_that_never_answers_is_stopped_and_reported(tmp_path):
    with pytest.raises(MPSUnavailable, match="no control pipe"):
        MPSDaemon.start(str(tmp_path), fake_control(tmp_path, "mute"), timeout_s=0.5)
    pid = record(tmp_path)["pid"]
    assert gone(pid)


def test_a_daemon_deaf_to_quit_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_sharing, "QUIT_TIMEOUT_S", 0.3)
    daemon = MPSDaemon.start(str(tmp_path), fake_control(tmp_path, "deaf"))
    pid = record(tmp_path)["pid"]
    daemon.stop()
    assert daemon.process.returncode == -signal.SIGKILL and gone(pid)


# ---- pdserve up's exit paths --------------------------------------------------------------------


@pytest.fixture
def one_gpu_up(tmp_path, monkeypatch):
    """`pdserve up --num-prefill 1` on one (pretended) GPU, with the fake daemon and a router that is
    a sleeping process; `start_servers` is the test's. Returns (call up, what start_servers saw)."""
    control = fake_control(tmp_path)
    monkeypatch.setattr(gpu_sharing.shutil, "which", lambda name: control if name == gpu_sharing.CONTROL else None)
    monkeypatch.setattr(up_module.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    router = tmp_path / "fake-python"
    router.write_text("#!/bin/sh\nexec sleep 60\n")
    router.chmod(0o755)
    monkeypatch.setattr(up_module.sys, "executable", str(router))
    before = signal.getsignal(signal.SIGTERM)  # (up() takes SIGTERM over, and ignores it once stopping)
    seen: dict = {}

    def call(start_servers, num_prefill=1, num_decode=1, gpus=("0",), **kw):
        def spy(plan, command, env_of, procs, run_dir, ports=None):
            seen["daemon"] = record(Path(run_dir))["pid"] if (Path(run_dir) / "mps-pipe").exists() else None
            seen["env"] = {s.role: env_of(s) for s in plan}
            seen["command"] = {s.role: command(s, 1234) for s in plan}
            seen["placed"] = [(s.role, s.index, env_of(s)["CUDA_VISIBLE_DEVICES"]) for s in plan]
            seen["router"] = procs[0]
            return start_servers(procs)

        monkeypatch.setattr(up_module, "visible_gpu_names", lambda: list(gpus))
        monkeypatch.setattr(up_module, "start_servers", spy)
        return up_module.up(str(tmp_path), num_prefill, num_decode, "cuda", 0, "127.0.0.1", **kw)

    yield call, seen, tmp_path / "run"
    signal.signal(signal.SIGTERM, before)


def test_up_runs_both_servers_under_the_daemon_and_stops_it_on_ctrl_c(one_gpu_up):
    call, seen, run_dir = one_gpu_up

    def ctrl_c(procs):
        raise KeyboardInterrupt

    assert call(ctrl_c, sm_shares="70:100") == 0
    for role in ("prefill", "decode"):
        assert seen["env"][role]["CUDA_MPS_PIPE_DIRECTORY"] == str(run_dir / "mps-pipe")
        assert seen["env"][role]["CUDA_VISIBLE_DEVICES"] == "0"
    assert seen["env"]["prefill"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in seen["env"]["decode"]
    assert seen["command"]["decode"][seen["command"]["decode"].index("--mem-fraction-static") + 1] == "0.425"
    assert seen["router"].poll() is not None  # the router was stopped too
    assert gone(seen["daemon"]) and not run_dir.exists()


def test_up_on_two_gpus_runs_a_pair_on_each_and_splits_them_without_mps(one_gpu_up, monkeypatch):
    call, seen, run_dir = one_gpu_up

    def ctrl_c(procs):
        raise KeyboardInterrupt

    monkeypatch.setattr(up_module, "driver_device_memory", lambda: [80 << 30, 80 << 30])
    assert call(ctrl_c, num_prefill=None, num_decode=None, gpus=("0", "1")) == 0
    assert sorted(seen["placed"]) == [("decode", 0, "0"), ("decode", 1, "1"), ("prefill", 0, "0"), ("prefill", 1, "1")]
    assert seen["env"]["prefill"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    run_dir.mkdir()
    monkeypatch.setattr(gpu_sharing.shutil, "which", lambda name: None)  # no MPS control program
    assert call(ctrl_c, num_prefill=None, num_decode=None, gpus=("0", "1"), mps="auto") == 0
    assert sorted(seen["placed"]) == [("decode", 0, "0"), ("prefill", 0, "1")]
    assert seen["daemon"] is None


def test_the_pairs_need_weights_that_leave_half_a_gpu_room(tmp_path):
    """A pair's servers each hold the weights in half a GPU: past PAIRS_MAX_WEIGHTS_SHARE of the
    smallest GPU, or with its memory unknown, two GPUs keep the split pair."""
    split = choose_layout(2, None, None, weights_share=PAIRS_MAX_WEIGHTS_SHARE + 0.01)
    assert (split.num_prefill, split.num_decode) == (1, 1) and "the weights take 14%" in split.why
    assert (choose_layout(2, None, None, weights_share=None).num_prefill, "unknown") == (1, "unknown")
    assert "memory is unknown" in choose_layout(2, None, None, weights_share=None).why
    assert choose_layout(2, None, None, weights_share=PAIRS_MAX_WEIGHTS_SHARE).num_prefill == 2
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model-2.safetensors").write_bytes(b"x" * 24)
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_bytes(str(tmp_path)) == 1024
    gguf = tmp_path / "q4" / "model.Q4_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"x" * 900)
    assert checkpoint_bytes(str(gguf)) == checkpoint_bytes(str(gguf.parent)) == 3200  # dequantized at load


def test_the_weights_share_is_over_the_smallest_placed_gpu(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    monkeypatch.setattr(up_module, "driver_device_memory", lambda: [8000, 4000, 2000])
    assert up_module.weights_share(str(tmp_path), [0, 1]) == 1000 / 4000
    assert up_module.weights_share(str(tmp_path), [0, 3]) is None  # (a GPU the driver does not list)
    monkeypatch.setattr(up_module, "driver_device_memory", lambda: None)
    assert up_module.weights_share(str(tmp_path), [0, 1]) is None


def test_up_stops_the_daemon_when_a_server_crashes_at_start(one_gpu_up):
    call, seen, run_dir = one_gpu_up

    def crashing(procs):
        procs.append(subprocess.Popen([PYTHON, "-c", "import sys; sys.exit(3)"]))
        procs[-1].wait()
        return {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]}

    with pytest.raises(RuntimeError, match="exited with code 3"):
        call(crashing)  # _wait_ready sees the server gone
    assert gone(seen["daemon"]) and not run_dir.exists()


def test_up_stops_everything_when_a_server_crashes_while_serving(one_gpu_up, monkeypatch):
    call, seen, run_dir = one_gpu_up
    monkeypatch.setattr(up_module, "_wait_ready", lambda url, procs: None)

    def serving_then_crashing(procs):
        procs.append(subprocess.Popen([PYTHON, "-c", "import sys, time; time.sleep(0.5); sys.exit(3)"]))
        return {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]}

    started = time.monotonic()
    assert call(serving_then_crashing) == 0
    assert time.monotonic() - started < 30  # not the router's 60 s grace: it stops on SIGTERM
    assert seen["router"].poll() is not None and gone(seen["daemon"]) and not run_dir.exists()


def test_up_with_mps_on_and_no_mps_is_an_error_that_starts_nothing(one_gpu_up, monkeypatch, tmp_path):
    call, seen, run_dir = one_gpu_up
    failing = fake_control(tmp_path, "fail")
    monkeypatch.setattr(gpu_sharing.shutil, "which", lambda name: failing)
    with pytest.raises(MPSUnavailable):
        call(lambda procs: pytest.fail("no server may start"), mps="on")
    assert seen == {} and not run_dir.exists()


def test_pdserve_up_rejects_bad_shares_before_starting_anything(capsys):
    from pdserve.common.cli import main

    assert main(["up", "--device", "cpu", "--sm-shares", "0:100"]) == 2
    assert "--sm-shares" in capsys.readouterr().err


def test_servers_sharing_a_gpu_start_together_and_take_it_in_turn(tmp_path, monkeypatch):
    """start_servers launches every server at once; each on a shared GPU gets --gpu-after naming the
    report of the sharer before it (so their KV caches are sized one after another), others none."""
    launched: list[list[str]] = []
    real_popen = subprocess.Popen
    monkeypatch.setattr(up_module, "wait_serving", lambda address, procs: None)
    monkeypatch.setattr(
        up_module.subprocess, "Popen", lambda argv, env, **kw: launched.append(argv) or real_popen(["true"])
    )
    cases = (
        (plan_placement([0, 1], 1, 1, 1, 1), [None, None]),  # a GPU each: no waiting
        (plan_placement([0], 1, 1, 2, 1), [None, "decode-0", "decode-1"]),  # three on one GPU: a chain
        (plan_placement([0, 1, 2], 1, 1, 2, 1), [None, None, None]),
        (plan_placement([0, 1], 1, 1, 2, 2), [None, "decode-0", "decode-1"]),
    )  # TP 2 sharers and P on 0
    for plan, expected in cases:
        launched.clear()
        procs: list = []
        addresses = up_module.start_servers(
            plan, lambda server, port: [server.role], lambda s: {}, procs, str(tmp_path)
        )
        after = [argv[argv.index("--gpu-after") + 1] if "--gpu-after" in argv else None for argv in launched]
        assert [Path(a).name.split(".")[0] if a else None for a in after] == expected, plan
        reports = [argv[argv.index("--startup-report") + 1] for argv in launched]
        assert len(set(reports)) == len(plan) and all(r.startswith(str(tmp_path)) for r in reports)
        assert sum(len(v) for v in addresses.values()) == len(plan)
        for p in procs:
            p.wait()


def test_the_daemon_dies_with_a_launcher_that_is_killed(tmp_path):
    """`pdserve up` SIGKILLed has no finally to run: the kernel ends its daemon (PR_SET_PDEATHSIG)."""
    control = fake_control(tmp_path)
    launcher = subprocess.Popen(
        [
            PYTHON,
            "-c",
            f"""
import sys, time
from pdserve.router.gpu_sharing import MPSDaemon
daemon = MPSDaemon.start({str(tmp_path)!r}, {control!r})
print(daemon.process.pid, flush=True)
time.sleep(60)
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid = int(launcher.stdout.readline())
        assert not gone(pid)
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid)
