"""telemetry: what the runtime measured — bytes per tier and bytes moved, and seconds per step by phase."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

from torch.profiler import record_function

from ..config import format_bytes


@dataclass
class MemoryStats:
    device_bytes: int = 0
    host_bytes: int = 0
    device_peak_bytes: int = 0
    host_peak_bytes: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    coll_bytes: int = 0      # bytes this rank's collectives sent or received (chunk broadcasts and reduces)

    def charge(self, tier: str, nbytes: int, budget: int | None) -> None:
        """Count a persistent allocation on `tier` ("device" or "host"), refusing one over the budget."""
        total = getattr(self, f"{tier}_bytes") + nbytes
        if budget is not None and total > budget:
            raise MemoryError(f"{tier} tier over budget: {format_bytes(total)} > {tier}_memory {format_bytes(budget)}")
        setattr(self, f"{tier}_bytes", total)
        setattr(self, f"{tier}_peak_bytes", max(getattr(self, f"{tier}_peak_bytes"), total))


# The launching thread's waits on the host (`wait_for_*`) are its own time: while it waits, the GPU runs what was
# queued before, so they are not the GPU's idle time. On CUDA each such wait also has its `gpu_idle_for_*` reading:
# a timing event on the compute stream as the wait begins and one as it ends — nothing is queued between them, so
# the stream reaches the second as soon as it is recorded, and the time between the two is the compute stream's
# idle time the wait caused (0 when the queued work outlasted it; launch latency aside).
HOST_WAITS = {"wait_for_host_grad_buffer": "gpu_idle_for_host_grad_buffer",
              "wait_for_host_adam": "gpu_idle_for_host_adam"}
PHASES = ("compute_waits_for_copies", "host_adam", "wait_for_host_grad_buffer", "wait_for_host_adam", "correction",
          *HOST_WAITS.values())


class Telemetry:
    """Seconds per phase, summed over steps; `per_step()` averages them. On CUDA the compute stream's
    stalls are timing-event pairs, added up once their events have completed (no sync for that)."""

    def __init__(self):
        self.stats = MemoryStats()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        # whole host Adam updates (no correction, no update in parts): parameters updated and the seconds they
        # took, the host Adam's rate as training runs it (host_rate.py)
        self.adam_elems = 0
        self.adam_seconds = 0.0
        self._stalls: list = []
        # on CUDA (movers.CudaCopies): records a timing event on the compute stream and returns it
        self.mark: Callable[[], object] | None = None

    def count_step(self) -> None:
        self.steps += 1

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def adam_done(self, elems: int, seconds: float) -> None:
        """A whole host Adam update of `elems` parameters took `seconds` (its time is also in "host_adam")."""
        self.adam_elems += elems
        self.adam_seconds += seconds

    @contextlib.contextmanager
    def host_wait(self, phase: str):
        """Time a wait of the launching thread (a `HOST_WAITS` phase) and, on CUDA, the compute stream's idle time
        it caused."""
        before = self.mark() if self.mark is not None else None
        t0 = time.perf_counter()
        try:
            with record_function(f"pstar_fx.{phase}"):     # (named in a profiler trace: bench/copy_waits.py)
                yield
        finally:
            self.add(phase, time.perf_counter() - t0)
            if before is not None:
                self.stall(before, self.mark(), HOST_WAITS[phase])

    def stall(self, before, after, phase: str = "compute_waits_for_copies") -> None:
        self._stalls.append((before, after, phase))

    def count_stalls(self) -> None:
        pending = []
        for before, after, phase in self._stalls:
            if after.query():
                self.seconds[phase] += before.elapsed_time(after) / 1e3
            else:
                pending.append((before, after, phase))
        self._stalls = pending

    def per_step(self) -> dict[str, float]:
        self.count_stalls()
        n = max(1, self.steps)
        return {k: round(v / n, 4) for k, v in self.seconds.items()}
