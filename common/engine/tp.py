"""Tensor parallelism: the ranks of one engine and the collectives its sharded layers call.

    TPGroup.single(device)      tp = 1: every collective is the identity, no torch.distributed
    TPGroup.join(rank, ...)     rank r of N: a gloo (CPU) or NCCL (CUDA) group, met through a
                                TCPStore that rank 0 serves on a free local port

No default process group is created (torch.distributed's is process-global state): the backend
object lives in the TPGroup, and whatever needs it (the model's layers, the runner) is handed the
group. Rank r runs on `rank_device(device, r)`: cuda:r after --device's index, or the CPU.

NOTE every collective waits at most --dist-timeout for the other ranks; a rank that dies is
noticed sooner (gloo: the peer's socket closes; NCCL: the watchdog aborts the communicator).
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist


def rank_device(device: str, rank: int) -> torch.device:
    """The device of TP rank `rank`: the CPU, or the rank-th GPU from --device's index."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    return torch.device("cuda", (d.index or 0) + rank)


@dataclass
class TPGroup:
    rank: int
    size: int
    device: torch.device
    backend: object | None = None  # ProcessGroupGloo / ProcessGroupNCCL; None when size == 1
    store: object | None = None  # kept alive with the group
    symmetric: object | None = None  # a SymmetricAllReduce (tp_symmetric.py), --tp-all-reduce symm

    @classmethod
    def single(cls, device: torch.device) -> "TPGroup":
        return cls(0, 1, device)

    @classmethod
    def join(
        cls,
        rank: int,
        size: int,
        device: torch.device,
        store_port: int,
        timeout_s: float,
        store=None,
        host: str = "127.0.0.1",
    ) -> "TPGroup":
        """Meet the other ranks. Rank 0 passes the TCPStore it serves (made before the other ranks
        were started, so its port is bound); the others connect to `host:store_port`."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, store_port, size, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore("tp", store)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            backend = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            backend = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        return cls(rank, size, device, backend, store)

    @staticmethod
    def serve_store(size: int, port: int, timeout_s: float, host: str = "127.0.0.1"):
        """Rank 0's TCPStore, listening before the other ranks start."""
        timeout = datetime.timedelta(seconds=timeout_s)
        return dist.TCPStore(host, port, size, is_master=True, timeout=timeout, wait_for_workers=False)

    def shutdown(self) -> None:
        """End this rank's communicator. NCCL: every rank must call it, while every rank is alive
        (ncclCommDestroy synchronises the ranks of a node; one rank alone hangs, and so does the
        ProcessGroupNCCL destructor that runs when a group was never shut down). Gloo: nothing to
        do. The group is unusable after."""
        if self.backend is not None and self.device.type == "cuda":
            self.backend.shutdown()

    def abort(self, wait_s: float) -> None:
        """Rank 0 whose peer died: abort its NCCL communicator (which ends kernels still waiting on
        the peer), waiting at most `wait_s`. Gloo: nothing to do.

        NOTE ProcessGroupNCCL.abort can outlast any timeout given to it (two H200s, a SIGKILLed peer:
        it logged "Future for ProcessGroup abort timed out after 2000 ms" and had not returned 4 s
        later, the server still SERVING: its ncclCommAbort runs under a std::async future, which
        waits for it in its destructor). So it runs on a daemon thread (its binding releases the
        GIL) and nobody waits past `wait_s`; the process that calls this is going down anyway."""
        if self.backend is None or self.device.type != "cuda":
            return
        backend = self.backend

        def abort() -> None:
            try:
                backend._set_default_timeout(datetime.timedelta(seconds=wait_s))
                backend.abort()
            except (AttributeError, RuntimeError):
                pass

        thread = threading.Thread(target=abort, name="nccl-abort", daemon=True)
        thread.start()
        thread.join(wait_s)

    # ---- collectives (identity when size == 1) ---------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (x must be contiguous); returns x. On CUDA it is queued on the
        current stream (and captured into a CUDA graph being recorded there)."""
        if self.backend is not None:
            if self.symmetric is not None and self.symmetric.takes(x):
                return self.symmetric.all_reduce(x)
            self.backend.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank 0's columns first."""
        if self.backend is None:
            return x
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # ranks' tensors one after another
        self.backend._allgather_base(out, x).wait()
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Every rank's x becomes rank `src`'s, in place (x must be contiguous); returns x."""
        if self.backend is not None:
            options = dist.BroadcastOptions()
            options.rootRank = src
            self.backend.broadcast([x], options).wait()
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise largest of every rank's x, in place (x must be contiguous); returns x.
        Start-up only (scales every rank must share: FP8 weight rows split over ranks, FP8 KV)."""
        if self.backend is not None:
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.MAX
            self.backend.allreduce([x], options).wait()
        return x

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (start-up agreement, e.g. on the KV pool's size)."""
        if self.backend is None:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.backend.allreduce([t], options).wait()
        return int(t.item())
