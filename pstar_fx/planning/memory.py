"""memory: what the step's memory is made of, in bytes — the allocator's constants, the budget the plan may fill,
the byte sizes every stage shares (`StepBytes`), and the device and host breakdowns the peaks are the sums of.

The model counts what the runtime counts: chunk memory allocated once at start, buffers, and the live values of
the graph (inputs, activations kept for backward, temporaries; liveness.py), each from the moment it is produced
to its last use. Views cost nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..config import Config
from ..fxutil import role_nodes, value_bytes
from ..kernels import quant8
from ..layout import Layout
from .costs import Rates

CUDA_BLOCK_BYTES = 512    # the CUDA caching allocator rounds every allocation up to this
CUDA_STEP_SLACK_BYTES = 2 * 2**20   # a step's small allocations outside the graph: norm partials, flags, checks
# Kernels that allocate more than their output's shape says (CPU mse_loss returns its 0-d loss on a
# batch-sized buffer)
CPU_STEP_SLACK_BYTES = 4096
# Not counted in the peak (the allocator's allocated bytes) but kept free of the budget: what the caching
# allocator's segments lose to fragmentation, and what the CUDA context grows by after compile (kernel modules
# load at first use; the budget is the free memory read at compile). Plans closer to the GPU's free memory ran
# out in their first step (bench/RESULTS.md, "the CUDA reserve").
CUDA_FRAGMENTATION_RESERVE_BYTES = 768 * 2**20
# A host chunk shipped as its fp32 master crosses into a device staging buffer piece by piece, each piece cast into
# the compute slot before the next lands (one stream: nothing overlaps that did before). 64M values (256 MiB): a
# whole L99 chunk's staging was 1.75 GiB of device memory; the casts between pieces cost ~2% of the copy's time.
COPY_STAGING_ELEMS = 1 << 26
# Host memory of a CUDA process besides what the plan counts (chunks, shadows, staging, kept gradients): the CUDA
# context, libraries, Python and the graphs. Measured on the H200 box (host max RSS less the runtime's host chunk
# bytes, bench/results/2026-12-0*-h200*.jsonl): 1.3-1.7 GiB for GPTs of 10B and 8B, 1.4-2.2 GiB at 18B, 2.0 GiB for
# Hugging Face's Llama at 8B. 3 GiB keeps 0.8 GiB above the largest; 4 GiB left h4096 L99 with fp32 state one
# chunk short of fitting 110 GiB of host.
CUDA_HOST_OVERHEAD_BYTES = 3 * 2**30


def usable_budget(budget: int | None, cuda: bool) -> int | None:
    """The device budget the plan may fill: on CUDA less a reserve for fragmentation (1/64 of a small one)."""
    if budget is None or not cuda:
        return budget
    return budget - min(CUDA_FRAGMENTATION_RESERVE_BYTES, budget // 64)


def _max_overlap(intervals: list[tuple[int, int]]) -> int:
    """The most intervals (first, last node, inclusive) open at one node."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e + 1, -1) for _, e in intervals])
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


@dataclass(frozen=True)
class StepBytes:
    """The byte sizes the stages share, for one layout, config and graph."""
    activation_peak_bytes: int     # live graph values at their peak (liveness.activation_profile)
    buffer_bytes: int              # the model's buffers, on the device
    compute_chunk_bytes: int       # one chunk in the compute dtype: a compute slot, a shadow, a frozen chunk
    # one trainable chunk's gradient in the compute dtype: a gradient slot, a kept gradient, a host gradient
    # buffer. As long as a compute slot, or shorter beside frozen chunks (Layout.state_elems): a 70B LoRA's
    # gradient buffers held 1.1 G elements for the 207 M its adapters have
    grad_chunk_bytes: int
    accum_bytes: int               # one chunk's fp32 gradient accumulator (grad_accum > 1), on its tier
    state_bytes: int               # one chunk's state: master, moments (+ int8 scales), accumulator
    workspace_bytes: int           # the libraries' workspaces and the step's small allocations
    device_staging_bytes: int      # CUDA, 16-bit compute: an fp32 buffer to cast in, when any chunk is on the host
    batch_rest_bytes: int          # grad_accum > 1: the micro-batches the graph does not see, held all step
    host_overhead_bytes: int       # CUDA: the process's host memory besides chunks
    kept_staging_bytes: int        # CPU, 16-bit compute, kept gradients: the one cast staging buffer still held
    host_staging_bytes: int        # 2 host buffers in the compute dtype, plus the process overhead
    frozen: tuple[bool, ...] = ()  # per chunk: a frozen chunk (layout.Chunk.frozen) holds only its weights
    world: int = 1                 # chunk c is owned by rank c % world
    # the chunks a rank owns, by their index among its own, in the order they take the device (placement.py
    # `device_order`; empty: in chunk order, the host holding the last ones)
    order: tuple[int, ...] = ()

    @property
    def frozen_chunk_bytes(self) -> int:
        """A frozen chunk's whole state: its weights in the compute dtype (no master, moments or accumulator)."""
        return self.compute_chunk_bytes

    def chunk_bytes(self, c: int) -> int:
        """Chunk c's persistent bytes on its tier: state (trainable) or weights (frozen)."""
        return self.frozen_chunk_bytes if self.frozen[c] else self.state_bytes

    def _owned(self, rank: int) -> list[int]:
        owned = list(range(rank, len(self.frozen), self.world))
        return [owned[j] for j in self.order if j < len(owned)] if self.order else owned

    def first_bytes(self, k: int) -> int:
        """The persistent bytes of the first `k` chunks a rank owns in device order (the device's), the most over the
        ranks."""
        return max(sum(self.chunk_bytes(c) for c in self._owned(r)[:k]) for r in range(self.world))

    def rest_bytes(self, k: int) -> int:
        """The persistent bytes of the chunks a rank owns after its first `k` in device order (the host's), the most
        over the ranks."""
        return max(sum(self.chunk_bytes(c) for c in self._owned(r)[k:]) for r in range(self.world))

    def split(self, chunks) -> tuple[int, int, int]:
        """(trainable chunks, their state bytes, frozen chunks' bytes) among `chunks`."""
        trainable = [c for c in chunks if not self.frozen[c]]
        n_frozen = len(chunks) - len(trainable)
        return len(trainable), len(trainable) * self.state_bytes, n_frozen * self.frozen_chunk_bytes

    def device_fixed_bytes(self, n_grad_slots: int) -> int:
        """Device bytes besides chunk state and compute slots."""
        return (self.activation_peak_bytes + self.buffer_bytes + n_grad_slots * self.grad_chunk_bytes
                + self.workspace_bytes + self.batch_rest_bytes)


def copy_staging_elems(chunk_elems: int) -> int:
    """fp32 values of the device staging buffer that fp32-shipped host chunks cross through (COPY_STAGING_ELEMS)."""
    return min(chunk_elems, COPY_STAGING_ELEMS)


def step_bytes(g: fx.Graph, layout: Layout, config: Config, *, compute_itemsize: int, buffer_bytes: int,
               activation_peak_bytes: int, rates: Rates, cuda: bool, world: int = 1) -> StepBytes:
    cs = layout.chunk_size
    accum_bytes = layout.state_elems * 4 if config.grad_accum > 1 else 0     # (trainable chunks only)
    # int8 moments: their block scales, as many as the chunk with the most blocks (each parameter's own) needs
    scale_blocks = max((quant8.blocks_of(ch.param_spans()) for ch in layout.chunks), default=0)
    # the libraries' workspaces (cuBLAS keeps one per handle for the process's life), measured with the rates
    workspace_bytes = rates.workspace_bytes + CUDA_STEP_SLACK_BYTES if cuda else CPU_STEP_SLACK_BYTES
    # an accumulating step holds its whole batch (grad_accum micro-batches) while the graph sees one
    batch_rest_bytes = (config.grad_accum - 1) * sum(value_bytes(n.meta.get("val"), CUDA_BLOCK_BYTES if cuda else 1)
                                                     for n in role_nodes(g, "input"))
    # with any chunk on the host: CUDA keeps at least 2 gradient buffers (it never casts on the host);
    # the CPU runtime 1 gradient buffer and 1 cast staging buffer. Kept gradients need no gradient buffer (each
    # lands in its own): then only the CPU runtime's cast staging (16-bit compute) is held back
    host_overhead_bytes = CUDA_HOST_OVERHEAD_BYTES if cuda else 0
    grad_chunk_bytes = layout.state_elems * compute_itemsize
    return StepBytes(
        activation_peak_bytes=activation_peak_bytes, buffer_bytes=buffer_bytes,
        compute_chunk_bytes=cs * compute_itemsize, grad_chunk_bytes=grad_chunk_bytes, accum_bytes=accum_bytes,
        state_bytes=config.chunk_state_bytes(layout.state_elems, scale_blocks) + accum_bytes,
        workspace_bytes=workspace_bytes,
        device_staging_bytes=copy_staging_elems(cs) * 4 if (cuda and compute_itemsize != 4) else 0,
        batch_rest_bytes=batch_rest_bytes,
        host_overhead_bytes=host_overhead_bytes,
        kept_staging_bytes=0 if cuda or compute_itemsize == 4 else cs * compute_itemsize,
        host_staging_bytes=(2 * grad_chunk_bytes if cuda else grad_chunk_bytes + cs * compute_itemsize)
        + host_overhead_bytes,
        frozen=tuple(ch.frozen for ch in layout.chunks), world=world)


def device_breakdown(sizes: StepBytes, *, device_chunks: list[int], n_slots: int, n_grad_slots: int,
                     host_ship: list[str], chunk_elems: int, fp32: bool) -> dict[str, int]:
    """Device bytes by kind (their sum is the device peak), before kept gradients (`with_kept_on_device`).
    `device_chunks`: the chunks whose state the device holds (rank 0's). Trainable chunks' state and frozen
    chunks' weights are apart."""
    n_device, state_bytes, frozen_bytes = sizes.split(device_chunks)
    device = {
        "activations": sizes.activation_peak_bytes,
        "buffers": sizes.buffer_bytes,
        "chunk state": state_bytes,
        "compute slots": n_slots * sizes.compute_chunk_bytes,
        "gradient slots": n_grad_slots * sizes.grad_chunk_bytes,
    }
    if frozen_bytes:
        device["frozen chunks"] = frozen_bytes
    if sizes.workspace_bytes:
        device["workspace margin"] = sizes.workspace_bytes
    if sizes.batch_rest_bytes:
        device["other micro-batches"] = sizes.batch_rest_bytes
    if not fp32 and "fp32" in host_ship:
        device["copy staging"] = copy_staging_elems(chunk_elems) * 4   # fp32-shipped chunks: cast on the device
    if sizes.accum_bytes:
        device["gradient accumulators"] = n_device * sizes.accum_bytes
        device["chunk state"] -= n_device * sizes.accum_bytes
    return device


def host_breakdown(sizes: StepBytes, *, host_chunks: list[int], n_host_grad_buffers: int, host_ship: list[str],
                   kept_in_shadow: bool, kept_bytes: int) -> dict[str, int]:
    """Host bytes by kind (their sum is the host peak), with every kept gradient on the host. `host_chunks`: the
    chunks whose state the host holds (rank 0's)."""
    n_host, state_bytes, frozen_bytes = sizes.split(host_chunks)
    host = {
        "process overhead": sizes.host_overhead_bytes,
        "chunk state": state_bytes,
        # (kept in a shadow, a host chunk's gradient is counted once, as a kept gradient)
        "16-bit shadows": 0 if kept_in_shadow else host_ship.count("shadow") * sizes.compute_chunk_bytes,
        # gradients of host chunks queue here for the host Adam (CUDA: while backward goes on)
        "gradient staging": sizes.grad_chunk_bytes * n_host_grad_buffers,
        "cast staging": sizes.compute_chunk_bytes if "cast" in host_ship else 0,
        "kept gradients": kept_bytes,
    }
    if frozen_bytes:
        host["frozen chunks"] = frozen_bytes
    if sizes.accum_bytes:
        host["gradient accumulators"] = n_host * sizes.accum_bytes
        host["chunk state"] -= n_host * sizes.accum_bytes
    return host


def with_kept_on_device(device: dict[str, int], host: dict[str, int], device_peak_adds: int,
                        moved_bytes: int) -> tuple[dict[str, int], dict[str, int]]:
    """The breakdowns with `moved_bytes` of the device chunks' kept gradients moved from the host to the device, where
    they add `device_peak_adds` to the peak: as much, allocated for the whole step; less, allocated in backward's
    freed activations (`Transaction.kept_in_activations`)."""
    device = {**device, "kept gradients": device_peak_adds}
    host = {**host, "kept gradients": host["kept gradients"] - moved_bytes}
    return device, host
