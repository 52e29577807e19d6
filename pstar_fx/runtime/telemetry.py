"""telemetry: what the runtime measured — bytes per tier and bytes moved, and seconds per step by phase."""
from __future__ import annotations

from dataclasses import dataclass

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


PHASES = ("compute_waits_for_copies", "host_adam", "wait_for_host_grad_buffer", "wait_for_host_adam", "correction")


class Telemetry:
    """Seconds per phase, summed over steps; `per_step()` averages them. On CUDA the compute stream's
    stalls are timing-event pairs, added up once their events have completed (no sync for that)."""

    def __init__(self):
        self.stats = MemoryStats()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._stalls: list = []

    def count_step(self) -> None:
        self.steps += 1

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def stall(self, before, after) -> None:
        self._stalls.append((before, after))

    def count_stalls(self) -> None:
        pending = []
        for before, after in self._stalls:
            if after.query():
                self.seconds["compute_waits_for_copies"] += before.elapsed_time(after) / 1e3
            else:
                pending.append((before, after))
        self._stalls = pending

    def per_step(self) -> dict[str, float]:
        self.count_stalls()
        n = max(1, self.steps)
        return {k: round(v / n, 4) for k, v in self.seconds.items()}
