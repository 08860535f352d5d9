"""A bench's local stack stops with the bench when the bench is sent SIGTERM (`timeout`, a job runner)
or killed: no server is left holding the device for the next stack. Real processes: a bench script started in its
own process, its servers, the router."""

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pdserve.bench.stack import local_stack
    from pdserve.common.config import EngineConfig
    config = EngineConfig(model_path=sys.argv[1], device="cpu", max_total_tokens=4096, disable_overlap_schedule=True)
    with local_stack(config.resolve(), "cpu", 64, num_prefill=0, disagg_policy="never"):
        print("UP", flush=True)
        time.sleep(300)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_bench_stopped_or_killed_takes_its_local_stack_with_it(tiny_models, sig):
    """SIGTERM: the bench stops its stack on the way out; SIGKILL (no way out): the servers and the
    router each get SIGTERM when the bench dies (their parent-death signal)."""
    bench = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, tiny_models("llama")],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = [bench.stdout.readline() for _ in range(1)]
        while lines[-1] and lines[-1].strip() != "UP":  # (the stack prints its placement first)
            lines.append(bench.stdout.readline())
        assert lines[-1].strip() == "UP", f"the local stack did not start: {lines}"
        stack = psutil.Process(bench.pid).children(recursive=True)
        assert len(stack) >= 2  # a decode server (and its scheduler) and the router
        bench.send_signal(sig)
        assert bench.wait(timeout=90) != 0  # (interrupted: the stack was stopped on the way out)
        _, alive = psutil.wait_procs(stack, timeout=30)
        assert not alive, f"still running after the bench stopped: {[p.cmdline()[:3] for p in alive]}"
    finally:
        for p in psutil.Process(bench.pid).children(recursive=True) if bench.poll() is None else []:
            p.kill()
        bench.kill()
        bench.wait()
