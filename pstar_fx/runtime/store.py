"""store: the chunks' persistent state on its tier, and every allocation the runtime makes, accounted.

Per chunk, on the tier the plan placed it: the fp32 master, exp_avg and exp_avg_sq (12 B/param; 8 with
Config.optimizer_state "bf16", whose moments are bf16; 6.03 with "int8", whose moments are uint8 codes with two
small fp32 tensors of block scales per chunk, `exp_avg_absmax` and `exp_avg_sq_absmax`: each trained
parameter's blocks (kernels/quant8.py), one parameter's after another in slot order), and for
host chunks that ship 16 bits a 16-bit shadow the host Adam keeps current. A frozen chunk (layout.Chunk.frozen)
holds only its weights, in the compute dtype (2 B/param in bf16/fp16, 4 in fp32), as its `master` entry: there is
no fp32 copy behind them, no moments (None), and nothing ever writes them but a load. A chunk another data-parallel
rank owns ("remote") has no state here: its entries are None. Everything is allocated once,
at start, through `alloc`, which charges the tier's budget; `Pool` hands out equal buffers allocated the
same way (compute slots, gradient slots, host gradient buffers). Host memory is page-locked on CUDA.
"""
from __future__ import annotations

import contextlib
import logging
import queue
from collections import deque
from dataclasses import dataclass

import torch

from ..config import Config, format_bytes
from ..kernels import cast_, quant8
from ..layout import Layout
from ..phases import Phases
from ..planning import Plan
from .host_memory import HostBuffers, HostReserve, pin_threads
from .telemetry import MemoryStats

log = logging.getLogger("pstar_fx")


class Pool:
    """Equal buffers allocated once. `take()` hands one out; `give()` returns it: the one given back last
    first, or with `fifo` the one given back longest ago (a gradient slot whose gradient is still being copied
    out waits behind the others: planning/grad_slots.py). A blocking pool's `take()` waits for a `give()` from
    another thread (the host Adam worker returning a buffer), oldest first."""

    def __init__(self, buffers: list[torch.Tensor], blocking: bool = False, fifo: bool = False):
        self.size = len(buffers)
        self._fifo = fifo
        self._free: queue.Queue | deque = queue.Queue() if blocking else deque()
        for b in buffers:
            self.give(b)

    def take(self) -> torch.Tensor:
        if isinstance(self._free, deque):
            if not self._free:
                raise RuntimeError(f"all {self.size} buffers of a pool are in use: schedule bug")
            return self._free.popleft() if self._fifo else self._free.pop()
        return self._free.get()

    @property
    def free(self) -> int:
        """Buffers not handed out now."""
        return len(self._free) if isinstance(self._free, deque) else self._free.qsize()

    def give(self, buf: torch.Tensor) -> None:
        if isinstance(self._free, deque):
            self._free.append(buf)
        else:
            self._free.put(buf)


@dataclass(frozen=True)
class ChunkState:
    """One chunk's persistent state as its update, undo and correction read and write it."""
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    absmax: tuple[torch.Tensor, torch.Tensor] | None   # int8 moments: their block scales (exp_avg's, exp_avg_sq's)
    shadow: torch.Tensor | None                          # its 16-bit copy, which every update keeps current
    grad_spans: list[tuple[int, int]]                    # where its gradients lie: what an undo runs over
    update_spans: list[tuple[int, int]]                  # what an update runs over (one span per parameter: int8)


def master_crosses(plan: Plan, c: int) -> bool:
    """Whether a copy to the device reads host chunk c's master itself (so it is page-locked): fp32 shipping, or a
    frozen chunk's weights. A 16-bit shadow crosses instead of the master, or a host-side cast of it
    (movers.Mover._copy_in); a trainable chunk's moments never cross."""
    return plan.ship[c] in ("fp32", "frozen")


def host_buffer_sizes(layout: Layout, plan: Plan, config: Config, compute_dtype: torch.dtype) -> dict[int, int]:
    """Bytes -> count of the zero-filled, page-locked host buffers `ChunkStore` allocates for `plan`'s host chunks:
    each frozen chunk's weights, each trainable chunk's fp32 master where it crosses itself (`master_crosses`).
    What `HostReserve.want` makes ahead (the 16-bit shadows are left out: how many depends on the final plan's
    shipping; the moments are never locked)."""
    cs, sizes = layout.chunk_size, {}
    for c, tier in enumerate(plan.placement):
        if tier != "host" or not master_crosses(plan, c):
            continue
        b = cs * compute_dtype.itemsize if layout.chunks[c].frozen else layout.state_elems * 4
        sizes[b] = sizes.get(b, 0) + 1
    return sizes


class ChunkStore:
    def __init__(self, layout: Layout, plan: Plan, config: Config, device: torch.device,
                 compute_dtype: torch.dtype, stats: MemoryStats, ready_later: bool = False,
                 reserve: HostReserve | None = None):
        self.layout, self.plan, self.config = layout, plan, config
        self.device, self.host = device, torch.device("cpu")
        self.compute_dtype = compute_dtype
        self.stats = stats
        self._pin = device.type == "cuda"
        self._host = HostBuffers(self._pin, pin_threads(), device=device)
        self._host.reserve = reserve            # host buffers page-locked while the plan was made (host_memory.py)
        self._ptrs: set[int] = set()
        self.quantized = config.optimizer_state == "int8"
        self.grad_spans = [ch.grad_spans() for ch in layout.chunks]
        # int8 moments are quantized a parameter at a time: an update runs one span per parameter
        self._update_spans = [ch.param_spans() for ch in layout.chunks] if self.quantized else self.grad_spans
        self.master, self.exp_avg, self.exp_avg_sq = [], [], []
        self.exp_avg_absmax: list[torch.Tensor | None] = []     # int8 only: the block scales
        self.exp_avg_sq_absmax: list[torch.Tensor | None] = []
        # int8: where parameter i's scales lie in its chunk's (slot order, each parameter's own blocks)
        self._scales_at: dict[int, slice] = {}
        for ch in layout.chunks:
            at = 0
            for slot in ch.slots:
                if slot.param.has_grad:
                    self._scales_at[slot.index] = slice(at, at + quant8.blocks(slot.numel))
                    at += quant8.blocks(slot.numel)
        # host buffers are filled and page-locked by threads side by side (runtime/host_memory.py): all ready when
        # `ready()` returns, at once unless `ready_later` (the engine builds the regions meanwhile)
        self._pin_phase = "allocate"
        self._allocating = contextlib.ExitStack()
        self._allocating.enter_context(self._host.batch(lambda done, total: Phases.progress(self._pin_phase, done,
                                                                                            total)))
        try:
            self._allocate_state()
        except BaseException:
            self._allocating.close()
            raise
        if not ready_later:
            self.ready()

    @property
    def pinning(self) -> bool:
        """Whether host buffers are still being made ready (page-locked) on threads: `ready()` waits for them."""
        return self._host.queues

    @property
    def host_asked(self) -> dict[tuple[int, bool], int]:
        """(bytes, page-locked) -> how many zero-filled host buffers the store allocated in its batch (what a
        reserve can make ahead: pipeline/reserve_cache.py)."""
        return dict(self._host.asked)

    def masters_pending(self) -> bool:
        """Whether a master is a host buffer still being made ready (zeroed and page-locked: one that crosses to the
        device as it is): the init must wait for `ready()` before it writes the masters. Other masters (device ones,
        host ones whose 16-bit shadow crosses instead) can be written while the rest is page-locked."""
        return any(m is not None and self._host.pending(m) for m in self.master)

    def masters_ready(self) -> None:
        """Wait until every master still being made ready is (zeroed and page-locked); the batch's other buffers
        (the moments, the shadows) go on meanwhile. The init may then write the masters."""
        self._host.wait_ready([m for m in self.master if m is not None])

    def ready(self, phase: str | None = None) -> None:
        """Wait until every host buffer handed out so far is filled and page-locked (a no-op when they are);
        `phase`: the compile phase its progress is reported under meanwhile. Nothing reads or writes chunk
        memory before this returns, except the init writing masters `masters_ready` said were ready."""
        if phase is not None:
            self._pin_phase = phase
        self._allocating.close()

    def _allocate_state(self) -> None:
        layout, plan, config, compute_dtype = self.layout, self.plan, self.config, self.compute_dtype
        cs, n = layout.chunk_size, len(layout.chunks)
        # every master first, then the moments: a batch's workers make its buffers ready in the order they are
        # asked for, and the init waits only for the masters it writes (`masters_ready`), not for the moments'
        # zeroing (an H100's warm GPT3_18B: 6.2 s of page-locking and zeroing, then the init's 4.6 s after it)
        for c in range(n):
            tier = self.tier(c)
            if tier == "remote":
                self.master.append(None)
            elif layout.chunks[c].frozen:
                self.master.append(self.alloc(tier, cs, compute_dtype, zero=True))
            else:
                # a host chunk's state is page-locked only where a copy reads it: its master when the master itself
                # crosses (`master_crosses`); its moments never (the host Adam alone reads them). The init or a
                # load writes every master before anything reads it
                self.master.append(self.alloc(tier, layout.state_elems, torch.float32, zero=True,
                                              lock=master_crosses(plan, c), written_first=True))
        for c in range(n):
            tier = self.tier(c)
            if tier == "remote" or layout.chunks[c].frozen:
                for state in (self.exp_avg, self.exp_avg_sq, self.exp_avg_absmax, self.exp_avg_sq_absmax):
                    state.append(None)
                continue
            se = layout.state_elems         # (a trainable chunk's state: the chunk size, or less beside frozen ones)
            # int8: the code of 0 (the unsigned one is 0)
            self.exp_avg.append(self.alloc(tier, se, config.moment_dtype,
                                           fill=quant8.SIGNED_ZERO if self.quantized else 0, lock=False))
            self.exp_avg_sq.append(self.alloc(tier, se, config.moment_dtype, zero=True, lock=False))
            if self.quantized:
                blocks = quant8.blocks_of(layout.chunks[c].param_spans())
                self.exp_avg_absmax.append(self.alloc(tier, blocks, torch.float32, zero=True, lock=False))
                self.exp_avg_sq_absmax.append(self.alloc(tier, blocks, torch.float32, zero=True, lock=False))
            else:
                self.exp_avg_absmax.append(None)
                self.exp_avg_sq_absmax.append(None)
            if not self._host.queues:           # (else the batch counts the buffers it makes ready)
                Phases.progress("allocate", c + 1, n)
            if n >= 20 and (c + 1) % (n // 10) == 0:    # page-locking 100 GiB of host state takes a minute
                log.info("  chunk state allocated for %d of %d chunks (%s on the host)", c + 1, n,
                         format_bytes(self.stats.host_bytes))
        # 16-bit copies that every update keeps current (Adam, its undo and its correction write them in the
        # same pass): of host chunks that ship 16 bits (plan.ship == "shadow"), on the host; and, when every
        # chunk has a compute slot for good (plan.keeps_compute_copies), of every device chunk, on the device,
        # where the copy *is* the chunk's compute copy and takes the place of a slot: no fetch casts its master
        # again
        self.shadow = {c: self.alloc("host", cs, compute_dtype) for c, how in enumerate(plan.ship)
                       if how == "shadow"}
        if plan.keeps_compute_copies:
            self.shadow.update({c: self.alloc("device", cs, compute_dtype) for c in range(n)
                                if self.tier(c) == "device" and not layout.chunks[c].frozen})

    def tier(self, c: int) -> str:
        return self.plan.placement[c]

    def frozen(self, c: int) -> bool:
        """Whether chunk c is frozen: its `master` is its weights in the compute dtype, and it has no moments."""
        return self.layout.chunks[c].frozen

    def holds(self, c: int) -> bool:
        """Whether chunk c's state is on this rank (always, without chunk-partitioned data parallelism)."""
        return self.plan.placement[c] != "remote"

    def alloc(self, tier: str, n: int, dtype: torch.dtype, zero: bool = False,
              fill: float | int | None = None, lock: bool = True, written_first: bool = False) -> torch.Tensor:
        """A persistent buffer on `tier` ("device" or "host"), charged against that tier's budget; zeroed, or
        filled with `fill`, or left as allocated. A host one is page-locked on CUDA (runtime/host_memory.py) unless
        `lock=False` (no copy to or from the device touches it); `written_first`: its users write it before they
        read it (HostBuffers.empty may then leave it untouched)."""
        on_device = tier == "device"
        self.stats.charge(tier, n * dtype.itemsize, self.config.device_memory if on_device else self.config.host_memory)
        fill = 0 if zero else fill
        if on_device:
            t = torch.empty(n, dtype=dtype, device=self.device)
            if fill is not None:
                t.fill_(fill)
        else:
            t = self._host.empty(n, dtype, fill, lock=lock, written_first=written_first)
        self._ptrs.add(t.untyped_storage().data_ptr())
        return t

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """Account a persistent device tensor allocated elsewhere (the model's buffers)."""
        self.stats.charge("device", t.untyped_storage().nbytes(), self.config.device_memory)
        self._ptrs.add(t.untyped_storage().data_ptr())
        return t

    def owns(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._ptrs

    # ---- weights in and out --------------------------------------------------------------------------
    def load_params(self, tensors: list[torch.Tensor]) -> None:
        for slot, t in zip(self.layout.slots, tensors):
            if self.holds(slot.chunk):
                self.master[slot.chunk][slot.offset: slot.offset + slot.numel].copy_(t.detach().reshape(-1))

    def masters_changed(self, chunks=None) -> None:
        """The fp32 masters were written outside Adam (loading, initialization, a rollback): refresh the shadows."""
        for c, shadow in self.shadow.items():
            if chunks is None or c in chunks:
                master = self.master[c]
                cast_(shadow[: master.numel()], master)     # (a trainable chunk's master may be shorter)

    def state(self, c: int) -> ChunkState:
        """Chunk c's state, as one record (built on each call: its tensors are the store's, whatever replaced them)."""
        return ChunkState(self.master[c], self.exp_avg[c], self.exp_avg_sq[c], self.absmax(c), self.shadow.get(c),
                          self.grad_spans[c], self._update_spans[c])

    def absmax(self, c: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Chunk c's block scales (exp_avg's, exp_avg_sq's) with int8 moments; None otherwise."""
        return (self.exp_avg_absmax[c], self.exp_avg_sq_absmax[c]) if self.quantized else None

    # ---- a parameter's moments, by key "exp_avg" or "exp_avg_sq" ------------------------------------------
    def moment(self, index: int, key: str) -> torch.Tensor:
        """Parameter `index`'s moment as its chunk stores it (fp32 or bf16 values, or int8 codes): a view."""
        slot = self.layout.slots[index]
        return getattr(self, key)[slot.chunk][slot.offset: slot.offset + slot.numel].view(slot.param.shape)

    def moment_absmax(self, index: int, key: str) -> torch.Tensor:
        """int8: parameter `index`'s block scales of that moment (a view)."""
        return getattr(self, f"{key}_absmax")[self.layout.slots[index].chunk][self._scales_at[index]]

    def moment_fp32(self, index: int, key: str) -> torch.Tensor:
        """The moment's values in fp32: a view (fp32), or new (bf16 widened; int8 dequantized)."""
        m = self.moment(index, key)
        if not self.quantized:
            return m if m.dtype == torch.float32 else m.float()
        values = quant8.dequantize(m.reshape(-1), self.moment_absmax(index, key), signed=key == "exp_avg")
        return values.view(m.shape)

    def set_moment(self, index: int, key: str, values: torch.Tensor | None) -> None:
        """Write the moment from fp32 values (None: zero): bf16 rounds them, int8 quantizes them."""
        m = self.moment(index, key)
        if not self.quantized:
            m.zero_() if values is None else m.copy_(values.reshape(m.shape))
            return
        signed = key == "exp_avg"
        if values is None:
            m.fill_(quant8.SIGNED_ZERO if signed else quant8.UNSIGNED_ZERO)
            self.moment_absmax(index, key).zero_()
            return
        codes, absmax = quant8.quantize(values.reshape(-1).to(m.device, torch.float32), signed)
        m.copy_(codes.view(m.shape))
        self.moment_absmax(index, key).copy_(absmax)

    def param_fp32(self, index: int) -> torch.Tensor:
        """Parameter `index`'s fp32 master (a view); a frozen parameter's weights, in the compute dtype."""
        slot = self.layout.slots[index]
        if not self.holds(slot.chunk):
            raise RuntimeError(f"{slot.param.name} is in chunk {slot.chunk}, which rank {self.plan.owner(slot.chunk)} "
                               f"holds, not this one (rank {self.plan.rank})")
        return self.master[slot.chunk][slot.offset: slot.offset + slot.numel].view(slot.param.shape)

