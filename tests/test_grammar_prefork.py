"""The grammar worker forked at a scheduler process's start (common/engine/grammar_prefork.py): it
fills the same masks as a spawned one, owns nothing of its parent's, and never outlives it. Each case
runs in a fresh interpreter (a process that forks must have no other Python thread: pytest's has)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

# A server's scheduler process in miniature: its imports, the fork, then the engine's start-up making
# the Grammars with that worker and a mask for a two-word choice.
PREFORK_THEN_MASK = """
import json, os, sys
from pdserve.common.torch_free import transformers_without_torch
transformers_without_torch()
import torch
from pdserve.common.engine import grammar_prefork
from pdserve.common.engine.grammar_worker import fill_threads, main

forked = grammar_prefork.prefork(main, fill_threads())
from pdserve.common.engine.engine import Engine
from pdserve.common.engine.grammar import allowed_tokens
from pdserve.common.engine.grammar_startup import GrammarsAtStart
from pdserve.common.openai.structured import choice_ebnf

engine = Engine(model_path=sys.argv[1], device="cpu", max_total_tokens=4096)
start = GrammarsAtStart(engine.config, engine.tokenizer, engine.eos_token_ids, None, warm=True)
assert start.wait()
grammars = start.get()

class Row:
    def __init__(self, grammar):
        self.grammar, self.output_ids, self.pending, self.discard, self.finished = grammar, [], 0, 0, False

mask = grammars.bitmask([Row(grammars.matcher(("ebnf", choice_ebnf(["ab", "cd"]))))], [True], launched=False).result()
worker = grammars._worker
print(json.dumps({
    "forked": forked,
    "kind": type(worker.process).__name__,
    "pid": worker.process.pid,
    "block": worker.shm.name,
    "allowed": [engine.tokenizer.decode([t]) for t in allowed_tokens(mask.numpy(), 0, engine.vocab_size)],
}), flush=True)
if sys.argv[2] == "close":
    worker.close()
    print(json.dumps({"code": worker.process.returncode}), flush=True)
else:
    sys.stdin.read()  # (held until killed)
"""


def run_script(script: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args], stdout=subprocess.PIPE, text=True, **kw
    )


def test_a_forked_worker_fills_the_masks_and_exits_with_its_engine(tiny_models):
    """Forked (not spawned: no second interpreter importing torch), named for `ps`, its masks right; closed,
    it exits 0 and the shared block its parent made is unlinked (a forked child shares the parent's
    resource tracker: attaching through SharedMemory and unregistering would have dropped the parent's
    registration, and a spawned one's tracker would have unlinked the block)."""
    proc = run_script(PREFORK_THEN_MASK, tiny_models("llama"), "close")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    made, closed = (json.loads(line) for line in out.strip().splitlines()[-2:])
    assert made["forked"] and made["kind"] == "ForkedProcess", made
    assert made["allowed"] and all("ab".startswith(a) or "cd".startswith(a) for a in made["allowed"]), made
    assert closed["code"] == 0
    assert not os.path.exists(os.path.join("/dev/shm", made["block"])), "the masks' shared block leaked"


def test_a_forked_worker_dies_with_its_parent(tiny_models):
    """A scheduler process SIGKILLed: its forked worker goes too (PR_SET_PDEATHSIG), at once."""
    proc = run_script(PREFORK_THEN_MASK, tiny_models("llama"), "hold", stdin=subprocess.PIPE)
    try:
        made = json.loads(proc.stdout.readline())
        worker = psutil.Process(made["pid"])
        assert worker.ppid() == proc.pid and worker.name() == "pdserve-grammar"
        assert worker.cmdline() == psutil.Process(proc.pid).cmdline(), "spawned, not forked"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, "the worker outlived its parent"
    finally:
        proc.kill()
        proc.wait()


def test_no_fork_beside_another_python_thread_and_a_closed_worker_exits():
    """With a Python thread running, prefork does nothing (the worker is spawned later, as before); a
    forked worker whose connection closes before it was told anything exits."""
    script = """
        import json, threading, time
        import torch
        from pdserve.common.engine import grammar_prefork
        from pdserve.common.engine.grammar_worker import main

        stop = threading.Event()
        thread = threading.Thread(target=stop.wait)
        thread.start()
        refused = not grammar_prefork.prefork(main, 1) and grammar_prefork.take() is None
        stop.set()
        thread.join()
        assert grammar_prefork.prefork(main, 1)
        process, conn = grammar_prefork.take()
        conn.close()
        process.wait(timeout=30)
        print(json.dumps({"refused": refused, "code": process.returncode}))
    """
    proc = run_script(script)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"refused": True, "code": 0}, result
