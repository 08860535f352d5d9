"""Where a local deployment's servers run (`pdserve up`, the bench's local stack): which GPUs each
server sees, and how much of a shared GPU's memory it may take.

    plan_placement(gpus, P, ptp, D, dtp)   one ServerPlacement per server, in start order
    resolve_gpus(device, "--gpus" value)   the device kind and the GPUs the plan may use
    server_env(placement, visible)         the server's environment: CUDA_VISIBLE_DEVICES = its GPUs

GPUs are numbered as this process sees them (0 = the first of its CUDA_VISIBLE_DEVICES, when set),
and each server is launched with CUDA_VISIBLE_DEVICES set to its own GPUs: a TP server's rank r runs
on the r-th of them (common/engine/tp.py, rank_device), so every server asks for plain `cuda`.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Sequence

from pdserve.common.config import DEFAULT_MEM_FRACTION_STATIC
from pdserve.common.gpus import cuda_device_count

ROLES_IN_START_ORDER = ("decode", "prefill")


class ServerPlacement(NamedTuple):
    role: str  # "decode" or "prefill"
    index: int  # the server's number within its role
    gpus: tuple[int, ...]  # its GPUs, rank r on the r-th; () on CPU
    mem_fraction: float  # its --mem-fraction-static (cumulative, see plan_placement); 0.0 on CPU


def plan_placement(
    gpus: Sequence[int],
    num_prefill: int,
    prefill_tp: int,
    num_decode: int,
    decode_tp: int,
    fraction: float = DEFAULT_MEM_FRACTION_STATIC,
) -> list[ServerPlacement]:
    """Decode servers first, then prefill (the order they start in), each taking as many GPUs as its
    TP size from `gpus` in turn, wrapping round when the servers need more GPUs than there are (then
    some GPUs hold several servers). No `gpus`: the CPU, every server on it.

    Memory: --mem-fraction-static is measured device-wide (whatever is already in use counts against
    it) and servers sharing a GPU start one after another. A server's share of a GPU is `fraction`
    split evenly among the servers on the most crowded of its GPUs (its ranks agree on the smallest
    KV pool, so that GPU bounds it); it asks for the most its GPUs already hold plus its share. On
    one GPU that is server i of n asking for fraction × (i + 1) / n; with no sharing, `fraction`.
    Every share on a GPU is at most fraction / (the servers on it), so no GPU is asked for more.
    """
    for flag, value in (("--num-decode", num_decode), ("--prefill-tp", prefill_tp), ("--decode-tp", decode_tp)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if num_prefill < 0:  # (0: decode servers prefill every request, `pdserve up --disagg-policy never`)
        raise ValueError(f"--num-prefill must be >= 0, got {num_prefill}")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus names a GPU twice: {','.join(map(str, gpus))}")
    if not 0 < fraction < 1:
        raise ValueError(f"the memory fraction to split must be in (0, 1), got {fraction}")
    servers = [("decode", i, decode_tp) for i in range(num_decode)]
    servers += [("prefill", i, prefill_tp) for i in range(num_prefill)]
    if not gpus:
        return [ServerPlacement(role, index, (), 0.0) for role, index, _ in servers]
    for flag, tp in (("--decode-tp", decode_tp), ("--prefill-tp", prefill_tp)):
        # NOTE: two ranks of one server on one GPU would need CUDA_VISIBLE_DEVICES to name it twice.
        if tp > len(gpus):
            raise ValueError(
                f"{flag} {tp} needs {tp} GPUs (one per rank); --gpus gives {len(gpus)}: {','.join(map(str, gpus))}"
            )

    sets, turn = [], 0
    for _role, _index, tp in servers:
        taken = {gpus[(turn + r) % len(gpus)] for r in range(tp)}  # tp <= len(gpus): all different
        sets.append(tuple(g for g in gpus if g in taken))  # in --gpus order: rank 0 on the first
        turn += tp
    servers_on = {g: 0 for g in gpus}
    for gpu_set in sets:
        for g in gpu_set:
            servers_on[g] += 1

    plan, held = [], {g: 0.0 for g in gpus}  # the fractions of each GPU that earlier servers hold
    for (role, index, _tp), gpu_set in zip(servers, sets):
        share = fraction / max(servers_on[g] for g in gpu_set)
        asked = max(held[g] for g in gpu_set) + share
        for g in gpu_set:
            held[g] += share
        plan.append(ServerPlacement(role, index, gpu_set, round(asked, 4)))
    return plan


def parse_gpus(value: str, visible: int) -> list[int]:
    """`--gpus 0,1,...`: GPUs numbered as this process sees them (0..visible-1)."""
    gpus = []
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"--gpus takes GPU numbers separated by commas (e.g. 0,1), got {value!r}")
        if int(part) >= visible:
            raise ValueError(
                f"--gpus {value}: GPU {part} is not visible; this process sees {visible} "
                f"GPU{'s' if visible != 1 else ''}" + (f" (0-{visible - 1})" if visible else "")
            )
        gpus.append(int(part))
    return gpus


def visible_gpu_names() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (numbers or UUIDs)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [name.strip() for name in listed.split(",") if name.strip()]
    return [str(i) for i in range(cuda_device_count())]  # (no torch import: 3-6 s on a GPU host)


def resolve_gpus(device: str, gpus_flag: str | None, visible: list[str]) -> tuple[str, list[int]]:
    """(the servers' --device, the GPUs to place them on) from --device and --gpus (None: every
    visible GPU). `visible`: visible_gpu_names()."""
    if device.startswith("cuda:"):
        raise ValueError(f"--device {device}: pick the GPUs with --gpus (each server sees only its own)")
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"--device must be cpu, cuda or auto, got {device!r}")
    if device == "cpu":
        if gpus_flag is not None:
            raise ValueError("--gpus places servers on GPUs; --device cpu runs them on the CPU")
        return "cpu", []
    gpus = parse_gpus(gpus_flag, len(visible)) if gpus_flag is not None else list(range(len(visible)))
    if not gpus:
        if device == "cuda":
            raise ValueError("--device cuda, but no GPU is visible (CUDA_VISIBLE_DEVICES, the driver's device count)")
        return "cpu", []
    return "cuda", gpus


def server_env(placement: ServerPlacement, visible: list[str]) -> dict[str, str]:
    """The environment to start a server in: this one's, with only its GPUs visible (on CPU unchanged)."""
    env = dict(os.environ)
    if placement.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[g] for g in placement.gpus)
    return env


def rank_threads(local_ranks: int, cores: int) -> int:
    """On CPU, the torch threads of each rank of a TP server: the cores split among every local rank.

    NOTE: a TP server's ranks meet in every forward's collectives, so one rank waiting for a core
    stalls them all: on 2 cores, 2 ranks with a thread per core ran ~30x slower than with 1 each
    (tests/test_tp_disagg.py). A TP 1 server keeps torch's default (splitting the cores cost it a
    quarter of its throughput: docs/benchmarks/README.md)."""
    return max(1, cores // local_ranks)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, not a container's CPU quota)."""
    return len(os.sched_getaffinity(0))


def describe(plan: list[ServerPlacement], tp_of: dict[str, int], visible: list[str]) -> list[str]:
    """One line per server: its role and number, TP size, GPUs (or the CPU) and memory fraction."""
    lines = []
    for server in plan:
        where = "CPU"
        if server.gpus:
            names = ",".join(visible[g] for g in server.gpus)
            numbers = ",".join(map(str, server.gpus))
            where = f"GPU{'s' if len(server.gpus) > 1 else ''} {numbers}"
            if names != numbers:
                where += f" (CUDA_VISIBLE_DEVICES={names})"
            where += f", --mem-fraction-static {server.mem_fraction}"
        lines.append(f"  {server.role} {server.index}: tp {tp_of[server.role]}, {where}")
    return lines


def describe_kv_paths(plan: list[ServerPlacement], path: str) -> list[str]:
    """How each prefill server's KV reaches each decode server (its --kv-transfer-path, `path`, applied
    to where the two sit): one line per pair. The prefill server logs what it actually used when it
    first meets a decode server (common/kv_transfer/direct.py)."""
    lines = []
    for p in (s for s in plan if s.role == "prefill"):
        for d in (s for s in plan if s.role == "decode"):
            if not p.gpus or not d.gpus:
                how = "NIXL (UCX, DRAM)"
            elif path == "nixl":
                how = "NIXL (UCX, VRAM; --kv-transfer-path nixl)"
            else:
                shared = set(p.gpus) & set(d.gpus)
                where = "on the GPU they share" if shared == set(p.gpus) == set(d.gpus) else "GPU to GPU, peer access"
                how = f"device copy through CUDA IPC, one kernel a request ({where})"
                if path == "auto":
                    how += "; NIXL where the pool cannot be mapped"
            lines.append(f"  KV prefill {p.index} -> decode {d.index}: {how}")
    return lines


def kv_transfer_path(server_flags: Sequence[str]) -> str:
    """The --kv-transfer-path the servers are given in `server_flags` (the last one wins, as argparse
    takes it); "auto" when none is."""
    path = "auto"
    for i, flag in enumerate(server_flags):
        if flag == "--kv-transfer-path" and i + 1 < len(server_flags):
            path = server_flags[i + 1]
        elif flag.startswith("--kv-transfer-path="):
            path = flag.split("=", 1)[1]
    return path
