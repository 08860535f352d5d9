"""How many GPUs this process may use, and their memory, without importing torch (3-6 s on a GPU host)."""

from __future__ import annotations

import ctypes
import os


def cuda_device_count() -> int:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES's entries when it is set, else the
    driver's count (torch's when there is no NVIDIA driver to ask).

    NOTE: a server's frontend checks its flags with this before it spawns the scheduler, and
    `pdserve up` places its servers with it: importing torch there cost 3-6 s of every start on the
    GPU hosts. `pdserve up` sets the variable for its servers. (A listed GPU that does not exist
    then fails in the scheduler, at its first use.)"""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        entries = []
        for entry in listed.split(","):
            if not entry.strip() or entry.strip() == "-1":
                break  # CUDA stops at the first entry that names no device
            entries.append(entry)
        return len(entries)
    count = driver_device_count()
    if count is not None:
        return count
    if not driver_library_loads() and not os.path.exists(ROCM_DEVICE):
        # No NVIDIA driver and no ROCm device: torch would count none. NOTE asking it anyway imported
        # torch in `pdserve up` on every CPU-only machine: 2.8 s on its start's path on a 2-core box.
        return 0
    import torch

    return torch.cuda.device_count()


CUDA_ERROR_NO_DEVICE = 100
ROCM_DEVICE = "/dev/kfd"  # (a ROCm build of torch counts AMD GPUs through it, with no libcuda)


def driver_library_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def driver_device_count() -> int | None:
    """cuDeviceGetCount from the NVIDIA driver's library (what torch.cuda.device_count() counts,
    in ~0.1 s and no torch); None when there is no driver library or it cannot initialize."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    status = lib.cuInit(0)
    if status == CUDA_ERROR_NO_DEVICE:
        return 0
    count = ctypes.c_int(0)
    if status != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return None
    return count.value


def driver_device_memory() -> list[int] | None:
    """Each GPU's total memory in bytes (cuDeviceTotalMem, GPUs numbered as this process sees them);
    None when the driver cannot be asked."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return None
    sizes = []
    for ordinal in range(count.value):
        device, total = ctypes.c_int(0), ctypes.c_size_t(0)
        if lib.cuDeviceGet(ctypes.byref(device), ordinal) != 0 or lib.cuDeviceTotalMem_v2(ctypes.byref(total), device):
            return None
        sizes.append(total.value)
    return sizes
