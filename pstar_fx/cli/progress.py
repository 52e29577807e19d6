"""progress: what the user watches — the training bar, the library's log lines, and a status line that counts
the seconds of the compile phase in flight (from `pstar_fx.phases` events, not from the log's wording)."""
from __future__ import annotations

import logging
import sys
import threading
import time

from pstar_fx.phases import PhaseEvent


class Bar:
    """The training progress bar (tqdm on stderr; its ETA is tqdm's), or nothing when stderr is not a terminal:
    CI logs get the step lines alone. Lines go to stdout through tqdm.write so that they never break the bar."""

    def __init__(self, mode: str, total: int, initial: int):
        from tqdm import tqdm
        on = mode == "bar" or mode == "auto" and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, unit="step", file=sys.stderr, dynamic_ncols=True,
                        leave=False) if on else None
        self._write = tqdm.write

    def update(self, **postfix) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if postfix:               # a log step: always shown (update alone shows at most every 0.1 s)
                self.bar.set_postfix_str("  ".join(f"{k} {v}" for k, v in postfix.items()))

    def print(self, line: str) -> None:
        self._write(line, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Progress(logging.Handler):
    """The library's progress lines (logger "pstar_fx", INFO) on standard output, as they happen. With `live`
    (stderr is a terminal) a status line on stderr also counts the seconds of the compile phase in flight, so
    that a long capture or plan is seen to be alive; logs and CI get the lines alone. `on_phase` takes the
    phase events (main subscribes it to `pstar_fx.phases`)."""

    def __init__(self, live: bool, stream=None, tick_s: float = 0.5):
        super().__init__()
        self.live, self.stream, self.tick_s = live, stream, tick_s
        # every phase in flight, by name: (started, its progress (done, total) once it sent some). Phases overlap
        # (the weights are written while the regions build): the one started last is shown, the one before it
        # again once it ends
        self._flight: dict[str, tuple[float, tuple[int, int] | None]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm
        with self._lock:
            self._clear()
            tqdm.write(f"  [{record.relativeCreated / 1e3:7.1f} s] {record.getMessage()}", file=sys.stdout)
            sys.stdout.flush()

    def on_phase(self, event: PhaseEvent) -> None:
        if not self.live:
            return
        with self._lock:
            if event.state == "start":
                self._flight.pop(event.phase, None)     # (shown as the last started)
                self._flight[event.phase] = (time.perf_counter(), None)
                self._show()
                if self._ticker is None:
                    self._ticker = threading.Thread(target=self._tick, daemon=True, name="pstar-fx progress")
                    self._ticker.start()
            elif event.state == "progress" and event.phase in self._flight:
                self._flight[event.phase] = (self._flight[event.phase][0], (event.done, event.total))
                if event.phase == self._shown():
                    self._show()
            elif event.state == "end":
                self._clear()           # its "done in" line is printed; a tick since may have shown the status
                self._flight.pop(event.phase, None)
                self._show()            # a phase still in flight beside it, if any

    def _shown(self) -> str | None:
        """The phase the status line shows: the last started of those in flight."""
        return next(reversed(self._flight), None)

    def _out(self):
        return self.stream or sys.stderr

    def _show(self) -> None:
        name = self._shown()
        if name is not None:
            t0, progress = self._flight[name]
            done = f" ({100 * progress[0] // max(1, progress[1])}%)" if progress else ""
            self._out().write(f"\r  {name} ... {time.perf_counter() - t0:.0f} s{done}\033[K")
            self._out().flush()

    def _clear(self) -> None:
        if self.live and self._flight:
            self._out().write("\r\033[K")

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            with self._lock:
                self._show()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._clear()
            self._flight.clear()
        super().close()
