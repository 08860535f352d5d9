"""Checkpoint tensors to the GPU through pinned buffers (the loader's copies, models/loader.py).

A checkpoint tensor is a view of the memory-mapped file. `param.copy_(tensor)` from there to the GPU is a
pageable copy: the driver copies the pages into its own staging memory a piece at a time, faulting the
file's pages in on the way, and the DMA waits for each piece. Here the host copies each tensor's bytes into
one of two pinned buffers while the device copies the other one's out (`non_blocking`, an event per
buffer), so the page faults and the transfers overlap, and the transfers run at pinned speed.

Only a plain byte copy goes this way: source and destination contiguous, of one dtype and size. Anything
else (a dtype conversion, a transposed or strided slice) is `copy_` as before. `finish()` waits for the
last transfers: the weights are whole only after it (the loader calls it before anything reads them).
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 64 << 20  # per pinned buffer: large enough that each transfer is at full speed


class PinnedStaging:
    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES):
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.freed = [None, None]  # the event after each buffer's last transfer (None: never used)
        self.turn = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (on this device) <- src (host memory), as `dst.copy_(src)` would."""
        if not (dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype and dst.shape == src.shape):
            dst.copy_(src)
            return
        if src.numel() == 0:
            return
        to = dst.reshape(-1).view(torch.uint8)
        source = src.reshape(-1).view(torch.uint8)
        for start in range(0, source.numel(), self.chunk_bytes):
            end = min(start + self.chunk_bytes, source.numel())
            buffer, done = self.buffers[self.turn], self.freed[self.turn]
            if done is not None:
                done.synchronize()  # NOTE the device may still be reading this buffer's last bytes
            staged = buffer[: end - start]
            staged.copy_(source[start:end])  # the page faults, on the host
            to[start:end].copy_(staged, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.freed[self.turn] = event
            self.turn = 1 - self.turn

    def finish(self) -> None:
        """Wait for every transfer made so far (the buffers are free again after it)."""
        for event in self.freed:
            if event is not None:
                event.synchronize()
