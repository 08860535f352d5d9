"""The overlap machinery: device-agnostic streams, the FutureMap, pinned host copies.

Streams (docs/architecture.md, "The overlapped loop"):
    schedule_stream  the event loop runs inside it; the GPU ops scheduling issues (req_to_token
                     writes, H2D of input ids) queue here
    forward_stream   forward + sample; first waits for schedule_stream (a GPU-side wait)
    d2h_stream       private: copies what the host needs into pinned buffers, waiting only on the
                     event that publishes them, then records `copy_done`
On CPU every stream and event is torch.cpu's no-op stub, so the same loop runs and its ordering
logic is tested without a GPU.

NOTE the WAR barrier lives in the loop (`schedule_stream.wait_stream(forward_stream)` right after
each launch): it makes the next scheduling step's writes to shared buffers (req_to_token rows,
KV slots freed by the previous result and reused) wait until the forward that may still read them
is done. Because of it nothing on schedule_stream may host-sync; everything the host reads comes
through d2h_stream into pinned memory, and everything it uploads goes through pinned memory
allocated once (PinnedStaging).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

# numpy builds an array from a list ~3x faster than torch.tensor (128 x 6 ints: 14 vs 45 us).
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


def h2d(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor without making the host wait for the current stream."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:  # (no caller uploads another dtype)
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=device.type == "cuda")
    array = np.array(values, dtype=np_dtype)
    return staging_for(device).upload(array) if device.type == "cuda" else torch.from_numpy(array).to(device)


def h2d_array(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array -> device tensor of its dtype, like h2d (no list-to-tensor conversion).

    NOTE: on CUDA a copy from pageable memory synchronizes with the stream first, which after the
    WAR barrier means waiting for the forward in flight; and `tensor.pin_memory()` per upload is no
    better: the caching host allocator calls cudaHostAlloc for a size it has no free block of, and
    that waits for the device (steps of 10-21 ms on an H100 where the host should have taken 3).
    So uploads go through `PinnedStaging`: pinned memory allocated once, reused as copies finish.
    """
    if device.type != "cuda":
        return torch.from_numpy(values).to(device, copy=True)
    return staging_for(device).upload(values)


class PinnedStaging:
    """A ring of pinned host memory every upload of the loop is staged in (allocated once).

    An upload writes its bytes at the ring's head, queues the device copy on the current stream
    and records an event after it; a region is written again only once the events of the copies
    that read it have completed. The loop keeps at most a few steps in flight (each a few hundred
    KB at most), so a ring of STAGING_BYTES wraps long after those copies ran and the event checks
    never wait; if one ever must, `waits` counts it. An array larger than a quarter of the ring (none
    the loop makes) is pinned on its own.
    """

    ALIGN = 256  # bytes: every upload starts aligned for any dtype's view

    def __init__(self, device: torch.device, nbytes: int, pin: bool = True, new_event=None):
        self.device = device
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.bytes = self.host.numpy()
        self.capacity = nbytes
        self.head = 0
        self.pending: deque = deque()  # (start, end, event) of queued copies, oldest first
        self.spare_events: list = []
        self.waits = 0  # uploads that had to wait for a copy still reading their region
        self._new_event = new_event or (lambda: torch.cuda.Event())
        self._lock = threading.Lock()  # (the loop's thread uploads; a TP rank's thread may too)

    def upload(self, values: np.ndarray) -> torch.Tensor:
        values = np.ascontiguousarray(values)
        n = values.nbytes
        dtype = torch.from_numpy(values).dtype
        if n == 0:
            return torch.empty(values.shape, dtype=dtype, device=self.device)
        if n > self.capacity // 4:
            return torch.from_numpy(values).pin_memory().to(self.device, non_blocking=True)
        with self._lock:
            start = self._reserve(n)
            self.bytes[start : start + n] = values.reshape(-1).view(np.uint8)
            out = torch.empty(n, dtype=torch.uint8, device=self.device)
            out.copy_(self.host[start : start + n], non_blocking=True)
            event = self.spare_events.pop() if self.spare_events else self._new_event()
            event.record()  # on the current stream: where the copy was queued
            self.pending.append((start, start + n, event))
        return out.view(dtype).view(values.shape)

    def _reserve(self, n: int) -> int:
        """The start of n free bytes at the head (wrapping to 0 when they do not fit before the end)."""
        start = self.head if self.head + n <= self.capacity else 0
        end = start + n
        while self.pending and self.pending[0][2].query():  # copies that ran: their regions are free
            self.spare_events.append(self.pending.popleft()[2])
        for region_start, region_end, event in self.pending:
            if region_start < end and start < region_end:  # still read by a queued copy
                self.waits += 1
                event.synchronize()
        self.head = -(-end // self.ALIGN) * self.ALIGN
        return start


STAGING_BYTES = 32 << 20
_staging: dict[torch.device, PinnedStaging] = {}


def staging_for(device: torch.device) -> PinnedStaging:
    """The process's staging ring for `device` (made on the first upload)."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    ring = _staging.get(device)
    if ring is None:
        ring = _staging[device] = PinnedStaging(device, STAGING_BYTES)
    return ring


class DeviceStreams:
    def __init__(self, device: torch.device):
        self.device = device
        self.module = torch.get_device_module(device)
        self.schedule_stream = self.module.Stream()
        self.forward_stream = self.module.Stream()
        self.d2h_stream = self.module.Stream()

    def use(self, stream):
        """`with streams.use(s):` makes s current (no-op on CPU)."""
        return self.module.stream(stream)

    def event(self):
        return self.module.Event()


class FutureMap:
    """Next-step input ids that only the device knows yet, addressed by negative placeholders.

    A launch takes `bs` consecutive slots of a ring; its sampled ids are stored there on the
    forward stream, and a later batch's input id -i is replaced by slot i on the same stream, so
    stream order guarantees the value is written before it is read. Slot 0 is never used (-0 is
    not a placeholder). The ring holds several batches, so a slot is never reused while a batch
    that may read it is still in flight.
    """

    def __init__(self, max_batch: int, device: torch.device):
        self.size = 4 * max_batch + 2
        self.buf = torch.zeros(self.size, dtype=torch.int64, device=device)
        # A verify step's accepted drafts per request, beside its last token (common/engine/speculative/
        # overlap.py): how far the next step's positions move. With `counts_read` (speculation on) every
        # other store writes 0 there.
        self.counts = torch.zeros(self.size, dtype=torch.int64, device=device)
        self.counts_read = False
        self.next = 1

    def alloc(self, n: int) -> list[int]:
        """n consecutive slots."""
        if self.next + n > self.size:
            self.next = 1
        slots = list(range(self.next, self.next + n))
        self.next += n
        return slots

    def store(self, slots: list[int], token_ids: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Write `token_ids` (and a verify step's accepted `counts`, else 0) to `slots` (consecutive, as
        alloc hands them out): slice copies, no index upload."""
        if slots:
            window = slice(slots[0], slots[0] + len(slots))
            self.buf[window].copy_(token_ids)
            if counts is not None:
                self.counts[window].copy_(counts)
            elif self.counts_read:
                self.counts[window].zero_()

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input ids with placeholders replaced (a new tensor; runs on the current stream)."""
        return torch.where(input_ids < 0, self.buf[(-input_ids).clamp(min=0)], input_ids)


@dataclass
class HostOutputs:
    """Pinned host buffers one result is copied into; reused once that result is processed."""

    next_token_ids: torch.Tensor  # [max_batch] int64
    logprobs: torch.Tensor  # [max_batch] float32
    top_ids: torch.Tensor  # [max_batch, k] int64
    top_logprobs: torch.Tensor  # [max_batch, k] float32
    in_use: bool = False


@dataclass
class ForwardResult:
    """One launched batch's outputs. The host reads them only after `copy_done.synchronize()`."""

    host: HostOutputs
    batch_size: int
    has_logprobs: bool
    top_k: int
    copy_done: object
    published: object  # recorded on the forward stream once forward + sample are queued before it
    # Device tensors the copies read from: kept alive until the result is processed.
    keep_alive: list = field(default_factory=list)
    # Prompt logprobs of the requests that asked (host copies, common/engine/prompt_logprobs.py), or None.
    prompt_logprobs: object = None


@dataclass
class QueuedForward:
    """A forward queued on the forward stream whose sampling is not queued yet (ModelRunner.launch_forward)."""

    logits: torch.Tensor  # [B, V] on the device
    scored: list  # the prompt logprobs it computes (0 or 1 PromptLogprobs)


class PinnedOutputs:
    """A small ring of HostOutputs: at most two results are ever unprocessed (N-1 and N)."""

    def __init__(self, max_batch: int, max_top_k: int, device: torch.device, depth: int = 3):
        pin = device.type == "cuda"  # pinned memory needs an accelerator

        def buf(*shape, dtype):
            t = torch.zeros(shape, dtype=dtype)
            return t.pin_memory() if pin else t

        self.sets = [
            HostOutputs(
                buf(max_batch, dtype=torch.int64),
                buf(max_batch, dtype=torch.float32),
                buf(max_batch, max(max_top_k, 1), dtype=torch.int64),
                buf(max_batch, max(max_top_k, 1), dtype=torch.float32),
            )
            for _ in range(depth)
        ]
        self.next = 0

    def acquire(self) -> HostOutputs:
        host = self.sets[self.next]
        assert not host.in_use, "more results in flight than the pipeline allows"
        self.next = (self.next + 1) % len(self.sets)
        host.in_use = True
        return host
