"""shipping: how each chunk's compute copy reaches the device, and what that costs per fetch — a host chunk crosses
as a 16-bit shadow the host Adam keeps, cast on the host, or as its fp32 master cast on the device; a device chunk
does not cross ("-"), and with a compute slot of its own keeps its 16-bit copy from step to step. A frozen host chunk
("frozen") crosses as the weights it holds, already in the compute dtype, and never comes back.
"""
from __future__ import annotations

import torch

from ..config import Config
from ..layout import Layout
from .costs import Rates


def ship_bytes_per_elem(code: str, compute_itemsize: int) -> int:
    """Bytes per parameter that cross host->device for one fetch of a chunk shipped as `code`."""
    return {"-": 0, "shadow": compute_itemsize, "cast": compute_itemsize, "fp32": 4, "frozen": compute_itemsize}[code]


def _choose_shipping(host_frozen: list[bool], config: Config, cs: int, itemsize: int, cuda: bool,
                     host_used_bytes: int) -> list[str]:
    """How the compute copy of an owner's k-th host chunk (`host_frozen[k]`: whether it is frozen) crosses to the
    device. A frozen chunk's weights are its compute copy: they cross as they are ("frozen").

    fp32 compute: the master itself crosses (4 B/param). 16-bit: a host-side 16-bit shadow, written by the
    host Adam in the same pass that updates the master (no extra read), halves the bytes that cross, so
    every host chunk gets one while host memory lasts. Without room, the CUDA runtime ships fp32 and
    casts on the device (a cast on the host would stall the thread that launches GPU work), and the
    CPU runtime casts on the host into a staging buffer.
    """
    n_host = sum(not f for f in host_frozen)
    if itemsize == 4:
        trainable = ["fp32"] * n_host
    else:
        spare_bytes = float("inf") if config.host_memory is None else config.host_memory - host_used_bytes
        shadows = n_host if spare_bytes == float("inf") else max(0, min(n_host, int(spare_bytes // (cs * itemsize))))
        trainable = ["shadow"] * shadows + [fallback_code(itemsize, cuda)] * (n_host - shadows)
    codes = iter(trainable)
    return ["frozen" if f else next(codes) for f in host_frozen]


def fallback_code(itemsize: int, cuda: bool) -> str:
    """How a trainable host chunk without a shadow crosses: its fp32 master (fp32 compute; CUDA, cast there) or a
    cast on the host (the CPU runtime)."""
    return "fp32" if itemsize == 4 or cuda else "cast"


def kept_in_shadow(transaction: str, layout: Layout, host_ids: list[int], *, fp32: bool, world: int) -> bool:
    """Deferred, 16-bit: a host chunk's kept gradient and its shadow are never needed at once (the gradient lands
    after backward's last read of the shadow, and the host Adam reads it where it writes the new 16-bit weights,
    element by element), so one buffer is both and every host chunk crosses in 16 bits for the kept gradient's
    bytes alone."""
    trained = [c for c in host_ids if not layout.chunks[c].frozen]       # a frozen chunk has no gradient to keep
    return (transaction == "deferred" and not fp32 and world == 1 and bool(trained)
            and all(layout.chunks[c].grad_spans() for c in trained))


def ship_codes(tier_of: list[str], host_ship: list[str], *, world: int, rank: int,
               frozen: list[bool], fallback: str) -> tuple[list[str], list[str]]:
    """(each chunk's code at its owner, this rank's view with "remote"): the k-th host chunk of every owner alike,
    but a frozen chunk always crosses as "frozen" (and a trainable one whose rank-0 twin is frozen as `fallback`)."""
    # an owner's k-th host chunk, by its index among the owner's chunks (every owner's host chunks lie alike)
    kth = {j: k for k, j in enumerate(sorted({c // world for c in range(len(tier_of)) if tier_of[c] == "host"}))}

    def code(c: int) -> str:
        if tier_of[c] == "device":
            return "-"
        if frozen[c]:
            return "frozen"
        how = host_ship[kth[c // world]]
        return fallback if how == "frozen" else how

    ship_of = [code(c) for c in range(len(tier_of))]
    return ship_of, [ship_of[c] if c % world == rank else "remote" for c in range(len(tier_of))]


def copy_seconds(ship_of: list[str], cs: int, compute_itemsize: int, rates: Rates,
                 coll_seconds: float) -> dict[int, float]:
    """Seconds to bring each chunk's compute copy to the device: its bytes across, a cast on the device, and
    (chunked) its broadcast from the owner to every rank (`coll_seconds`)."""
    return {c: cs * ship_bytes_per_elem(code, compute_itemsize) / rates.h2d_bw
            + cs * (4 + compute_itemsize) / rates.mem_bw + coll_seconds for c, code in enumerate(ship_of)}


def keeps_compute_copies(n_slots: int, n_chunks: int, world: int, compute_dtype: torch.dtype) -> bool:
    """Whether each device chunk keeps its 16-bit compute copy from step to step: the plan gave every chunk that
    needs one (`n_chunks`: all but the device's frozen chunks, which compute on their own weights) a
    compute slot (none is ever evicted), compute is 16-bit (fp32 device chunks compute on their masters), and
    one rank holds every chunk (partitioned ranks broadcast their compute copies each step). The device Adam
    then writes the copy as it updates the master (+2 B/param written) instead of each step's first fetch
    casting it (6 B/param moved, one launch per chunk)."""
    return compute_dtype.itemsize != 4 and world == 1 and n_slots >= n_chunks > 0
