"""The servers' own flags: generated from ServerConfig, checked before anything starts, and how
servers sharing a CPU host split its cores."""

import os
import subprocess
import sys

import pytest

from pdserve.common.server_config import ServerConfig


def test_bad_server_flags_are_refused_before_start(tiny_models):
    for flags, message in (
        (["--torch-threads", "-1"], "--torch-threads must be >= 0"),
        (["--drain-timeout", "0"], "--drain-timeout must be > 0"),
        (["--startup-timeout", "-5"], "--startup-timeout must be > 0"),
    ):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve.decode.cli",
                "--model-path",
                tiny_models("llama"),
                "--device",
                "cpu",
                "--port",
                "1",
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and message in out.stderr, out.stderr


def test_a_cpu_server_spawns_its_scheduler_with_passive_openmp_waits(tiny_models, monkeypatch):
    """A CPU server's scheduler process is spawned with OMP_WAIT_POLICY=PASSIVE in its environment
    (unless the user set one): the frontend sets it before the spawn, since OpenMP reads it once,
    when the scheduler loads torch."""
    import pdserve.common.serving.server_cli as server_cli

    seen = {}

    async def fake_serve(launcher, engine, server, agent_name):  # where the scheduler would be spawned
        seen.update(policy=os.environ.get("OMP_WAIT_POLICY"), threads=server.torch_threads, device=engine.device)

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(server_cli, "_serve", fake_serve)
    launcher = server_cli.RoleLauncher("decode", object, None, "x", None)
    argv = ["--model-path", tiny_models("llama"), "--device", "cpu", "--port", "5", "--torch-threads", "1"]
    assert server_cli.main(launcher, argv) == 0
    assert seen == {"policy": "PASSIVE", "threads": 1, "device": "cpu"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice stands
    assert server_cli.main(launcher, argv) == 0 and seen["policy"] == "ACTIVE"


def test_the_scheduler_process_takes_its_torch_thread_count(tmp_path):
    import torch

    from pdserve.common.serving.scheduler_process import run_scheduler

    before, seen = torch.get_num_threads(), []

    def make_engine(startup):
        seen.append(torch.get_num_threads())
        raise RuntimeError("stop here")

    try:
        with pytest.raises(RuntimeError, match="stop here"):
            run_scheduler(
                make_engine, ServerConfig(port=1, torch_threads=1), f"ipc://{tmp_path}/a", f"ipc://{tmp_path}/b"
            )
    finally:
        torch.set_num_threads(before)
    assert seen == [1]
    with pytest.raises(ValueError, match="--port"):
        ServerConfig(torch_threads=1).check()
