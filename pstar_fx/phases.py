"""phases: the compile's phases as structured events — what a progress display subscribes to.

A 20B model takes minutes to capture, plan and pin, and should say where it is. Each phase is logged (logger
"pstar_fx", INFO) and sent to every subscriber as a `PhaseEvent` when it starts and ends (and, for long loops,
as it progresses), so a display reads fields, never log text.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Literal

log = logging.getLogger("pstar_fx")

_subscribers: list[Callable[["PhaseEvent"], None]] = []


@dataclass(frozen=True)
class PhaseEvent:
    phase: str                                   # "capture", "plan", "lower", "regions", "allocate", ...
    state: Literal["start", "progress", "end"]
    what: str = ""                               # what the phase does, in a few words (start)
    seconds: float = 0.0                         # how long it took (end)
    done: int = 0                                # progress: units done of `total`
    total: int = 0


@contextlib.contextmanager
def subscribe(fn: Callable[[PhaseEvent], None]) -> Iterator[None]:
    """Call `fn` with every phase event while the block runs."""
    _subscribers.append(fn)
    try:
        yield
    finally:
        _subscribers.remove(fn)


def _send(event: PhaseEvent) -> None:
    for fn in list(_subscribers):
        fn(event)


class Phases:
    """Seconds per compile phase, each announced as it starts and ends."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str, what: str = ""):
        log.info("%s%s ...", name, f" ({what})" if what else "")
        _send(PhaseEvent(name, "start", what))
        t0 = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - t0
        log.info("%s done in %.1f s", name, self.seconds[name])
        _send(PhaseEvent(name, "end", what, seconds=self.seconds[name]))

    @staticmethod
    def progress(name: str, done: int, total: int) -> None:
        """Within phase `name`: `done` of `total` units (chunks allocated, parameter values initialized)."""
        _send(PhaseEvent(name, "progress", done=done, total=total))

    def summary(self) -> str:
        return ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())
