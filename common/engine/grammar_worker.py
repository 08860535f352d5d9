"""The grammar worker: a process that holds a server's xgrammar matchers, advances them by the
sampled tokens and fills the next batch's token bitmasks into shared memory.

    worker = GrammarWorker(threads)              # spawns it
    worker.describe(tokenizer_info_json, vocab_size, pinned)   # the tokenizer it compiles for
    worker.add_grammar(key, (kind, spec))        # compiled there, off its step path
    step = worker.step(new, free, accepts, fills, rows)                     # returns at once
    mask, refused = step.result()   # a [rows, words] int32 view of shared memory, or None

Why a process (docs/architecture.md, "Structured outputs"): every xgrammar call releases the GIL
and must take it back to return; beside the event loop's thread, which holds the GIL while it
runs Python (processing a batch, scheduling, building the next), a worker thread waited for it and
slowed the loop in turn. In its own process the matchers have their own interpreter.

The messages are JSON over a local socket pair (multiprocessing's Connection framing, never
pickle); a step's reply names the tokens a matcher refused. Masks go through BUFFERS slots of one
shared-memory block (on CUDA registered as page-locked, so the device copies it as it is); the
parent hands a slot out again only after the copy that read it has run (GrammarWorker.fence).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

import torch

# The grammar worker's threads that accept a batch's tokens and fill its masks (at most the cores
# this process may use, less two), from PARALLEL_ROWS grammar rows on. Each takes every k-th row
# (the costly states spread out) through its own one-thread BatchGrammarMatcher (xgrammar's own
# max_threads > 1 was slower than one thread): two xgrammar calls a step. Four (Llama-1B shape,
# batch 128 on an H200, docs/benchmarks/README.md, measured with the threads in the server's process: the
# bounded-strings schema 2.5-2.8x the plain step with four, 2.9-3.4x with two, 4.3x with one).
FILL_THREADS = 4
PARALLEL_ROWS = 16

logger = logging.getLogger(__name__)


def fill_threads() -> int:
    """FILL_THREADS, or fewer on a machine without as many cores to spare."""
    return max(1, min(FILL_THREADS, len(os.sched_getaffinity(0)) - 2))  # leave the loop and the frontend theirs


BUFFERS = 3  # mask slots: one filling, one being copied, one spare
START_ROWS = 256
REPLY_TIMEOUT_S = 120.0  # a step is milliseconds; the first one waits for the worker to start


class GrammarWorker:
    """The parent's side: starts the worker process and speaks to it (the event loop's thread)."""

    def __init__(self, threads: int, forked: tuple | None = None):
        """Spawn the worker (it imports torch and xgrammar meanwhile: seconds), or adopt the one
        forked at the process's start (`forked`: common/engine/grammar_prefork.py's take()); `describe`
        follows.

        NOTE the worker is killed when the *thread* that spawned it exits (it dies with its parent:
        Linux's PR_SET_PDEATHSIG follows the spawning thread, not the process): spawn it on one that
        lives as long as the engine, never on a helper thread (common/engine/grammar_startup.py)."""
        self.threads = threads
        if forked is not None:
            self.process, self.conn = forked
        else:
            ours, theirs = socket.socketpair()
            args = {"parent": os.getpid(), "fd": theirs.fileno(), "threads": threads}
            cmd = [sys.executable, "-m", __name__, json.dumps(args)]
            self.process = subprocess.Popen(cmd, pass_fds=[theirs.fileno()])
            theirs.close()
            self.conn = Connection(ours.detach())
        self.tokenizer_file = ""
        self.words = 0
        self.pinned = False
        self._fence = None
        self.shm: SharedMemory | None = None
        self.masks: torch.Tensor | None = None
        self.address = 0
        self.capacity = 0
        self.slot = 0
        self.fences: list = [None] * BUFFERS
        self.in_flight: WorkerStep | None = None

    def describe(self, tokenizer_info: str, vocab_size: int, pinned: bool, fence=None) -> None:
        """The first message: the tokenizer (xgrammar's TokenizerInfo as JSON) the worker compiles for,
        the masks' width, and whether they are pinned (CUDA); `fence`: () -> an event recorded after
        every copy queued so far (None: CPU)."""
        self.words = (vocab_size + 31) // 32
        self.pinned, self._fence = pinned, fence
        # The description (MBs) goes through a file: through the socket, this call would wait until
        # the worker had started (seconds: it imports torch and xgrammar).
        with tempfile.NamedTemporaryFile("w", prefix="pdserve-grammar-", suffix=".json", delete=False) as f:
            f.write(tokenizer_info)
        self.tokenizer_file = f.name  # (the worker deletes it once read)
        self._send({"op": "tokenizer", "path": f.name})

    def add_grammar(self, key: int, grammar: tuple[str, str]) -> None:
        self._send({"op": "grammar", "key": key, "kind": grammar[0], "spec": grammar[1]})

    def forget_grammar(self, key: int) -> None:
        self._send({"op": "forget", "key": key})

    def step(self, new: list, free: list[int], accepts: list, fills: list, rows: int) -> "WorkerStep":
        """Have the worker create the matchers `new` ([id, grammar key]), drop `free`, accept
        `accepts` ([id, token], in order) and fill rows `fills` ([id, row]) of a [rows, words]
        mask (the others allow everything). One step at a time: the previous one's mask has been
        taken (and its copy queued) before this is called."""
        if self.in_flight is not None:
            self.in_flight.result()  # (normally taken already)
        if self._fence is not None and self.shm is not None:
            self.fences[self.slot] = self._fence()  # the last slot's copy is queued by now
        self.slot = (self.slot + 1) % BUFFERS
        if fills:
            self._ensure(rows)
            if self.fences[self.slot] is not None:
                self.fences[self.slot].synchronize()  # its copy ran BUFFERS - 1 steps ago: at once
        self._send(
            {
                "op": "step",
                "new": new,
                "free": free,
                "accepts": accepts,
                "fills": fills,
                "rows": rows,
                "slot": self.slot,
            }
        )
        self.in_flight = WorkerStep(self, self.slot if fills else None, rows)
        return self.in_flight

    def _ensure(self, rows: int) -> None:
        """A shared block with room for `rows` rows in each slot (grown, never shrunk)."""
        if rows <= self.capacity:
            return
        for fence in self.fences:
            if fence is not None:
                fence.synchronize()
        self.fences = [None] * BUFFERS
        old, old_address = self.shm, self.address
        self.capacity = max(rows, 2 * self.capacity, START_ROWS)
        size = BUFFERS * self.capacity * self.words * 4
        self.shm = SharedMemory(create=True, size=size)
        self.masks = torch.frombuffer(self.shm.buf, dtype=torch.int32).view(BUFFERS, self.capacity, self.words)
        self.address = self.masks.data_ptr()
        if self.pinned:
            _register(self.masks)
        self._send({"op": "buffers", "name": self.shm.name, "rows": self.capacity})
        if old is not None:
            self._release(old, old_address)

    def _release(self, shm: SharedMemory, address: int) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(address)
        shm.unlink()
        try:
            shm.close()
        except BufferError:  # a view of it is still alive somewhere: unmapped when that one goes
            pass

    def _send(self, message: dict) -> None:
        self.check_alive()
        try:
            self.conn.send_bytes(json.dumps(message).encode())
        except OSError as e:  # (it died since: a broken pipe)
            self.check_alive()
            raise RuntimeError(f"the grammar worker's socket failed: {e}") from e

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"the grammar worker process exited (code {self.process.returncode})")

    def close(self) -> None:
        self.conn.close()
        if self.tokenizer_file:
            try:
                os.unlink(self.tokenizer_file)  # (a worker that died before reading it)
            except FileNotFoundError:
                pass
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.shm is not None:
            self.masks = None
            self._release(self.shm, self.address)
            self.shm = None


class WorkerStep:
    """A step sent to the worker; `result()` waits for its reply."""

    def __init__(self, worker: GrammarWorker, slot: int | None, rows: int):
        self.worker, self.slot, self.rows = worker, slot, rows
        self.reply: tuple | None = None

    def result(self) -> tuple[torch.Tensor | None, list]:
        """(the mask [rows, words] int32, a view of shared memory, or None when nothing was
        filled; [[id, token or -1, reason]...] the worker refused)."""
        if self.reply is None:
            worker = self.worker
            if not worker.conn.poll(REPLY_TIMEOUT_S):
                worker.check_alive()
                raise RuntimeError(f"the grammar worker did not answer within {REPLY_TIMEOUT_S:.0f} s")
            try:
                answer = json.loads(worker.conn.recv_bytes())
            except EOFError:
                worker.check_alive()
                raise RuntimeError("the grammar worker closed its socket") from None
            if "error" in answer:
                raise RuntimeError(f"the grammar worker failed: {answer['error']}")
            mask = worker.masks[self.slot, : self.rows] if self.slot is not None else None
            self.reply = (mask, answer["refused"])
            worker.in_flight = None
        return self.reply


def _register(masks: torch.Tensor) -> None:
    """Page-lock the block for the device's DMA (cudaHostRegister), so copies from it are async."""
    error = torch.cuda.cudart().cudaHostRegister(masks.data_ptr(), masks.numel() * 4, 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of the grammar masks failed: {error}")


# ---- the worker process ----------------------------------------------------------------------


def attach(name: str) -> mmap.mmap:
    """The parent's shared block `name`, mapped. NOTE not through SharedMemory: attaching registers the
    block with this process's resource tracker (bpo-38119), which would unlink it when this process
    exits, and a forked worker shares its parent's tracker, where unregistering it again would drop
    the parent's own registration. The parent owns the block (Linux: POSIX shared memory is /dev/shm)."""
    fd = os.open(os.path.join("/dev/shm", name.lstrip("/")), os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def main(args: dict) -> None:
    from pdserve.common.lifetime import die_with_parent, name_process

    die_with_parent(args["parent"])
    name_process(b"pdserve-grammar")  # what `ps` and `top` show (a forked worker shows its parent's command)
    forked = args.get("forked", False)  # (its parent's logging configured already: replaced)
    form = "%(asctime)s %(levelname)s grammar worker: %(message)s"
    logging.basicConfig(level=logging.INFO, format=form, force=forked)
    torch.set_num_threads(1)
    conn = Connection(args["fd"])
    from pdserve.common.torch_free import transformers_without_torch

    transformers_without_torch(tokenizers=False)  # xgrammar imports transformers: not its model stack
    import xgrammar as xgr
    from xgrammar.matcher import _core

    from pdserve.common.engine.grammar_source import grammar_source

    try:
        tokenizer = json.loads(conn.recv_bytes())  # (GrammarWorker.describe: always the first message)
    except EOFError:
        return
    with open(tokenizer["path"]) as f:
        info = xgr.TokenizerInfo.deserialize_json(f.read())
    os.unlink(tokenizer["path"])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    compile_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
    threads = max(1, args["threads"])
    shares = ThreadPoolExecutor(threads - 1) if threads > 1 else None
    batches = [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(threads)]
    # xgrammar's own batch_accept_token converts its result with two FFI calls per row: the core
    # function, and one test of the result.
    accept_batch = _core.BatchGrammarMatcher.batch_accept_token
    compiled: dict[int, object] = {}  # key -> Future of the CompiledGrammar
    matchers: dict[int, object] = {}  # id -> GrammarMatcher, or the reason it could not be made
    block, masks = None, None

    def compile_one(kind: str, spec: str):
        return compiler.compile_grammar(grammar_source(xgr, kind, spec))

    def work(batch, accepts: list, fills: list, mask, refused: list) -> None:
        """One share: its tokens accepted, then its rows filled."""
        if accepts:
            handles = [matchers[i]._handle for i, _ in accepts]
            accepted = accept_batch(handles, [t for _, t in accepts], False)
            if 0 in accepted:  # (ints: `False in` finds none)
                for (i, token), ok in zip(accepts, list(accepted)):
                    if not ok:
                        refused.append([i, token, ""])
        if fills:
            batch.batch_fill_next_token_bitmask([matchers[i] for i, _ in fills], mask, [row for _, row in fills])

    while True:
        try:
            message = json.loads(conn.recv_bytes())
        except EOFError:
            return
        op = message["op"]
        if op == "grammar":
            compiled[message["key"]] = compile_pool.submit(compile_one, message["kind"], message["spec"])
            continue
        if op == "forget":
            compiled.pop(message["key"], None)  # (its matchers keep what they use)
            continue
        if op == "buffers":
            if block is not None:
                masks = None
                try:
                    block.close()
                except BufferError:
                    pass
            block = attach(message["name"])
            masks = torch.frombuffer(block, dtype=torch.int32).view(BUFFERS, message["rows"], -1)
            continue
        try:
            refused: list = []
            for i, key in message["new"]:
                try:
                    matchers[i] = xgr.GrammarMatcher(compiled[key].result())
                except Exception as e:  # (the parent compiled it too: only if this one ran out of something)
                    matchers[i] = f"the grammar could not be compiled in the grammar worker: {e}"
            # A matcher that could not be made refuses everything it is given. An id the parent
            # dropped in this same message (a request gone since: `free`) may still have a
            # token queued: it is skipped, and the matchers are dropped at the end.
            accepts = [a for a in message["accepts"] if not isinstance(matchers.get(a[0], ""), str)]
            fills = [f for f in message["fills"] if not isinstance(matchers.get(f[0], ""), str)]
            for i in {a[0] for a in message["accepts"]} | {f[0] for f in message["fills"]}:
                if isinstance(matchers.get(i), str):
                    refused.append([i, -1, matchers[i]])
            mask = None
            if message["fills"]:
                mask = masks[message["slot"], : message["rows"]]
                if len(fills) < message["rows"]:
                    mask.fill_(-1)  # xgrammar writes whole rows: only the others need it
            k = threads if len(fills) >= PARALLEL_ROWS else 1
            if k == 1:
                work(batches[0], accepts, fills, mask, refused)
            else:
                share_of = {i: j % k for j, (i, _) in enumerate(fills)}
                parts = [([], fills[j::k]) for j in range(k)]
                for j, accept in enumerate(accepts):
                    # NOTE one matcher's tokens (a replay: several) stay in one share, in order.
                    parts[share_of.setdefault(accept[0], j % k)][0].append(accept)
                futures = [shares.submit(work, batches[j], *parts[j], mask, refused) for j in range(1, k)]
                work(batches[0], *parts[0], mask, refused)
                for future in futures:
                    future.result()
            for i in message["free"]:
                matchers.pop(i, None)
            mask = None
            conn.send_bytes(json.dumps({"refused": refused}).encode())
        except Exception as e:  # a bug: the parent fails loudly with it
            logger.exception("a step failed")
            conn.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
