"""host_memory: the store's host buffers, allocated at once and filled and page-locked by threads side by side.

Page-locking is what takes the time: GPT3_18B's 107 GiB of host state took 35-43 s on the H200 box, one buffer
after another (touch every page, then cudaHostRegister it). `HostBuffers.batch()` queues that work instead: each
buffer is handed out at once (allocated, untouched), and `threads` workers write its first values and register it
while the store goes on; the batch ends when every buffer is ready, so nothing reads one before (a writer that
needs some buffers sooner waits for those alone: `HostBuffers.wait_ready`, the init's masters). Outside a batch a
buffer is made ready before it is handed out, as before. Each buffer is its own allocation of exactly its bytes,
so the budget's accounting (what `ChunkStore.alloc` charges) is what is allocated.

`HostReserve` starts earlier still: the locked buffers the plan surely needs (frozen weights, masters that cross
themselves), locked while the plan is searched (the store takes them from it). Memory no copy reads or writes
(moments, a master whose 16-bit shadow crosses instead) is never locked (`lock=False`), and a master is not even
touched ahead (`written_first`). Every buffer is asked for transparent huge pages before its first touch
(`huge_pages_wanted`): 512x fewer faults to take and pages to lock.

`bench/pinned_alloc.py` measures this against one thread, against `pin_memory` and against large slabs on the
machine at hand; `PSTAR_FX_PIN_THREADS` sets the workers (default 4; 1: one buffer after another, as before).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from ..config import parse_count, parse_flag

log = logging.getLogger("pstar_fx")

DEFAULT_THREADS = 4


def pin_threads() -> int:
    env = os.environ.get("PSTAR_FX_PIN_THREADS")
    return DEFAULT_THREADS if env is None else parse_count(env, "PSTAR_FX_PIN_THREADS", "threads", least=1)


def huge_pages_wanted() -> bool:
    """Back the host buffers with transparent huge pages (2 MiB), asked for before their first touch; on by default,
    `PSTAR_FX_HUGE_PAGES=0` turns it off. On an H100 box (THP `madvise`-only: only memory so advised gets them)
    page-locking 16 GiB on 4 threads ran at 15.1 GB/s against 5.4 on 4 KiB pages, and a cold GPT3_18B compile
    (bf16 moments) waited 3.8 s instead of 9.3 for its masters' locks before the init (46.4 s to the first step's
    end against 53.0, same box; bench/RESULTS.md, session 33). Where the kernel gives none, the advice is a no-op."""
    return parse_flag(os.environ.get("PSTAR_FX_HUGE_PAGES", "1"), "PSTAR_FX_HUGE_PAGES")


def register(t: torch.Tensor) -> int:
    """cudaHostRegister `t`'s bytes (unregistered when `t` is freed); the CUDA error code (0: locked).

    Not `pin_memory=True`: that goes through PyTorch's pinned caching allocator, which rounds every block up to a
    power of two (a 1.88 GB chunk tensor takes 2 GiB, 14% more host memory than the plan counted; measured on the
    H200 box: 10B training reached 75 GB RSS for 65 GB of planned host state). cudaHostRegister locks exactly the
    bytes the tensor has."""
    cudart = torch.cuda.cudart()
    not_inherited(t)
    err = int(cudart.cudaHostRegister(t.data_ptr(), t.untyped_storage().nbytes(), 0))
    if err == 0:
        when_freed(t, cudart.cudaHostUnregister, t.data_ptr())
    return err


def when_freed(t: torch.Tensor, fn: Callable, *args) -> None:
    """Call `fn(*args)` when `t`'s memory is freed: when its storage goes, not the tensor object `t`. Whoever keeps
    a view of another dtype (`HostBuffers.empty` hands out a reserved byte buffer as `buf.view(dtype)`, which has
    no `_base`) holds the storage but not `t`; a finalizer on `t` unregistered the 70B LoRA's frozen host chunks
    while they were in use, and each of their copies to the GPU went through pageable memory (263 ms for 2.2 GB,
    blocking the launching thread: 26.7 s steps for 14.7 planned)."""
    storage = t.untyped_storage()
    # torch keeps one Python object per storage while the storage lives (since 2.1); were this one a temporary,
    # the finalizer would run now, so the tensor is the lesser evil
    weakref.finalize(storage if storage is t.untyped_storage() else t, fn, *args)


# buffers from this size up are their own mappings (glibc maps every allocation above its largest mmap threshold,
# 32 MiB on 64-bit, by itself): advising their pages touches no other object's
OWN_MAPPING_BYTES = 64 << 20
MADV_DONTFORK = 10
MADV_HUGEPAGE = 14
# unlocked zero-filled host buffers written before they are read, from this size up, are anonymous mappings nobody
# touches ahead (HostBuffers.empty): at GPT3_18B with bf16 moments, 43 GiB of masters that were zeroed before the
# init wrote them
LAZY_ZERO_BYTES = OWN_MAPPING_BYTES


def _advise(t: torch.Tensor, advice: int) -> bool:
    """madvise `advice` over the pages of `t`'s storage where it is its own mapping (`OWN_MAPPING_BYTES` and up);
    whether it was advised."""
    nbytes = t.untyped_storage().nbytes()
    if nbytes < OWN_MAPPING_BYTES or not hasattr(os, "fork"):
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.untyped_storage().data_ptr() // page * page
    end = -(-(t.untyped_storage().data_ptr() + nbytes) // page) * page
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) == 0
    except (OSError, AttributeError):
        return False


def huge_pages(t: torch.Tensor) -> bool:
    """Ask for `t`'s pages as transparent huge pages (2 MiB: 512x fewer first-touch faults and pages to pin), before
    they are touched; whether it was asked. On the development VM a first touch of 3 GiB ran 0.18-0.28 GB/s on
    4 KiB pages and 0.39-0.46 GB/s on huge ones."""
    return _advise(t, MADV_HUGEPAGE)


def not_inherited(t: torch.Tensor) -> bool:
    """Keep `t`'s pages out of any process forked from this one (madvise MADV_DONTFORK), where the buffer is its own
    mapping; whether it was advised. A page-locked buffer shared copy-on-write with a child (the recompute search's,
    pipeline/plan_ahead.py, or a DataLoader's worker) would move to a new page at the parent's next write on kernels
    that do not copy pinned pages at fork, away from what the GPU reads; a child never reads chunk memory."""
    return _advise(t, MADV_DONTFORK)


def _advise_untouched(t: torch.Tensor, huge: bool) -> None:
    """Advice for a buffer whose pages do not exist yet: out of forked children, and huge pages where `huge`."""
    not_inherited(t)                    # before its pages exist: a fork meanwhile does not copy them
    if huge:
        huge_pages(t)


def _first_values(t: torch.Tensor, fill: float | int) -> None:
    """`fill` everywhere in `t` (a whole, contiguous buffer). A byte pattern (0 in any dtype, a byte of a 1-byte
    dtype) is a memset on this thread alone (ctypes releases the GIL): a pin worker then takes one core, where
    torch's `fill_` would spread over the intra-op pool, which the region builds beside the page-locking share
    (on the H200 box they slowed from 10 to 23 s beside it; not yet measured with this). Anything else: `fill_`."""
    if fill in range(256) and (fill == 0 or t.element_size() == 1) and t.is_contiguous():
        ctypes.memset(t.data_ptr(), int(fill), t.numel() * t.element_size())
    else:
        t.fill_(fill)


def device_threads(threads: int, device: torch.device | None, name: str) -> ThreadPoolExecutor:
    """Worker threads on `device`'s CUDA context (a new thread's current device would be cuda:0): those that
    page-lock host buffers, the one that writes the initial weights (startup.py)."""
    on_device = device is not None and device.type == "cuda"
    # set_device needs an index: "cuda" alone is the current device of this (the constructing) thread
    index = (device.index if device.index is not None else torch.cuda.current_device()) if on_device else None
    return ThreadPoolExecutor(threads, thread_name_prefix=name,
                              initializer=torch.cuda.set_device if on_device else None,
                              initargs=(index,) if on_device else ())


class HostReserve:
    """Page-locked host buffers made before the plan is final, for the store to take (`HostBuffers.reserve`).

    The recompute search knows early how many host buffers of which sizes the final plan needs at least (its tries
    that recompute the most hold the most chunk state on the device, so the fewest on the host: pipeline/
    recompute_search.py `host_hint`); `want` starts zeroing and page-locking that many on `threads` workers while
    the search, lowering and region extraction go on, instead of after them (on the H200 box the page-locking of
    ~100 GiB took 14-27 s after the plan). A buffer is its bytes (uint8), zero-filled; the store views it as its
    dtype. `close` ends the reserve: buffers nobody took are freed (unlocked)."""

    def __init__(self, threads: int, device: torch.device | None = None,
                 lock: Callable[[torch.Tensor], int] = register):
        self.lock, self.huge = lock, huge_pages_wanted()
        self._pool = device_threads(threads, device, "pstar_fx-reserve")
        # (nbytes, page-locked) -> buffers not taken
        self._free: dict[tuple[int, bool], list[tuple[torch.Tensor, Future]]] = {}
        self._wanted: dict[tuple[int, bool], int] = {}
        self.made = self.taken = 0

    def want(self, sizes: dict[int, int], lock: bool = True) -> None:
        """At least `sizes[nbytes]` buffers of each size (more than asked before: the rest are started), page-locked
        or, with `lock=False`, only zeroed (memory nobody copies, e.g. Adam's moments: pipeline/reserve_cache.py)."""
        if self._pool is None:
            return
        for nbytes, count in sizes.items():
            k = (nbytes, lock)
            for _ in range(count - self._wanted.get(k, 0)):
                t = torch.empty(nbytes, dtype=torch.uint8)
                self._free.setdefault(k, []).append((t, self._pool.submit(self._make, t, lock)))
                self.made += 1
            self._wanted[k] = max(count, self._wanted.get(k, 0))

    def _make(self, t: torch.Tensor, lock: bool) -> int:
        _advise_untouched(t, self.huge)
        _first_values(t, 0)
        return self.lock(t) if lock else 0

    def take(self, nbytes: int, lock: bool = True) -> tuple[torch.Tensor, Future] | None:
        """A buffer of exactly `nbytes` (zeroed, and page-locked unless `lock=False`, once its future is done; its
        result: the lock's error code), or None."""
        free = self._free.get((nbytes, lock))
        if not free:
            return None
        self.taken += 1
        return free.pop(0)

    def close(self) -> None:
        """Free the buffers nobody took (those not started are cancelled); the taken ones' work goes on."""
        if self._pool is None:
            return
        for free in self._free.values():
            for t, f in free:
                if not f.cancel():
                    f.result()              # being locked now: unlocked when `t` goes
        self._free.clear()
        self._pool.shutdown(wait=False)     # (the taken buffers' queued work still runs)
        self._pool = None
        if self.made:
            log.info("  host buffers made ready ahead of the plan: %d of %d used", self.taken, self.made)


class HostBuffers:
    """Host buffers; with `pin`, page-locked by `lock` (cudaHostRegister). In a `batch()`, what makes a buffer ready
    (its first values, the lock) runs on `threads` workers."""

    def __init__(self, pin: bool, threads: int = 1, lock: Callable[[torch.Tensor], int] = register,
                 device: torch.device | None = None):
        self.pin, self.threads, self.lock = pin, threads, lock
        self.huge = pin and huge_pages_wanted()
        self.device = device        # the CUDA device whose context locks (a worker thread would default to cuda:0)
        self._pool: ThreadPoolExecutor | None = None
        self._queued: list[Future] = []
        self._pending: dict[int, Future] = {}   # the storages of the buffers queued in this batch -> their work
        self.unlocked: list[int] = []           # error codes of buffers that stayed pageable (batch only)
        self.reserve: HostReserve | None = None  # buffers page-locked ahead (a batch takes zero-filled ones there)
        # (nbytes, page-locked) -> how many zero-filled (or unfilled) buffers a batch handed out: what a reserve
        # could have made ahead (pipeline/reserve_cache.py remembers it for the next compile)
        self.asked: dict[tuple[int, bool], int] = {}

    def empty(self, n: int, dtype: torch.dtype, fill: float | int | None = None, lock: bool = True,
              written_first: bool = False) -> torch.Tensor:
        """A host buffer of n elements; `fill`: its first value everywhere (None: left as allocated). `lock=False`:
        never page-locked (memory no copy to or from the device reads or writes, e.g. a host chunk's moments).
        `written_first`: whoever uses it writes it before reading it (a master the init or a load writes); such an
        unlocked zero-filled buffer of `LAZY_ZERO_BYTES` or more is a fresh anonymous mapping, zero by the kernel's
        contract and touched by nobody here: its pages appear where it is first written, on the threads that write
        it; a smaller one is filled here, never queued, so its writer never waits for the batch. (Memory read
        first, like Adam's moments, would take two faults a page there, a read and a write: those are zeroed ahead,
        as before.)"""
        pin = self.pin and lock
        if written_first and not pin and fill is not None and fill == 0 and n \
                and n * dtype.itemsize >= LAZY_ZERO_BYTES:
            return self._zero_mapping(n, dtype)
        if written_first and not pin:       # (smaller: ready now, never pending: its writer need not wait)
            return self._ready_now(torch.empty(n, dtype=dtype), fill, pin)
        if self._pool is None:
            return self._ready_now(torch.empty(n, dtype=dtype), fill, pin)
        got = None
        if fill in (0, None):               # zeroed is what a reserve makes
            k = (n * dtype.itemsize, pin)
            self.asked[k] = self.asked.get(k, 0) + 1
            got = self.reserve.take(*k) if self.reserve is not None else None
        if got is not None:
            buf, made = got
            t = buf.view(dtype)             # (its bytes, as the dtype asked for)
        else:
            t = torch.empty(n, dtype=dtype)
            made = self._pool.submit(self._ready, t, fill, pin)
        self._queued.append(made)
        self._pending[t.untyped_storage().data_ptr()] = made
        return t

    def pending(self, t: torch.Tensor) -> bool:
        """Whether `t`'s buffer is still queued in the open batch (its workers may yet zero it: write it only once
        the batch has ended)."""
        return t.untyped_storage().data_ptr() in self._pending

    def wait_ready(self, tensors: list[torch.Tensor]) -> None:
        """Wait until those of `tensors` queued in the open batch are ready (filled and page-locked: their
        writers may write them), while the batch goes on with the rest. A lock's error is counted at the batch's
        end, as for every buffer."""
        for t in tensors:
            made = self._pending.get(t.untyped_storage().data_ptr())
            if made is not None:
                made.result()

    def _zero_mapping(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.frombuffer(mmap.mmap(-1, n * dtype.itemsize), dtype=dtype)   # (the tensor keeps the mapping)
        _advise_untouched(t, self.huge)
        return t

    def _ready_now(self, t: torch.Tensor, fill, pin: bool) -> torch.Tensor:
        if self.huge:
            huge_pages(t)
        if fill is not None:
            t.fill_(fill)
        if pin and self.lock(t) != 0:
            return t.pin_memory()       # the allocator's pinned memory still works, only bigger (a power of two)
        return t

    def _ready(self, t: torch.Tensor, fill, pin: bool) -> int:
        if self.huge:
            huge_pages(t)               # before the first touch
        # the first touch of its pages, here rather than in the lock: cudaHostRegister faulting untouched pages in
        # ran at 2.7 GB/s on the H200 box, zeroing and then registering at 13.9 (bench/RESULTS.md, session 11)
        _first_values(t, 0 if fill is None else fill)
        return self.lock(t) if pin else 0

    @property
    def queues(self) -> bool:
        """Whether buffers handed out now are made ready later (in a batch, by its workers)."""
        return self._pool is not None

    @contextlib.contextmanager
    def batch(self, progress: Callable[[int, int], None] | None = None):
        """Buffers handed out in the block are made ready side by side (page-locked buffers only: filling alone gains
        nothing from threads, torch's fill already uses them); all are ready when it ends. `progress(ready, total)`
        is called as they become ready."""
        if self.threads < 2 or not self.pin or self._pool is not None:
            yield self
            return
        self._pool = device_threads(self.threads, self.device, "pstar_fx-pin")
        try:
            yield self
        finally:
            queued, self._queued = self._queued, []
            try:
                for i, f in enumerate(queued):
                    err = f.result()            # the lock's error code (0: locked)
                    if err:
                        self.unlocked.append(err)
                    if progress is not None:
                        progress(i + 1, len(queued))
            finally:
                self._pool.shutdown()
                self._pool = None
                self._pending.clear()
            if self.unlocked:
                log.warning("%d host buffer(s) could not be page-locked (cudaHostRegister error %d): their copies "
                            "to and from the device are synchronous", len(self.unlocked), self.unlocked[0])
