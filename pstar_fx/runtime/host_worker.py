"""host_worker: host chunks' jobs (updates, corrections, restores) on one worker thread, and the step settling.

The C++ Adam runs on one worker thread while the GPU goes on (the CPU runtime runs the jobs inline). A step's
host updates may still run after the step returned, into the next step's forward (chunk c's copy to the device
starts on the worker as c's update ends, and the fetch of c waits for it, `wait_for`): that step is "settling".
A failed job's exception is re-raised where its outcome is waited for; the updater (undo.py) decides what it
undoes.

Jobs run in the order they were queued, but for one case: backward's host updates (queued as backward completes each
chunk's gradient, the deepest chunk first) once their pass has ended (`close_pass`: the launching thread queued its
last): of those whose gradient has landed, the worker runs the one the next forward reads first, the lowest chunk
(chunks lie in first-use order: layout.py). In backward's order the chunk the next forward reads first was updated
last, so with the host Adam behind at the end of backward the forward waited for all of it (the 4.2B op by op on an
H100 box: 125 ms a step at its first host chunk, bench/RESULTS.md, session 32); in the forward's order it waits only
where it reads a chunk before that chunk's turn (planning/host_adam.py prices it so). Only once the pass has ended:
before, the launching thread may still wait for a host gradient buffer, which a job passed over would hold while newer
ones overtake it. One chunk's jobs keep their order: a pass queues one update a chunk (an accumulating pass one a
micro-batch: its jobs keep their order), and the jobs after it, a correction or a restore, wait for the whole pass:
a correction reads the outcome of every update of its step (undo.py `_correct_host`), so one taken before an update
queued ahead of it would wait on the worker for a job only the worker can run. (So with the host Adam behind, a
clipped step's corrections of the chunks the next forward reads first wait behind the updates of those it reads last.)
PSTAR_FX_FORWARD_ORDER=0 keeps every job in the order queued (an A/B).

A job after a verdict (a correction, a deferred update) may make a host chunk's 16-bit copy current ahead of its
master (`COPIES_FIRST`, `after_verdict`): the next forward's read of the chunk waits for that job alone (`copy_job`,
`wait_for_copy`), the master's and moments' job runs after it, before anything else reads them (the chunk's next
update and gradient, a checkpoint, an undo: they wait for the chunk's pending job, which is that one).
"""
from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from torch.profiler import record_function

from ..config import parse_flag
from ..kernels import cpu_adam
from .step_log import StepLog
from .telemetry import Telemetry


def _annotated(c: int, fn, *args):
    """A host job on the worker, named in a profiler trace ("pstar_fx.host_job cN": bench/copy_waits.py reads when
    each ran against the copies the compute stream waited for)."""
    with record_function(f"pstar_fx.host_job c{c}"):
        return fn(*args)


class _Job:
    """A job queued on the worker: `landed` (a backward update: whether its gradient is on the host) and `batch` (set
    once its pass has ended: `HostWorker.close_pass`) let the worker run it before jobs queued ahead of it."""
    __slots__ = ("c", "fn", "args", "future", "landed", "batch")

    def __init__(self, c: int, fn, args: tuple, landed: Callable[[], bool] | None):
        self.c, self.fn, self.args, self.future, self.landed, self.batch = c, fn, args, Future(), landed, None


class HostWorker:
    # Write a host chunk's 16-bit shadow first and its master and moments after, in a job of their own, where a job
    # after the verdict changes both (`after_verdict`)? The next forward then waits for 16 B a parameter of host
    # memory instead of 28 (fp32 moments), and the worker moves 16 B more. Off until measured in training: session 11
    # measured it slower when a correction's copy cost most of the correction (float64); the one-pass rescale's
    # copy runs at 1.48x the host Adam on the H200 host (bench/RESULTS.md, session 22); the A/B is
    # `bench/gpt.py --clip-sweep ...@split`.
    COPIES_FIRST = False

    def __init__(self, telemetry: Telemetry, threaded: bool):
        self.telemetry = telemetry
        # the worker's host Adam leaves a core to the thread that launches GPU work (cpu_adam.worker_threads)
        self.executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="pstar_fx-adam",
                                            initializer=cpu_adam.set_threads, initargs=(cpu_adam.worker_threads(),))
                         if threaded else None)
        self._queue: deque[_Job] = deque()         # jobs not started, in the order queued
        self._lock = threading.Lock()
        self._batches = itertools.count()
        self._forward_order = parse_flag(os.environ.get("PSTAR_FX_FORWARD_ORDER", "1"), "PSTAR_FX_FORWARD_ORDER")
        self.pending: dict[int, Future] = {}       # host chunk -> its job still on the worker
        self.copies_first: dict[int, Future] = {}  # host chunk -> the job making its 16-bit copy current first
        self.settling: StepLog | None = None       # the step before, while some of its host jobs run

    @property
    def threaded(self) -> bool:
        return self.executor is not None

    def run(self, c: int, log: StepLog | None, fn, *args, after_copy: bool = False,
            landed: Callable[[], bool] | None = None) -> None:
        """Run a host chunk's job inline or on the worker, where a read of chunk c waits for it; `log` records its
        outcome (True: an update applied). `after_copy`: the master's job of a copy first queued just before it
        (reads of the 16-bit copy go on waiting for that one alone); otherwise the job changes the copy too.
        `landed`: backward's update of c, whose input has landed when it says so: once its pass has ended, the
        worker may run it before jobs queued ahead of it (the module docstring)."""
        if not after_copy:
            self.copies_first.pop(c, None)
        result = fn(*args) if self.executor is None else self._submit(c, fn, args, landed)
        if self.executor is not None:
            self.pending[c] = result
        if log is not None:
            log.host[c] = result

    def close_pass(self) -> None:
        """The launching thread has queued every job of the pass that ran: its backward updates still queued may run
        in the order the next forward reads their chunks, each once its gradient has landed."""
        if self.executor is None or not self._forward_order:
            return
        with self._lock:
            batch = next(self._batches)
            for job in self._queue:
                if job.landed is not None and job.batch is None:
                    job.batch = batch

    def _submit(self, c: int, fn, args: tuple, landed: Callable[[], bool] | None) -> Future:
        job = _Job(c, fn, args, landed)
        with self._lock:
            self._queue.append(job)
        self.executor.submit(self._run_next)      # one run per job queued: each takes the job `_next` picks
        return job.future

    def _next(self) -> _Job:
        """The job to run now: the first queued, unless it is one of an ended pass's backward updates; then, of that
        pass's updates queued at the front, the lowest chunk whose gradient has landed (none: the first, whose
        gradient lands first)."""
        with self._lock:
            head = self._queue[0]
            if head.batch is not None:
                run, chunks = [], set()
                for j in self._queue:        # (a chunk twice, from a pass that failed before it ended: the first)
                    if j.batch != head.batch or j.c in chunks:
                        break
                    run.append(j)
                    chunks.add(j.c)
                ready = [j for j in run if j.landed()]
                if ready:
                    head = min(ready, key=lambda j: j.c)
            self._queue.remove(head)
            return head

    def _run_next(self) -> None:
        job = self._next()
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(_annotated(job.c, job.fn, *job.args))
        except BaseException as e:  # noqa: BLE001 - the job's outcome, raised where it is waited for
            job.future.set_exception(e)

    def run_copy_first(self, c: int, log: StepLog, fn, *args) -> None:
        """Queue a job that makes chunk c's 16-bit copy current (the worker runs it before the jobs queued after
        it: queue chunk c's master job next, with `run(..., after_copy=True)`). A read of the copy waits for it
        alone; `log` counts it among its step's jobs, so that its failure is that step's (`failed_settling`)."""
        assert self.executor is not None, "a copy first is for the threaded worker: inline, the master job is as soon"
        fut = self._submit(c, fn, args, None)
        self.copies_first[c] = fut
        log.copies_first.append(fut)

    def after_verdict(self, chunks: list[int], log: StepLog, job, split: list[int]) -> None:
        """Queue host chunks' jobs after a verdict, `job(c, part)`: "all" for each of `chunks` in their order (the next
        forward's), except those of `split` (a subset, `COPIES_FIRST`: chunks whose shadow the forward reads and
        which holds no kept gradient), whose "copy" jobs come first in that order and whose "state" jobs come last,
        in the reverse order: their next reader is the chunk's next gradient, backward's last chunk first."""
        for c in split:
            self.run_copy_first(c, log, job, c, "copy")
        for c in chunks:
            if c not in split:
                self.run(c, log, job, c, "all")
        for c in reversed(split):
            self.run(c, log, job, c, "state", after_copy=True)

    def copy_job(self, c: int) -> Future | None:
        """The job a read of chunk c's 16-bit copy waits for: its copy first, else its pending job."""
        return self.copies_first.get(c) or self.pending.get(c)

    def wait_for_copy(self, c: int, current: StepLog | None) -> None:
        """Chunk c's 16-bit copy must be current (what forward and backward read): wait for its copy first if it
        has one (its exception is raised), else as `wait_for`. The copy first stays what reads wait for until its
        master's job is waited for (the chunk's next gradient or update, a checkpoint)."""
        fut = self.copies_first.get(c)
        if fut is None:
            return self.wait_for(c, current)
        with self.telemetry.host_wait("wait_for_host_adam"):
            fut.result()

    def wait_for(self, c: int, current: StepLog | None) -> None:
        """Chunk c's master (and shadow) must be current: wait for its pending job (its exception is raised)."""
        self.copies_first.pop(c, None)             # queued before its pending job: done when that is
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
        return self.settling is not None and any(
            f.done() and f.exception() is e
            for f in [*self.settling.host.values(), *self.settling.copies_first] if isinstance(f, Future))

    def settle(self, log: StepLog, swallow: bool = False) -> None:
        """Wait for every host job of `log`'s step. With `swallow`, a failed one is recorded as the state it left:
        a failed update changed nothing (the kernels are all-or-nothing), a failed correction left its chunk as
        its `hyper_of` entry says."""
        for c, f in list(log.host.items()):
            if isinstance(f, Future):
                if self.pending.get(c) is f:
                    del self.pending[c]
                    self.copies_first.pop(c, None)
                try:
                    log.host[c] = f.result()
                except BaseException:
                    if not swallow:
                        raise
                    log.host[c] = log.hyper_of.get(c) is not None
        for f in log.copies_first:            # done: queued before the jobs above
            if not swallow and f.exception() is not None:
                raise f.exception()           # a copy left stale must not be read as current

    def committed(self, log: StepLog) -> None:
        """`log`'s step stands: the step before it has settled (every chunk's update waited for it); its own host
        jobs still running finish in the background."""
        if self.settling is not None:
            self.settle(self.settling)
            self.settling = None
        if log.pending_host():
            self.settling = log
