"""rng: the seeds of the step's random ops (passes.seed_random), from (Config.seed, step, micro-batch, op).

Each seeded op reseeds the device's default generator right before it draws, so an op draws the same
numbers whenever the same step runs it again (recompute, replay, a second pass) and another run with the
same seed draws them too. Around each run of the graph the generator's state is saved and restored: the
user's own stream of random numbers goes on as if the step had drawn none.
"""
from __future__ import annotations

import torch

_MASK = 2**64 - 1


def _mix(*words: int) -> int:
    """splitmix64 over the words: nearby keys give unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for w in words:
        h = (h ^ (w & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK
        h ^= h >> 29
    return h & (2**63 - 1)


class StepRandom:
    def __init__(self, device: torch.device, seed: int):
        self.seed = seed
        self.step = 0        # the optimizer step being run (1 for the first)
        self.micro = 0       # the micro-batch within it
        self.rank = None     # the data-parallel rank, with several
        self._device = device
        self._saved = None

    def start_step(self, step: int) -> None:
        """Optimizer step `step` (1 for the first) begins, at its first micro-batch."""
        self.step, self.micro = step, 0

    def start_micro(self, j: int) -> None:
        """The step's j-th micro-batch begins."""
        self.micro = j

    def _generator(self) -> torch.Generator:
        if self._device.type == "cuda":
            return torch.cuda.default_generators[self._device.index or 0]
        return torch.default_generator

    def seed_op(self, k: int) -> None:
        words = (self.seed, self.step, self.micro, k) + ((self.rank,) if self.rank is not None else ())
        self._generator().manual_seed(_mix(*words))

    def __enter__(self):
        self._saved = self._generator().get_state()
        return self

    def __exit__(self, *exc):
        self._generator().set_state(self._saved)
        self._saved = None
