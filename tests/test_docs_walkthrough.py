"""A new user's walk-through: every command in the README's and docs/getting-started.md's code blocks
runs as written (paths under /tmp and the ports aside), is parsed as written by the command's own
argument parser (the benchmarks: they run for minutes on a GPU), or is named below with the test
that runs it. A command added to those blocks that is in none of the three fails here.

The README's Python snippets and getting-started's curl line run against `pdserve up` in
tests/test_real_model_stack.py (they need the real model's stack)."""

import contextlib
import io
import json
import os
import pathlib
import re
import runpy
import shlex
import subprocess
import sys
import time

import pytest

from pdserve.common.ports import free_port

ROOT = pathlib.Path(__file__).parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]
VENV_BIN = pathlib.Path(sys.executable).parent

# Commands run elsewhere, and where.
ELSEWHERE = {
    "make up": "tests/test_real_model_stack.py starts `pdserve up` with its defaults, as `make up` does",
    "make test": "CI runs it (.ci/run)",
    "curl http://127.0.0.1:8000/v1/chat/completions": "tests/test_real_model_stack.py, against `pdserve up`",
}


def code_blocks(lang: str) -> list[tuple[str, str]]:
    """(page name, block) for each fenced block of `lang` on the walk-through's pages."""
    return [(page.name, body) for page in PAGES for body in re.findall(rf"```{lang}\n(.*?)```", page.read_text(), re.S)]


def shell_commands() -> list[str]:
    """Each command of the bash blocks: comments dropped, continued lines joined."""
    commands = []
    for _, block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def elsewhere(command: str) -> bool:
    return any(command.startswith(prefix) for prefix in ELSEWHERE)


def as_written(command: str, tmp: pathlib.Path) -> list[str]:
    """argv as the page has it, with /tmp and out.jsonl under the test's own directory."""
    command = command.replace("/tmp/", f"{tmp}/").replace(" out.jsonl", f" {tmp}/out.jsonl")
    argv = shlex.split(command)
    if argv[0].startswith(".venv/bin/"):
        argv[0] = str(VENV_BIN / argv[0].removeprefix(".venv/bin/"))
    return argv


def alternatives(command: str) -> list[str]:
    """`cmd [--a | --b]` as `cmd`, `cmd --a` and `cmd --b`: each a command the parser must accept."""
    match = re.search(r"\[([^\]]*\|[^\]]*)\]", command)
    if match is None:
        return [command]
    head, tail = command[: match.start()].rstrip(), command[match.end() :]
    return [head + tail] + [f"{head} {choice.strip()}{tail}" for choice in match.group(1).split("|")]


class Parsed(Exception):
    pass


@contextlib.contextmanager
def stop_after_parsing():
    """argparse's outermost parse_known_args raises Parsed when it returns (nested sub-command parses
    run inside it), with the arguments no parser knew; a refused argument exits 2 as usual."""
    import argparse

    original, depth = argparse.ArgumentParser.parse_known_args, [0]

    def parse_known_args(self, *args, **kwargs):
        depth[0] += 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            raise Parsed(result)
        return result

    argparse.ArgumentParser.parse_known_args = parse_known_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original


def parse_only(argv: list[str]) -> None:
    """Run the command's entry point in this process until its arguments are parsed."""
    if argv[:2] == ["python", "-m"]:
        run = lambda: runpy.run_module(argv[2], run_name="__main__")  # noqa: E731
        sys_argv = [argv[2], *argv[3:]]
    else:
        assert argv[0] == "pdserve", argv
        from pdserve.common.cli import main

        run, sys_argv = main, argv
    saved = sys.argv
    sys.argv = sys_argv
    try:
        with stop_after_parsing(), contextlib.redirect_stderr(io.StringIO()) as err:
            run()
    except Parsed as parsed:
        _, unknown = parsed.args[0]
        if unknown:
            pytest.fail(f"`{' '.join(argv)}` refused: no parser knows {unknown}")
        return
    except SystemExit as e:
        pytest.fail(f"`{' '.join(argv)}` refused (exit {e.code}): {err.getvalue()[-500:]}")
    finally:
        sys.argv = saved
    pytest.fail(f"`{' '.join(argv)}` never parsed its arguments")


def test_every_command_is_run_parsed_or_named():
    commands = shell_commands()
    assert len(commands) >= 15, commands  # the blocks were found
    ran = [c for c in commands if c.startswith((".venv/bin/",))]
    parsed = [c for c in commands if c.startswith(("pdserve ", "python -m pdserve."))]
    named = [c for c in commands if elsewhere(c)]
    assert sorted(ran + parsed + named) == sorted(commands), set(commands) - set(ran + parsed + named)
    assert len(named) == len(ELSEWHERE), "a command named here is no longer on the pages"


@pytest.mark.parametrize(
    "command", [a for c in shell_commands() if c.startswith(("pdserve ", "python -m ")) for a in alternatives(c)]
)
def test_the_benchmark_commands_parse_as_written(command, tmp_path):
    parse_only(as_written(command, tmp_path))


def test_a_parser_refusal_is_caught(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="refused"):
        parse_only(as_written("pdserve bench offline --random-weights gpt2/small --no-such-flag", tmp_path))


def wait_serving(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, "not serving"
            time.sleep(0.2)


def test_the_getting_started_commands_run_as_written(tmp_path):
    """The tiny model, the batch file through it, the Python API on it, and the two servers on it:
    each as the page writes it."""
    commands = [as_written(c, tmp_path) for c in shell_commands() if c.startswith(".venv/bin/")]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    batch = [argv for argv in commands if argv[1] in ("make-tiny-model", "run-batch")]
    assert len(batch) == 2
    for argv in batch:
        subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    status = {a["custom_id"]: a["response"]["status_code"] for a in answers}
    sent = [json.loads(line)["custom_id"] for line in (ROOT / "docs" / "example-batch.jsonl").read_text().splitlines()]
    assert list(status) == sent  # an answer per line, in order; the file's one bad line gets its 400
    assert status == {custom_id: 400 if custom_id == "bad-line" else 200 for custom_id in sent}

    [(_, api)] = [b for b in code_blocks("python") if "from pdserve" in b[1]]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(api.replace("/tmp/", f"{tmp_path}/"), "getting-started.md", "exec"), {})
    assert out.getvalue().strip()

    servers = [argv for argv in commands if argv[0].endswith("-server")]
    assert len(servers) == 2
    procs = []
    try:
        for argv in servers:
            ports = {flag: str(free_port()) for flag in ("--port", "--metrics-port")}
            argv = [ports.get(argv[i - 1], a) if i else a for i, a in enumerate(argv)]
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append((proc, int(ports["--port"])))
        for proc, port in procs:
            wait_serving(port, proc)
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            assert proc.wait(60) == 0, proc.stdout.read()
