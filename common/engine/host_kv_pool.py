"""A host-memory tier for KV pages: the pages of the device pool's prefix cache, kept in (pinned) host
memory and copied back when a prefix hit needs them: `--host-kv-cache-gb` (the radix cache decides
what to store and load, and when: common/scheduling/radix_cache.py; `--host-kv-write-policy`).

    host = HostKVPool.for_gb(2.0, device_pool)          # as many pages as 2 GiB hold
    slots = host.alloc(len(pages))
    done = host.store(device_pool, pages, slots)        # device -> host; an event on CUDA
    done = host.store_async(device_pool, pages, slots)  # the same on the pool's store stream
    done = host.load(device_pool, slots, new_pages)     # host -> device, into other device pages
    done = host.load_async(device_pool, slots, new_pages)  # the same on the pool's load stream; the
                                                           # slots are free again once it completes
                                                           # (unless keep_slots: they stay a backup)

Layout: one host page is every layer's K and V of one device page, contiguous
([layers, 2, page_size, kv_heads, head_dim]: each buffer's page as the device pool lays it out), so
moving n pages is one copy of n pages' bytes between the device and the host, not one small copy
per page per layer. On a GPU one Triton launch moves
any number of pages, every layer, K and V, and head, reading or writing the pinned host pages
directly (mapped memory: common/kv_transfer/page_copy_kernel.py `copy_host_pages`); it was a gather
or scatter per layer and per K/V plus a bulk copy (32 launches for a Llama-1B load whatever its size:
14.5 GB/s for 16 pages, 1.2 for one, against the bus's 55: docs/benchmarks/README.md). On the CPU the
copies are plain index copies.

Streams: loads run on `stream`, write-through stores on `store_stream` (two side streams, so a
load and a store move in both directions at once, beside the running batch); each first waits for
everything queued on the current (scheduling) stream. NOTE the caller must not read loaded pages,
rewrite device pages being stored (`wait_for` the store's event first: a device-side wait), or
reuse host slots a copy still reads or writes before its event completes: `free_after` gives slots
back only then (a store into a slot still being loaded is a write-after-read race; two stores on
different streams into one slot, a write-after-write one). `load_async` frees its slots that way.

Tensor parallelism: every rank holds a host pool of its own heads (the same slots, so --host-kv-cache-gb is
per rank). Rank 0's radix cache decides every copy; `mirror` sends each to the other ranks, in order with the
steps (tp_worker.py), and they `replay` it on their pools.

Bandwidth: every copy on a GPU is timed with CUDA events (`stats`: bytes and device seconds per
direction, harvested as the copies complete, never waited for).
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.common.engine.kv_pool import PagedKVPool
from pdserve.common.engine.overlap import h2d_array

WRITE_POLICIES = ("write_through", "write_back")


class HostKVPool:
    def __init__(
        self,
        num_pages: int,
        like: PagedKVPool,
        pin: bool | None = None,
        write_policy: str = "write_through",
        mirror=None,
    ):
        """`num_pages` host pages shaped as `like`'s; pinned when the device pool is on a GPU
        (unless `pin` says otherwise), which asynchronous copies need. `write_policy`: when the
        radix cache copies pages here (--host-kv-write-policy). `mirror(op, device_pages, slots)`:
        told of every copy before it is issued (a TP server's rank 0: the other ranks `replay` it)."""
        self.mirror = mirror
        if num_pages < 1:
            raise ValueError(f"the host KV pool needs at least one page, got {num_pages}")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"--host-kv-write-policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        # write_through: pages are backed up as they are cached; write_back: copied when evicted.
        self.write_through = write_policy == "write_through"
        self.num_pages = num_pages
        self.page_shape = (like.num_layers, 2, like.page_size, like.kv_heads, like.head_dim)
        self.dtype = like.dtype
        pin = like.k_storage[0].is_cuda if pin is None else pin
        self.pages = torch.zeros((num_pages, *self.page_shape), dtype=like.dtype, pin_memory=pin)
        self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: 0, 1, 2, ...
        self._freeing: list[tuple[object, list[int]]] = []  # (copy's event, slots it reads or writes)
        on_gpu = like.k_storage[0].is_cuda
        self.stream = torch.cuda.Stream(like.k_storage[0].device) if on_gpu else None  # loads: load_async
        self.store_stream = torch.cuda.Stream(like.k_storage[0].device) if on_gpu else None  # store_async
        self.stats = {"load_bytes": 0, "load_s": 0.0, "store_bytes": 0, "store_s": 0.0}
        self._tables = None  # (device pool, host table, pool table): copy_host_pages' addresses
        self._timing: list[tuple[str, int, object, object]] = []  # (direction, bytes, start, end) in flight

    @classmethod
    def for_gb(
        cls, gb: float, like: PagedKVPool, pin: bool | None = None, write_policy: str = "write_through", mirror=None
    ) -> "HostKVPool":
        """As many pages as `gb` GiB hold."""
        page_bytes = like.bytes_per_token() * like.page_size
        num_pages = int(gb * (1 << 30)) // page_bytes
        if num_pages < 1:
            raise ValueError(f"{gb} GiB holds no KV page of {page_bytes} bytes")
        return cls(num_pages, like, pin, write_policy, mirror)

    @property
    def page_bytes(self) -> int:
        return self.pages[0].numel() * self.pages.element_size()

    def num_free(self) -> int:
        self.poll()
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n host pages, or None (and nothing taken) when fewer are free."""
        if n > self.num_free():
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, slots: list[int]) -> None:
        for slot in slots:
            if not 0 <= slot < self.num_pages:
                raise ValueError(f"host page {slot} is not in [0, {self.num_pages})")
        self._free.extend(slots)

    def free_after(self, done, slots: list[int]) -> None:
        """Free `slots` once `done` (a copy's event, or None: at once) has completed."""
        if done is None:
            self.free(slots)
        else:
            self._freeing.append((done, slots))

    def poll(self) -> None:
        """Free the slots of completed copies; account the completed copies' time (never waits)."""
        if self._freeing:  # (two streams: copies complete out of issue order)
            pending = []
            for done, slots in self._freeing:
                if done.query():
                    self.free(slots)
                else:
                    pending.append((done, slots))
            self._freeing = pending
        timing, self._timing = self._timing, []
        for direction, size, start, end in timing:
            if not end.query():
                self._timing.append((direction, size, start, end))
                continue
            self.stats[f"{direction}_bytes"] += size
            self.stats[f"{direction}_s"] += start.elapsed_time(end) / 1000

    def store(self, device: PagedKVPool, device_pages: list[int], slots: list[int], stream=None):
        """Copy device pages into host pages `slots` (in order); on CUDA, returns the event that
        completes with the copy (None on the CPU, where it is done on return)."""
        self._check(device, device_pages, slots)
        self._tell("store", device_pages, slots)
        with _on(stream):
            start = self._start("store")
            if self._direct(device):
                self._copy_direct(device, slots, device_pages, to_host=True)
            else:
                staged = self._gather(device, device_pages)
                for at, begin, stop in _runs(slots):  # one copy per run of consecutive slots
                    self.pages[begin:stop].copy_(staged[at : at + stop - begin], non_blocking=True)
            return self._end("store", len(slots), start)

    def load(self, device: PagedKVPool, slots: list[int], device_pages: list[int], stream=None):
        """Copy host pages `slots` into device pages (in order); on CUDA, returns the event that
        completes with the copy (None on the CPU)."""
        self._check(device, device_pages, slots)
        self._tell("load", device_pages, slots)
        with _on(stream):
            start = self._start("load")
            if self._direct(device):
                self._copy_direct(device, slots, device_pages, to_host=False)
            else:
                target = device.k_storage[0].device
                staged = torch.empty((len(slots), *self.page_shape), dtype=self.dtype, device=target)
                for at, begin, stop in _runs(slots):
                    staged[at : at + stop - begin].copy_(self.pages[begin:stop], non_blocking=True)
                self._scatter(device, staged, device_pages)
            return self._end("load", len(slots), start)

    def load_async(self, device: PagedKVPool, slots: list[int], device_pages: list[int], keep_slots: bool = False):
        """`load` on this pool's own stream, after everything queued so far on the current one (the
        scheduling stream, which has waited for the forward in flight and for any store of these
        slots: the device pages are free of readers, the host pages written); `slots` are freed when
        it completes, unless `keep_slots` (the caller keeps them as the pages' backup, and must
        free them with `free_after` this event). Returns its event (None on the CPU, where it is
        done on return)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
        done = self.load(device, slots, device_pages, stream=self.stream)
        if not keep_slots:
            self.free_after(done, slots)
        return done

    def store_async(self, device: PagedKVPool, device_pages: list[int], slots: list[int]):
        """`store` on this pool's store stream, after everything queued so far on the current one
        (which holds the forward that wrote the pages). Returns its event (None on the CPU): until
        it completes the device pages must not be rewritten (`wait_for`) nor the slots reused."""
        if self.store_stream is not None:
            self.store_stream.wait_stream(torch.cuda.current_stream())
        return self.store(device, device_pages, slots, stream=self.store_stream)

    def _tell(self, op: str, device_pages: list[int], slots: list[int]) -> None:
        """The copy about to be issued, to `mirror` (before it: the other ranks' copies start alike)."""
        if self.mirror is not None:
            self.mirror(op, device_pages, slots)

    def replay(self, device: PagedKVPool, op: str, device_pages: list[int], slots: list[int]) -> None:
        """A TP rank other than 0: rank 0's copy ("store" or "load") of the same pages and slots, of
        this rank's heads, on the load stream after what the current (scheduling) stream queued.

        NOTE rank 0 orders its copies by their events (a forward waits for a load through
        `pending_load`, a page is rewritten after its store through `wait_for`, a slot is reused once
        its copies are done); this rank has no events of its own to go by. So the current stream
        waits for this copy on the device: the next step's forward and writes come after it (the one
        in flight still runs beside it), and so does any later copy. A peer's KV WRITE into this
        rank's pages is ordered by no stream: it comes after rank 0's own stores settled (`unsettled`),
        by which time this rank's, queued first, are long done (a few pages, microseconds)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
        if op == "store":
            done = self.store(device, device_pages, slots, self.stream)
        else:
            done = self.load(device, slots, device_pages, self.stream)
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        self.poll()  # (harvests the copies' timings: no one else polls this rank's pool)

    def wait_for(self, done) -> None:
        """Order what the current stream does next after `done` (a copy's event, or None): a wait
        on the device, never on the host."""
        if done is None:
            return
        if self.stream is not None:
            torch.cuda.current_stream().wait_event(done)
        else:  # (CPU copies are done on return: only a test's deferred stand-in gets here)
            done.synchronize()

    def _start(self, direction: str):
        if self.stream is None:  # (CPU copies are done on return: bytes counted, not timed)
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def _end(self, direction: str, pages: int, start):
        if start is None:
            self.stats[f"{direction}_bytes"] += pages * self.page_bytes
            return None
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._timing.append((direction, pages * self.page_bytes, start, end))
        return end

    # ---- device side ---------------------------------------------------------------------------

    def _direct(self, device: PagedKVPool) -> bool:
        """One kernel moves the pages (pinned host pages, a GPU pool, whole 32-bit words a head's page)."""
        return self.stream is not None and self.pages.is_pinned() and self._device_page_bytes(device) % 4 == 0

    def _device_page_bytes(self, device: PagedKVPool) -> int:
        """Bytes of one page of one of the device pool's buffers (contiguous there, and here)."""
        return device.page_size * device.kv_heads * device.head_dim * self.pages.element_size()

    def _copy_direct(self, device: PagedKVPool, slots: list[int], device_pages: list[int], to_host: bool) -> None:
        from pdserve.common.kv_transfer.page_copy_kernel import address_table, copy_host_pages

        if self._tables is None or self._tables[0] is not device:
            buffers = [b for pair in zip(device.k_storage, device.v_storage) for b in pair]  # layer 0 K, V, ...
            page_bytes = self._device_page_bytes(device)
            base = self.pages.data_ptr()
            host = [base + b * page_bytes for b in range(len(buffers))]
            host_table = torch.tensor(host, dtype=torch.int64, device=buffers[0].device)
            self._tables = (device, host_table, address_table(buffers), page_bytes)
        _, host_table, pool_table, page_bytes = self._tables
        index = h2d_array(np.array([slots, device_pages], dtype=np.int64), pool_table.device)
        copy_host_pages(host_table, pool_table, index[0], index[1], page_bytes, to_host)

    def _gather(self, device: PagedKVPool, pages: list[int]) -> torch.Tensor:
        """[n, layers, 2, page, heads, dim]: the pages, in this pool's layout, on the device."""
        index = h2d_array(np.array(pages, dtype=np.int64), device.k_storage[0].device)  # (no pageable copy)
        layers = []
        for k, v in zip(device.k_storage, device.v_storage):
            per_page = [_raw(b).view(device.num_pages, *self.page_shape[2:]) for b in (k, v)]
            layers.append(torch.stack([b.index_select(0, index) for b in per_page]))  # [2, n, page, heads, dim]
        return torch.stack(layers).permute(2, 0, 1, 3, 4, 5).contiguous().view(device.dtype)

    def _scatter(self, device: PagedKVPool, staged: torch.Tensor, pages: list[int]) -> None:
        index = h2d_array(np.array(pages, dtype=np.int64), staged.device)
        by_layer = staged.permute(1, 2, 0, 3, 4, 5)  # [layers, 2, n, page, heads, dim]
        for layer, (k, v) in enumerate(zip(device.k_storage, device.v_storage)):
            for i, b in enumerate((k, v)):
                view = b.view(device.num_pages, *self.page_shape[2:])
                _raw(view).index_copy_(0, index, _raw(by_layer[layer, i]))

    def _check(self, device: PagedKVPool, device_pages: list[int], slots: list[int]) -> None:
        if len(device_pages) != len(slots) or not slots:
            raise ValueError(f"{len(device_pages)} device pages but {len(slots)} host pages")
        shape = (device.num_layers, 2, device.page_size, device.kv_heads, device.head_dim)
        if shape != self.page_shape or device.dtype != self.dtype:
            raise ValueError(f"a device pool of pages {shape} {device.dtype}; this one holds {self.page_shape}")
        if any(not 0 < p < device.num_pages for p in device_pages):
            raise ValueError(f"device pages {device_pages} are not in [1, {device.num_pages})")
        if any(not 0 <= s < self.num_pages for s in slots):
            raise ValueError(f"host pages {slots} are not in [0, {self.num_pages})")


def _runs(slots: list[int]):
    """(position in `slots`, start, stop) of each run of consecutive ascending slots."""
    at = 0
    while at < len(slots):
        stop = at + 1
        while stop < len(slots) and slots[stop] == slots[stop - 1] + 1:
            stop += 1
        yield at, slots[at], slots[at] + stop - at
        at = stop


class _on:
    """`with torch.cuda.stream(stream)` when a stream is given, else nothing."""

    def __init__(self, stream):
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            return self.ctx.__exit__(*exc)
        return False


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A float8 pool's tensor as its bytes: pages are copied, never converted, and torch has no
    index_copy_ for float8 on CPU."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
