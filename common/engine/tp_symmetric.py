"""The decode step's all-reduces by torch's symmetric-memory kernels (`--tp-all-reduce symm`).

A TP decode step all-reduces one [tokens, hidden] tensor twice a layer; at 64-128 tokens NCCL takes
15.6-20.8 us each on two H200s, torch's `symm_mem.two_shot_all_reduce_` 8.3-10.1 us (docs/benchmarks/
tensor-parallel.md, "Tensor parallelism on two GPUs"). Every rank allocates one symmetric buffer (its
peers map it over NVLink) sized for the largest CUDA-graph batch; an all-reduce that fits copies its
tensor in, reduces in place, and copies the sum back out. Larger ones (prefill) stay on NCCL.

    SymmetricAllReduce.setup(group, numel, dtype)   collective: every rank, same order, before any capture
    sym.takes(x) / sym.all_reduce(x)

NOTE the group is a bare ProcessGroupNCCL (tp.py: no default process group), which torch's symmetric
memory does not know by name: setup gives it the group's facts (set_group_info, where torch has it)
and registers a c10d ProcessGroup around the backend under a name of its own. Both are torch
internals: any failure on any rank (or a probe whose sum differs from NCCL's) leaves every rank on
NCCL, with a warning, never a wrong sum nor ranks on different paths.
"""

from __future__ import annotations

import logging
import uuid

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

NAME_KEY = "pdserve-symmetric-memory-group"
ALIGN = 16  # elements per rank an all-reduce's tensor must divide into (a conservative bound: every size run was)
_SET_UP = False  # this process has set symmetric memory up once (SymmetricAllReduce.setup)


class SymmetricAllReduce:
    def __init__(self, name: str, buffer: torch.Tensor, size: int):
        self.name, self.buffer, self.size = name, buffer, size

    @classmethod
    def setup(cls, group, numel: int, dtype: torch.dtype) -> "SymmetricAllReduce | None":
        """Every rank of `group` (a TPGroup on CUDA) calls this, in the same order; None (a warning
        logged) where it cannot be had. The ranks agree: all use it, or none does.

        NOTE once per process: on two H200s (torch 2.11) a second engine's rendezvous, in a process
        whose first engine (closed) had one, was still waiting some 20 s later (not placed). A process's
        second TP engine (tests, a bench) stays on NCCL, and rank 0 tells its ranks so."""
        global _SET_UP
        name = f"pdserve-tp-{uuid.uuid4().hex[:12]}" if not _SET_UP else ""
        if group.rank == 0:
            group.store.set(NAME_KEY, name)
        else:
            name = group.store.get(NAME_KEY).decode()
        if not name:
            log.warning("--tp-all-reduce symm: set up once per process, and this one has; NCCL instead")
            return None
        _SET_UP = True
        sym, failure = None, ""
        try:
            sym = cls._setup(group, name, numel, dtype)
        except Exception as e:  # noqa: BLE001 - torch internals: any failure means NCCL
            failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if not cls._all_agree(group, name, "set-up", sym is not None):
            failure = failure or "another rank could not set it up"
        elif not cls._all_agree(group, name, "probe", sym._probe(group)):
            failure = "a rank's probe sum differed from NCCL's"
        if failure:
            log.warning("--tp-all-reduce symm: symmetric memory not used (%s); NCCL instead", failure)
            return None
        return sym

    @staticmethod
    def _all_agree(group, name: str, step: str, ok: bool) -> bool:
        """Each rank says whether `step` went well; True only where every rank's did (a rank that
        never says fails the others' store.get after the store's timeout, --dist-timeout)."""
        group.store.set(f"{name}-{step}-{group.rank}", b"1" if ok else b"0")
        return all(group.store.get(f"{name}-{step}-{r}") == b"1" for r in range(group.size))

    @classmethod
    def _setup(cls, group, name: str, numel: int, dtype: torch.dtype) -> "SymmetricAllReduce":
        import torch.distributed._symmetric_memory as symm_mem

        if getattr(torch.ops.symm_mem, "two_shot_all_reduce_", None) is None:
            raise RuntimeError("this torch has no symm_mem.two_shot_all_reduce_")
        prefixed = dist.PrefixStore(f"symm-{name}", group.store)
        info = getattr(symm_mem._SymmetricMemory, "set_group_info", None)
        if info is not None:
            info(name, group.rank, group.size, prefixed)
        pg = dist.ProcessGroup(prefixed, group.rank, group.size)
        pg._register_backend(group.device, dist.ProcessGroup.BackendType.NCCL, group.backend)
        if hasattr(pg, "_set_default_backend"):
            pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        pg._set_group_name(name)
        torch._C._distributed_c10d._register_process_group(name, pg)
        group._symmetric_pg = pg  # kept alive with the group
        numel -= numel % (ALIGN * group.size)
        buffer = symm_mem.empty(numel, dtype=dtype, device=group.device)
        symm_mem.rendezvous(buffer, name)
        return cls(name, buffer, group.size)

    def _probe(self, group) -> bool:
        """Sum a short and a full-length tensor both ways (every rank): NCCL's and this one's equal."""
        equal = True
        for n in (ALIGN * self.size, self.buffer.numel()):
            x = (torch.arange(n, device=self.buffer.device) % 7 + group.rank + 1).to(self.buffer.dtype)
            want = x.clone()
            group.backend.allreduce([want]).wait()
            got = self.all_reduce(x.clone())
            torch.cuda.synchronize(self.buffer.device)
            equal = equal and torch.equal(got, want)
        return equal

    def takes(self, x: torch.Tensor) -> bool:
        n = x.numel()
        fits = n <= self.buffer.numel() and n % (ALIGN * self.size) == 0
        return fits and x.dtype == self.buffer.dtype and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        view = self.buffer[: x.numel()]
        view.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", self.name)
        x.copy_(view.view_as(x))
        return x
