"""host_worker: host chunks' jobs (updates, corrections, restores) on one worker thread, and the step settling.

The C++ Adam runs on one worker thread while the GPU goes on (the CPU runtime runs the jobs inline). A step's
host updates may still run after the step returned, into the next step's forward (chunk c's copy to the device
starts on the worker as c's update ends, and the fetch of c waits for it, `wait_for`): that step is "settling".
A failed job's exception is re-raised where its outcome is waited for; the updater (undo.py) decides what it
undoes.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from ..kernels import cpu_adam
from .step_log import StepLog
from .telemetry import Telemetry


class HostWorker:
    def __init__(self, telemetry: Telemetry, threaded: bool):
        self.telemetry = telemetry
        # the worker's host Adam leaves a core to the thread that launches GPU work (cpu_adam.worker_threads)
        self.executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="pstar_fx-adam",
                                            initializer=cpu_adam.set_threads, initargs=(cpu_adam.worker_threads(),))
                         if threaded else None)
        self.pending: dict[int, Future] = {}       # host chunk -> its job still on the worker
        self.settling: StepLog | None = None       # the step before, while some of its host jobs run

    def run(self, c: int, log: StepLog | None, fn, *args) -> None:
        """Run a host chunk's job inline or on the worker, where a read of chunk c waits for it; `log` records its
        outcome (True: an update applied)."""
        result = fn(*args) if self.executor is None else self.executor.submit(fn, *args)
        if self.executor is not None:
            self.pending[c] = result
        if log is not None:
            log.host[c] = result

    def wait_for(self, c: int, current: StepLog | None) -> None:
        """Chunk c's master (and shadow) must be current: wait for its pending job (its exception is raised)."""
        fut = self.pending.pop(c, None)
        if fut is None:
            return
        with self.telemetry.host_wait("wait_for_host_adam"):
            applied = fut.result()
        for log in (self.settling, current):
            if log is not None and log.host.get(c) is fut:
                log.host[c] = applied
        if self.settling is not None and not self.settling.pending_host():
            self.settling = None

    def failed_settling(self, e: BaseException) -> bool:
        """Whether `e` is the failure of one of the settling step's jobs."""
        return self.settling is not None and any(f is not None and f.done() and f.exception() is e
                                                 for f in self.settling.host.values() if isinstance(f, Future))

    def settle(self, log: StepLog, swallow: bool = False) -> None:
        """Wait for every host job of `log`'s step. With `swallow`, a failed one is recorded as the state it left:
        a failed update changed nothing (the kernels are all-or-nothing), a failed correction left its chunk as
        its `hyper_of` entry says."""
        for c, f in list(log.host.items()):
            if isinstance(f, Future):
                if self.pending.get(c) is f:
                    del self.pending[c]
                try:
                    log.host[c] = f.result()
                except BaseException:
                    if not swallow:
                        raise
                    log.host[c] = log.hyper_of.get(c) is not None

    def committed(self, log: StepLog) -> None:
        """`log`'s step stands: the step before it has settled (every chunk's update waited for it); its own host
        jobs still running finish in the background."""
        if self.settling is not None:
            self.settle(self.settling)
            self.settling = None
        if log.pending_host():
            self.settling = log
