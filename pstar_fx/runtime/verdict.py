"""verdict: the step's global gradient norm and finiteness, measured on the device as gradients are produced.

Device and host chunks alike are measured before a host chunk's gradient leaves the device, so the verdict
costs one read of each gradient and one sync per step — never one per chunk, and never a wait for the host
worker. With chunk-partitioned data parallelism each rank measures the chunks it owns and the per-parameter
vector is summed over the ranks, one all-reduce per step.
It is kept per parameter, not per chunk: each parameter's squared norm is a function of its own gradient
elements only (`kernels.sq_norms`), written into a float64 vector indexed like `Capture.params`, and added up
exactly (`exact_sum`). So the norm, the clip coefficient and the weights have the same bits at any chunk size or
placement, and a checkpoint resumed elsewhere goes on bit for bit (CPU). On CUDA an accumulating step's host
chunks are measured on the host (C++) and its device chunks on the device (Triton), which round differently.
Updates are applied only with finite gradients: the device flag `found_inf` gates the Triton Adam; a host
chunk's finiteness crosses to the host in the same copy as its gradient and gates the C++ Adam, which so needs
no non-finite pass of its own (2 of the 30 bytes per parameter it would move). A rollback never meets a NaN.
"""
from __future__ import annotations

import math

import torch

from ..kernels import sq_norms
from ..layout import Layout


def exact_sum(squares: list[float]) -> float:
    """The correctly rounded sum of nonnegative float64 terms: one value whatever their order (inf on overflow,
    nan with a nan among them)."""
    try:
        return math.fsum(squares)
    except OverflowError:
        return math.inf


class Verdict:
    """The per-parameter squared norms of the step's gradient and the finiteness flags that gate its updates."""

    def __init__(self, layout: Layout, device: torch.device, dp=None):
        self.dp = dp                                   # partitioned data parallelism: the vector is summed over ranks
        # per chunk, the parameters it updates: where their gradients lie, and their index in Capture.params
        graded = [[s for s in ch.slots if s.param.has_grad] for ch in layout.chunks]
        self._segments = [[(s.offset, s.numel) for s in g] for g in graded]
        self._params = [[s.index for s in g] for g in graded]
        self._param_index = [torch.tensor(ix, dtype=torch.long, device=device) for ix in self._params]
        n = len(layout.chunks)
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)   # gates this update and every later one
        # what gates the updates after a finite verdict (a deferred step's, on their own stream): never written, so
        # the next step's `reset` of found_inf does not race them
        self.none_found = torch.zeros(1, dtype=torch.float32, device=device)
        # per chunk, whether its gradient measured finite on the device, and its copy on the host that lands with
        # a host chunk's gradient (persistent: the copy stream reads it after the compute stream moved on)
        self._finite_dev = torch.zeros(n, dtype=torch.float32, device=device)
        self._finite_host = torch.zeros(n, dtype=torch.float32, pin_memory=device.type == "cuda")
        self._sq = torch.zeros(len(layout.slots), dtype=torch.float64, device=device)   # per parameter
        self._flag_after = torch.zeros(n, dtype=torch.float32, device=device)   # found_inf after chunk c's update

    def reset(self) -> None:
        """A new pass: nothing measured, nothing found non-finite."""
        self.found_inf.zero_()
        self._sq.zero_()

    def add(self, t: torch.Tensor, c: int) -> torch.Tensor:
        """Chunk c's parameters' squared norms (of `t`, chunk-shaped) into the vector; returns their sum, for the
        finiteness gate only (its rounding depends on the chunk's make-up; the verdict's does not)."""
        sq = sq_norms(t, self._segments[c])
        self._sq.index_copy_(0, self._param_index[c], sq)
        return sq.sum()

    def gate(self, sq: torch.Tensor) -> None:
        """A non-finite sum sets `found_inf`, which skips this device update and every later one."""
        self.found_inf.add_((~torch.isfinite(sq)).float())

    def measure_offload(self, c: int, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A host chunk's gradient, still on the device: measured here. Returns (whether it is finite, on the
        device; its host flag), for the offload to copy down beside the gradient."""
        sq = self.add(buf, c)
        self._finite_dev[c:c + 1].copy_(torch.isfinite(sq).reshape(1))
        return self._finite_dev[c:c + 1], self._finite_host[c:c + 1]

    def host_finite(self, c: int) -> bool:
        """Whether host chunk c's gradient measured finite on the device (its flag has landed with it)."""
        return bool(self._finite_host[c])

    def host_squares(self, c: int, grad: torch.Tensor) -> list[tuple[int, float]]:
        """(parameter, squared norm) of a host chunk's gradient measured on the host (an accumulated one)."""
        return list(zip(self._params[c], sq_norms(grad, self._segments[c]).tolist()))

    def launched(self, c: int, found_inf: torch.Tensor | None = None) -> None:
        """Device chunk c's update was launched: record whether `found_inf` (the step's, unless given) let it apply."""
        self._flag_after[c:c + 1].copy_(self.found_inf if found_inf is None else found_inf)

    def applied(self, device_chunks: list[int]) -> list[int]:
        """Of the device chunks whose update was launched, those it applied (a sync)."""
        flags = self._flag_after.tolist() if device_chunks else []
        return [c for c in device_chunks if flags[c] == 0]

    def total(self, host_sq: dict[int, float]) -> float:
        """The global sum of squared gradient entries (`host_sq`: parameters measured on the host): one sync."""
        per_param = self._sq.tolist()                      # the step's one sync
        for i, sq in host_sq.items():
            per_param[i] = sq
        if self.dp is not None:
            # partitioned: each parameter's square is measured by its chunk's owner alone (zero elsewhere), so
            # the sum over ranks adds it to zeros: exact, and the same vector on every rank
            per_param = self.dp.sum_(torch.tensor(per_param, dtype=torch.float64)).tolist()
        return exact_sum(per_param)
