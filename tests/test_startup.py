"""A server's start-up phases (common/startup.py): timed as they end, appended to the report file at
once, read back by `pdserve up` to start the next server on a shared GPU (router/up.py)."""

import compileall
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from pdserve.common.startup import KV_POOL, READY, StartupClock, read_phases


def test_each_phase_is_timed_and_reported_as_it_ends(tmp_path):
    report = tmp_path / "decode-0.startup.jsonl"
    clock = StartupClock(str(report))
    assert read_phases(str(report)) == []  # nothing yet: no file
    time.sleep(0.05)
    clock.mark("weights")
    assert [p["phase"] for p in read_phases(str(report))] == ["weights"]
    clock.mark(KV_POOL)
    clock.mark("warmup")
    clock.mark("warmup")  # a phase marked twice adds up
    phases = read_phases(str(report))
    assert [p["phase"] for p in phases] == ["weights", KV_POOL, "warmup", "warmup"]
    assert phases[0]["seconds"] >= 0.05 and phases[-1]["at"] >= phases[0]["at"]
    assert list(clock.phases) == ["weights", KV_POOL, "warmup"]
    assert clock.summary().startswith("weights ") and clock.summary().endswith(f"total {clock.total:.1f} s")
    assert abs(sum(clock.phases.values()) - clock.total) < 1e-6  # (the first phase from the process's start)


def test_a_line_being_written_is_left_for_the_next_read(tmp_path):
    report = tmp_path / "r.jsonl"
    report.write_text(json.dumps({"phase": "weights", "seconds": 1, "at": 1}) + "\n" + '{"phase": "kv_')
    assert [p["phase"] for p in read_phases(str(report))] == ["weights"]


def test_no_report_file_without_a_path(tmp_path):
    clock = StartupClock()
    clock.mark("weights")
    assert clock.phases.keys() == {"weights"} and list(tmp_path.iterdir()) == []


def test_a_server_sharing_a_gpu_touches_it_after_the_one_before_has_its_kv_pool(tmp_path):
    earlier = tmp_path / "decode-0.startup.jsonl"
    clock = StartupClock(str(tmp_path / "prefill-0.startup.jsonl"), gpu_after=str(earlier), timeout_s=10)
    other = StartupClock(str(earlier))
    threading.Timer(0.3, lambda: (other.mark("weights"), other.mark(KV_POOL))).start()
    started = time.monotonic()
    clock.before_gpu()
    assert time.monotonic() - started >= 0.25 and "gpu_wait" in clock.phases
    past = tmp_path / "ready.jsonl"
    StartupClock(str(past)).mark(READY)  # (a server past the phase already counts)
    StartupClock(gpu_after=str(past)).before_gpu()
    StartupClock().before_gpu()  # nothing to wait for
    with pytest.raises(TimeoutError, match="allocated no KV pool"):
        StartupClock(gpu_after=str(tmp_path / "never.jsonl"), timeout_s=0.2).before_gpu()


def test_the_clock_begins_when_the_process_began():
    age = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(0.3); from pdserve.common.startup import "
            "StartupClock; clock = StartupClock(); clock.mark('imports'); print(clock.total, clock.phases['imports'])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    total, first = map(float, age.stdout.split())
    assert total >= 0.3
    assert first >= 0.3, "the first phase must count the time before the clock existed, as the total does"


def test_building_and_fusing_a_model_draws_no_weights_and_imports_no_compiler_stack(tmp_path):
    """Every model class is built on meta, loaded and fused (merged projections) without drawing random
    weights in real memory (a merged Linear made on the host drew kaiming_uniform_ in fp32 first: 5.8 s of
    Llama-1B's start-up on an H200 host) and without importing torch._dynamo, sympy or FSDP (their first
    import, through an nn.init on a meta tensor in GPT-2's position embedding, was 5 s there)."""
    script = (
        "import sys, torch\n"
        "drawn = []\n"
        "for name in ('kaiming_uniform_', 'uniform_', 'normal_', 'trunc_normal_', 'xavier_uniform_'):\n"
        "    def spy(*a, _init=getattr(torch.nn.init, name), _name=name, **k):\n"
        "        if (a[0] if a else k['tensor']).device.type != 'meta':\n"
        "            drawn.append(_name)\n"
        "        return _init(*a, **k)\n"
        "    setattr(torch.nn.init, name, spy)\n"
        "from pdserve.common.tiny_model import ARCHS, make_tiny_model\n"
        "from pdserve.common.engine.models.loader import load_model\n"
        "for arch in ARCHS:\n"
        f"    path = make_tiny_model({str(tmp_path)!r} + '/' + arch, arch, seed=0)\n"
        "    drawn.clear()\n"
        "    load_model(str(path), torch.float32, 'cpu').fuse()\n"
        "    stack = ('torch._dynamo', 'sympy', 'torch.distributed.fsdp')\n"
        "    print(arch, *drawn, *(m for m in stack if m in sys.modules))\n"
    )
    built = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert built.stdout.split("\n")[:-1] == ["llama", "qwen2", "qwen3", "mistral", "gpt2"], built.stdout


def test_pdserve_up_names_a_package_compiled_at_every_start(tmp_path):
    package = tmp_path / "slowpkg"
    package.mkdir()
    (package / "__init__.py").write_text("VALUE = 1\n")
    ask = "from pdserve.common.startup import uncached_bytecode_hint as h; print(h('slowpkg') or '-')"

    def hint(**env) -> str:
        environ = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | env
        environ["PYTHONPATH"] = os.pathsep.join([str(tmp_path), environ.get("PYTHONPATH", "")])
        return subprocess.run(
            [sys.executable, "-c", ask], capture_output=True, text=True, check=True, env=environ
        ).stdout.strip()

    said = hint(PYTHONDONTWRITEBYTECODE="1")
    assert said.startswith("note: slowpkg has no compiled bytecode") and f"compileall -q {package}" in said
    assert hint() == "-"  # Python will write it on the first import
    compileall.compile_dir(str(package), quiet=1)
    assert hint(PYTHONDONTWRITEBYTECODE="1") == "-"


def test_a_hung_start_ends_with_the_stuck_threads_stacks_and_a_clear_error(tiny_models, tmp_path):
    """A scheduler stuck in native code at start (here open() of a weights file that is a FIFO
    nobody writes: as a NIXL agent's or a CUDA call's start can hang) is asked for its threads'
    stacks when --startup-timeout runs out; the server then exits 1 with one line saying so, the
    stuck frame (the weights' loader) in its log."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_models("llama"), model)
    weights = model / "model.safetensors"
    weights.unlink()
    os.mkfifo(weights)
    argv = [sys.executable, "-m", "pdserve.decode.cli", "--model-path", str(model), "--device", "cpu", "--port",
            "1", "--startup-timeout", "4", "--disable-grammar-warmup"]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("Current thread"):  # the dump has begun: let a stuck open() return
                try:
                    os.close(os.open(weights, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:  # ENXIO: nobody has it open (the scheduler was not there yet)
                    pass
        assert proc.wait(timeout=60) == 1
    finally:
        proc.kill()
    log = "".join(lines)
    # The scheduler's main thread, wherever the timeout found it (the loader, or still importing torch
    # on a busy host): it had asked for the dump as its process started.
    assert "in run_scheduler" in log.split("Current thread", 1)[1], log
    assert lines[-1].startswith("error: the scheduler process (pid ") and lines[-1].rstrip().endswith(
        "was not ready within --startup-timeout 4 s; the stacks of its threads are above"
    ), log
    assert "Traceback" not in log.split("Current thread", 1)[0], log  # no traceback before the dump


def test_the_stack_dump_signal_leaves_the_process_running():
    code = (
        "import sys, time\n"
        "from pdserve.common.stacks import dump_on_signal\n"
        "dump_on_signal()\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "print('still here', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline() == "ready\n"
        from pdserve.common.stacks import ask_for_stacks

        assert ask_for_stacks(proc.pid)
        out, err = proc.communicate("\n", timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out == "still here\n"
    assert "Current thread" in err and "<string>" in err, err
