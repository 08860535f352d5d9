"""Where `pdserve up` and the bench's local stack put their servers (router/placement.py): the plan,
exactly, for the layouts that matter (one GPU, one each, TP sharing, four GPUs, the CPU) and its bad
inputs; then `pdserve up` with a TP 2 decode server on CPU, through the official openai client."""

import json
import os
import signal
import subprocess
import sys
import time
from itertools import product

import openai
import pytest

from pdserve.common.ports import free_port
from pdserve.router.placement import (
    ServerPlacement,
    describe,
    parse_gpus,
    plan_placement,
    rank_threads,
    resolve_gpus,
    server_env,
    usable_cores,
)

# ---- the plan -----------------------------------------------------------------------------------


def test_one_gpu_holds_every_server_in_cumulative_shares():
    assert plan_placement([0], 1, 1, 1, 1) == [("decode", 0, (0,), 0.425), ("prefill", 0, (0,), 0.85)]
    assert plan_placement([0], 2, 1, 1, 1, fraction=0.6) == [
        ("decode", 0, (0,), 0.2),
        ("prefill", 0, (0,), 0.4),
        ("prefill", 1, (0,), 0.6),
    ]


def test_two_gpus_one_server_each():
    assert plan_placement([0, 1], 1, 1, 1, 1) == [("decode", 0, (0,), 0.85), ("prefill", 0, (1,), 0.85)]


def test_a_tp2_decode_and_a_tp1_prefill_on_two_gpus_share_one():
    """Three ranks on two GPUs: D TP2 on GPUs 0, 1 and P on GPU 0 again (the issue's P TP1 (GPU 0) ->
    D TP2 (GPUs 0, 1)). GPU 0 holds two servers, so the decode server, bounded by its rank there,
    takes half of the fraction and the prefill server, started after it, the rest."""
    assert plan_placement([0, 1], 1, 1, 1, 2) == [("decode", 0, (0, 1), 0.425), ("prefill", 0, (0,), 0.85)]
    assert plan_placement([0, 1], 1, 2, 1, 1) == [("decode", 0, (0,), 0.425), ("prefill", 0, (0, 1), 0.85)]


def test_four_gpus_two_of_each():
    assert plan_placement([0, 1, 2, 3], 2, 1, 2, 1) == [
        ("decode", 0, (0,), 0.85),
        ("decode", 1, (1,), 0.85),
        ("prefill", 0, (2,), 0.85),
        ("prefill", 1, (3,), 0.85),
    ]
    assert plan_placement([0, 1, 2, 3], 1, 2, 1, 2) == [("decode", 0, (0, 1), 0.85), ("prefill", 0, (2, 3), 0.85)]


def test_the_gpus_given_in_their_order():
    """--gpus 3,1: the first server gets GPU 3, and a TP server's rank 0 is on its first GPU in --gpus order."""
    assert plan_placement([3, 1], 1, 1, 1, 1) == [("decode", 0, (3,), 0.85), ("prefill", 0, (1,), 0.85)]
    assert plan_placement([3, 1, 2], 1, 1, 1, 2) == [("decode", 0, (3, 1), 0.85), ("prefill", 0, (2,), 0.85)]
    # The second decode server wraps round to GPUs 2 and 3: rank 0 on 3, as --gpus lists them.
    assert plan_placement([3, 1, 2], 1, 1, 2, 2)[1] == ("decode", 1, (3, 2), 0.85)


def test_wrapping_tp_servers_share_by_their_most_crowded_gpu():
    # D0 on 0,1; D1 wraps onto 2,0; P on 1: every GPU holds two servers.
    assert plan_placement([0, 1, 2], 1, 1, 2, 2) == [
        ("decode", 0, (0, 1), 0.425),
        ("decode", 1, (0, 2), 0.85),
        ("prefill", 0, (1,), 0.85),
    ]


def test_on_cpu_every_server_is_on_the_cpu():
    assert plan_placement([], 2, 1, 1, 2) == [("decode", 0, (), 0.0), ("prefill", 0, (), 0.0), ("prefill", 1, (), 0.0)]


LAYOUTS = list(product((1, 2, 3), (1, 2), (1, 2, 3), (1, 2)))  # (num_prefill, prefill_tp, num_decode, decode_tp)


@pytest.mark.parametrize("gpus, counts", [(g, c) for g in (1, 2, 3, 4) for c in LAYOUTS])
def test_every_plan_keeps_its_promises(gpus, counts):
    """Any layout: each server gets TP-size different GPUs; GPUs get their own servers while they
    last and otherwise the servers spread evenly; no GPU is asked for more than the fraction in all."""
    num_prefill, prefill_tp, num_decode, decode_tp = counts
    if max(prefill_tp, decode_tp) > gpus:
        with pytest.raises(ValueError, match="needs"):
            plan_placement(list(range(gpus)), *counts)
        return
    plan = plan_placement(list(range(gpus)), *counts)
    assert [(s.role, s.index) for s in plan] == [("decode", i) for i in range(num_decode)] + [
        ("prefill", i) for i in range(num_prefill)
    ]
    tp = {"prefill": prefill_tp, "decode": decode_tp}
    servers_on = {g: 0 for g in range(gpus)}
    for server in plan:
        assert len(set(server.gpus)) == len(server.gpus) == tp[server.role]
        for g in server.gpus:
            servers_on[g] += 1
    ranks = num_prefill * prefill_tp + num_decode * decode_tp
    if ranks <= gpus:
        assert max(servers_on.values()) == 1 and {s.mem_fraction for s in plan} == {0.85}
    assert max(servers_on.values()) - min(servers_on.values()) <= 1
    # What a server takes of each of its GPUs is what it asks for less what the earlier servers on
    # that GPU took (its ranks agree on the smallest pool): nothing may go negative or past 0.85.
    taken = {g: 0.0 for g in range(gpus)}
    for server in plan:
        share = server.mem_fraction - max(taken[g] for g in server.gpus)
        assert share > 0
        for g in server.gpus:
            taken[g] += share
    assert max(taken.values()) <= 0.85 + 1e-3


def test_bad_plans_are_clear_errors():
    with pytest.raises(ValueError, match=r"--decode-tp 4 needs 4 GPUs \(one per rank\); --gpus gives 2: 0,1"):
        plan_placement([0, 1], 1, 1, 1, 4)
    with pytest.raises(ValueError, match="--prefill-tp 2 needs 2 GPUs"):
        plan_placement([0], 1, 2, 1, 1)
    with pytest.raises(ValueError, match="--num-decode must be >= 1, got 0"):
        plan_placement([0], 1, 1, 0, 1)
    with pytest.raises(ValueError, match="--prefill-tp must be >= 1, got 0"):
        plan_placement([], 1, 0, 1, 1)
    with pytest.raises(ValueError, match="names a GPU twice: 0,1,0"):
        plan_placement([0, 1, 0], 1, 1, 1, 1)


# ---- flags and environment ----------------------------------------------------------------------


def test_gpus_flag():
    assert parse_gpus("0,1", 2) == [0, 1]
    assert parse_gpus(" 1 ", 2) == [1]
    with pytest.raises(ValueError, match=r"GPU 2 is not visible; this process sees 2 GPUs \(0-1\)"):
        parse_gpus("0,2", 2)
    for bad in ("", "0,,1", "a", "-1", "0;1"):
        with pytest.raises(ValueError, match="GPU numbers separated by commas"):
            parse_gpus(bad, 4)


def test_device_and_gpus_resolve_together():
    assert resolve_gpus("cpu", None, ["0", "1"]) == ("cpu", [])
    assert resolve_gpus("auto", None, []) == ("cpu", [])
    assert resolve_gpus("auto", None, ["3", "5"]) == ("cuda", [0, 1])
    assert resolve_gpus("cuda", "1", ["3", "5"]) == ("cuda", [1])
    with pytest.raises(ValueError, match="--device cpu runs them on the CPU"):
        resolve_gpus("cpu", "0", ["0"])
    with pytest.raises(ValueError, match="no GPU is visible"):
        resolve_gpus("cuda", None, [])
    with pytest.raises(ValueError, match="pick the GPUs with --gpus"):
        resolve_gpus("cuda:1", None, ["0", "1"])
    with pytest.raises(ValueError, match="not visible"):
        resolve_gpus("auto", "0", [])


def test_each_server_sees_only_its_gpus(monkeypatch):
    """GPU numbers index what this process sees: with CUDA_VISIBLE_DEVICES=3,5 (say, a batch job's
    allocation), GPU 1 is the machine's 5."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    from pdserve.router.placement import visible_gpu_names

    visible = visible_gpu_names()
    assert visible == ["3", "5"]
    assert server_env(ServerPlacement("decode", 0, (1,), 0.85), visible)["CUDA_VISIBLE_DEVICES"] == "5"
    assert server_env(ServerPlacement("decode", 0, (0, 1), 0.85), visible)["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert server_env(ServerPlacement("decode", 0, (), 0.0), visible)["CUDA_VISIBLE_DEVICES"] == "3,5"  # CPU: as it was
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpu_names() == []


def test_cpu_ranks_split_the_cores():
    assert rank_threads(3, 2) == 1  # P TP1 + D TP2 on 2 cores: never 0
    assert rank_threads(2, 16) == 8
    assert rank_threads(5, 16) == 3


def test_the_plan_as_printed():
    tp_of = {"prefill": 1, "decode": 2}
    assert describe(plan_placement([0, 1], 1, 1, 1, 2), tp_of, ["0", "1"]) == [
        "  decode 0: tp 2, GPUs 0,1, --mem-fraction-static 0.425",
        "  prefill 0: tp 1, GPU 0, --mem-fraction-static 0.85",
    ]
    assert describe(plan_placement([1], 1, 1, 1, 1), {"prefill": 1, "decode": 1}, ["3", "5"])[0] == (
        "  decode 0: tp 1, GPU 1 (CUDA_VISIBLE_DEVICES=5), --mem-fraction-static 0.425"
    )
    assert describe(plan_placement([], 1, 1, 1, 2), tp_of, []) == ["  decode 0: tp 2, CPU", "  prefill 0: tp 1, CPU"]


# ---- pdserve up with a TP 2 decode server, on CPU -----------------------------------------------


def _children() -> dict[int, list[int]]:
    """pid -> its child pids, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def _descendants(pid: int) -> list[int]:
    children, found, todo = _children(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode().split("\0")
    except OSError:
        return []


def test_pdserve_up_serves_through_a_tp2_decode_server_on_cpu(tiny_models):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.common.cli",
            "up",
            "--model-path",
            tiny_models("llama"),
            "--device",
            "cpu",
            "--num-prefill",
            "1",
            "--num-decode",
            "1",
            "--decode-tp",
            "2",
            "--port",
            str(port),
            "--router-workers",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "pdserve up exited:\n" + "".join(lines)
            lines.append(line)
            if "pdserve is up" in line:
                break
        else:
            raise TimeoutError("pdserve up not ready:\n" + "".join(lines))
        assert lines[:3] == ["placement (CPU):\n", "  decode 0: tp 2, CPU\n", "  prefill 0: tp 1, CPU\n"], lines

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=30)
        answer = client.chat.completions.create(
            model=tiny_models("llama"), max_tokens=6, temperature=0, messages=[{"role": "user", "content": "Hello!"}]
        )
        assert answer.usage.completion_tokens > 0 and answer.choices[0].message.content

        # The decode server really runs two ranks, each with its share of the cores (3 local ranks).
        processes = _descendants(proc.pid)
        [decode] = [p for p in processes if "pdserve.decode.cli" in _cmdline(p)]
        argv = _cmdline(decode)
        assert argv[argv.index("--tp-size") + 1] == "2"
        threads = rank_threads(3, usable_cores())
        assert argv[argv.index("--torch-threads") + 1] == str(threads)
        [rank1] = [p for p in _descendants(decode) if "pdserve.common.engine.tp_worker" in _cmdline(p)]
        assert json.loads(_cmdline(rank1)[3])["threads"] == threads
        [prefill] = [p for p in processes if "pdserve.prefill.cli" in _cmdline(p)]
        assert "--torch-threads" not in _cmdline(prefill)  # TP 1 keeps torch's default

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        # A rank notices its parent is gone within a second (tp_worker.PARENT_POLL_MS); on a loaded
        # 2-core CI box the rest of the tree can take a few seconds more to be reaped.
        deadline = time.monotonic() + 10
        while (
            left := [p for p in processes if os.path.exists(f"/proc/{p}") and _cmdline(p)]
        ) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], [_cmdline(p)[:4] for p in left]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_pdserve_up_refuses_a_bad_placement_before_starting_anything(capsys):
    from pdserve.common.cli import main

    assert main(["up", "--device", "cpu", "--gpus", "0"]) == 2
    assert "error: --gpus places servers on GPUs; --device cpu runs them on the CPU" in capsys.readouterr().err
    assert main(["up", "--device", "cpu", "--num-decode", "0"]) == 2
    assert "error: --num-decode must be >= 1, got 0" in capsys.readouterr().err
    assert main(["up", "--device", "cuda:1"]) == 2
    assert "pick the GPUs with --gpus" in capsys.readouterr().err


def test_pdserve_up_says_in_one_line_which_process_failed_to_start(tmp_path):
    """A server that exits at start (here: no checkpoint) ends `pdserve up` with exit 1 and an
    "error:" line naming it, after that process's own error: no traceback of pdserve up's."""
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.common.cli", "up", "--model-path", str(tmp_path), "--device", "cpu"]
        + ["--router-workers", "1", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "has no config.json" in proc.stderr  # the server's own words
    assert "before it was ready" in proc.stderr.splitlines()[-1] and proc.stderr.splitlines()[-1].startswith("error: ")
    assert "Traceback" not in proc.stderr


def test_gpus_are_counted_by_the_driver_without_torch(monkeypatch):
    """With no CUDA_VISIBLE_DEVICES, `pdserve up` and a server's frontend count GPUs through the
    driver library (cuInit + cuDeviceGetCount), not by importing torch (3-6 s on a GPU host); torch
    counts only where the driver cannot answer."""
    import ctypes

    from pdserve.common import gpus as config

    class Driver:
        def __init__(self, init_status, count):
            self.init_status, self.count = init_status, count

        def cuInit(self, flags):
            return self.init_status

        def cuDeviceGetCount(self, out):
            out._obj.value = self.count
            return 0

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    driver = Driver(0, 3)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver if name == "libcuda.so.1" else None)
    monkeypatch.setitem(sys.modules, "torch", None)  # an import of torch would fail
    assert config.cuda_device_count() == 3
    from pdserve.router.placement import visible_gpu_names

    assert visible_gpu_names() == ["0", "1", "2"]
    driver.init_status = config.CUDA_ERROR_NO_DEVICE  # a driver but no GPU
    assert config.cuda_device_count() == 0
    driver.init_status = 999  # a driver that cannot start: torch is asked
    with pytest.raises(ImportError):
        config.cuda_device_count()

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert config.driver_device_count() is None
    monkeypatch.setattr(config, "ROCM_DEVICE", "/nonexistent/kfd")
    assert config.cuda_device_count() == 0  # no driver at all: no torch asked (it would fail here)
    monkeypatch.setattr(config, "ROCM_DEVICE", "/")  # (a path that exists): a ROCm machine asks torch
    with pytest.raises(ImportError):
        config.cuda_device_count()


def test_the_kv_path_of_each_pair_follows_the_placement_and_the_flag():
    from pdserve.router.placement import describe_kv_paths, kv_transfer_path

    assert kv_transfer_path(["--dtype", "bfloat16"]) == "auto"
    assert kv_transfer_path(["--kv-transfer-path", "nixl", "--kv-transfer-path=direct"]) == "direct"
    two = plan_placement([0, 1], 1, 1, 1, 1)  # decode on GPU 0, prefill on GPU 1
    assert describe_kv_paths(two, "auto") == [
        "  KV prefill 0 -> decode 0: device copy through CUDA IPC, one kernel a request (GPU to GPU, peer "
        "access); NIXL where the pool cannot be mapped"
    ]
    assert describe_kv_paths(two, "nixl") == ["  KV prefill 0 -> decode 0: NIXL (UCX, VRAM; --kv-transfer-path nixl)"]
    one = plan_placement([0], 1, 1, 1, 1)
    assert "on the GPU they share" in describe_kv_paths(one, "direct")[0]
    assert describe_kv_paths(plan_placement([], 1, 1, 2, 1), "auto") == [
        "  KV prefill 0 -> decode 0: NIXL (UCX, DRAM)",
        "  KV prefill 0 -> decode 1: NIXL (UCX, DRAM)",
    ]
    assert describe_kv_paths(plan_placement([0, 1], 0, 1, 2, 1), "auto") == []  # no prefill server


def test_pdserve_up_passes_the_common_server_flags_it_was_given_and_no_others():
    """`pdserve up --speculative ngram --max-running-requests 64 ...` reaches both servers as their own
    flags (beside --server-args, which comes last); flags not given are not passed, so the servers'
    defaults hold."""
    from pdserve.common.cli import build_parser
    from pdserve.router.up_cli import passthrough_of

    argv = ["up", "--tiny-model", "--speculative", "ngram", "--max-running-requests", "64"]
    args = build_parser().parse_args([*argv, "--kv-cache-dtype", "fp8_e4m3", "--server-args", "--page-size 8"])
    _, passed = passthrough_of(args)
    servers = list(passed.servers)
    for flag, value in (("--speculative", "ngram"), ("--max-running-requests", "64"), ("--kv-cache-dtype", "fp8_e4m3")):
        assert servers[servers.index(flag) + 1] == value
    assert servers[-2:] == ["--page-size", "8"] and "--speculative" not in passed.router
    _, plain = passthrough_of(build_parser().parse_args(["up", "--tiny-model"]))
    assert not {"--speculative", "--max-running-requests", "--quantization", "--chunked-prefill-size"} & set(
        plain.servers
    )


@pytest.mark.parametrize("server_args", ["--speculative ngram", "--page-size 8 --max-running-requests=32"])
def test_pdserve_up_refuses_a_server_flag_given_both_ways(server_args):
    """`--speculative ngram --server-args '--speculative draft'` would leave which one wins to argparse's
    order: an error names the flag instead."""
    from pdserve.common.cli import build_parser
    from pdserve.router.up_cli import passthrough_of

    argv = ["up", "--tiny-model", "--speculative", "ngram", "--max-running-requests", "64"]
    argv += ["--server-args", server_args]
    twice = "--speculative" if "speculative" in server_args else "--max-running-requests"
    with pytest.raises(ValueError, match=f"{twice} given both as pdserve up's own flag and in --server-args"):
        passthrough_of(build_parser().parse_args(argv))
    passthrough_of(build_parser().parse_args(["up", "--tiny-model", "--server-args", server_args]))  # one way: fine
