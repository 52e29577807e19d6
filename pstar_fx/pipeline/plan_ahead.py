"""plan_ahead: the recompute search's tries planned ahead, each in a forked process, on cores the search leaves idle.

The search (recompute_search.py) is sequential: which try comes next depends on whether the last one fit. Each try
of a large step is seconds of pure Python (copy the graph, recompute, fuse the optimizer, `make_plan`: 1.5-2.5 s at
18B on the H200's host, 10-20 s for a 70B LoRA), and a compile box has cores to spare while it runs. So the search
names the tries it is likely to ask for next; each runs in a child forked from the search's process (the graph is
shared copy-on-write, nothing is pickled on the way in), which sends back only its Plan (plain data keyed by node
names). The search itself is unchanged: a try it asks for is taken from its child when one ran it, else planned in
its own process as before, so the plan chosen is the same whatever ran ahead — only sooner. A child that fails or
stalls costs nothing but its time: the try is planned in-process.

A child only reads the graph and runs Python passes over meta/fake values: it touches no GPU, no thread pool and no
file, and leaves by `os._exit` (no atexit handler of the parent runs twice). The search plans ahead only before the
engine has chunk memory (not for a plan `on` another's), and page-locked chunk buffers are kept out of forks anyway
(runtime/host_memory.py `not_inherited`). A child that never answers (a fork that inherited a lock another thread
held) is killed after STALL_TRIES x the longest in-process try, and no other is started.

`PSTAR_FX_PLAN_WORKERS`: how many children at once (0: none); by default one fewer than the usable cores, at most 8
and as many as the available memory holds, for a step of at least `LARGE` nodes (a small step's try takes
milliseconds: a fork would cost more than it saves).
"""
from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import time
import warnings
from typing import Callable, Hashable

from ..config import parse_count

log = logging.getLogger("pstar_fx")

LARGE = 4000            # graph nodes from which planning ahead pays (an 18B GPT's step: ~15k)
MAX_WORKERS = 8
# a child silent for STALL_TRIES times the longest try planned in-process (at least MIN_STALL_S) is given up, and no
# other child is started: its try is planned in-process (a fork that inherited a lock another thread held would
# never answer)
STALL_TRIES, MIN_STALL_S = 4.0, 30.0


def workers_for(n_nodes: int) -> int:
    """Children to run at once for a step of `n_nodes` graph nodes."""
    env = os.environ.get("PSTAR_FX_PLAN_WORKERS")
    if env is not None and env.strip():
        return parse_count(env, "PSTAR_FX_PLAN_WORKERS", "processes (0: none)", least=0)
    if not hasattr(os, "fork") or n_nodes < LARGE:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(MAX_WORKERS, cores - 1, _children_memory_allows()))


def _children_memory_allows() -> int:
    """How many children the host's available memory holds, each taken to grow by this process's resident size
    (a child's copy of the graph and its plan are smaller than the captured step and everything around it)."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, StopIteration, ValueError, IndexError):
        return MAX_WORKERS                  # (no /proc: the cores decide)
    return int(available // max(resident, 1 << 30))


class PlanAhead:
    """Children planning tries ahead: `start` forks them, `take` waits for one's Plan, `close` ends the rest."""

    def __init__(self, plan_of: Callable[[Hashable], object], workers: int):
        self.plan_of, self.workers = plan_of, workers
        self.running: dict[Hashable, tuple[int, int]] = {}      # try -> (pid, read end of its pipe)
        self.failed: list[str] = []
        self.taken, self.started = 0, 0
        self.longest_try_s = 0.0        # the longest try the search planned itself (`planned_here`)

    def __enter__(self) -> "PlanAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __contains__(self, t) -> bool:
        return t in self.running

    def planned_here(self, seconds: float) -> None:
        """The search planned a try itself in `seconds`: what a child's silence is measured against."""
        self.longest_try_s = max(self.longest_try_s, seconds)

    def start(self, tries, skip=()) -> None:
        """Fork a child for each try not in `skip` nor running, while fewer than `workers` run."""
        for t in tries:
            if len(self.running) >= self.workers:
                return
            if t in skip or t in self.running:
                continue
            r, w = os.pipe()
            with warnings.catch_warnings():     # (3.12: "multi-threaded, fork may deadlock": torch's idle pools;
                warnings.simplefilter("ignore", DeprecationWarning)  # a child uses none of them)
                pid = os.fork()
            if pid == 0:                        # the child: plan, send, leave without the parent's exit handlers
                code = 0
                try:
                    os.close(r)
                    try:
                        payload = pickle.dumps((True, self.plan_of(t)), protocol=pickle.HIGHEST_PROTOCOL)
                    except BaseException as e:  # noqa: BLE001 - reported to the parent, which plans it itself
                        payload = pickle.dumps((False, f"{type(e).__name__}: {e}"))
                    with os.fdopen(w, "wb") as f:
                        f.write(payload)
                except BaseException:           # noqa: BLE001
                    code = 1
                finally:
                    os._exit(code)
            os.close(w)
            self.running[t] = (pid, r)
            self.started += 1

    def take(self, t):
        """The Plan the child running `t` made, or None (it failed or stalled: the caller plans it itself)."""
        pid, r = self.running.pop(t)
        stall_s = max(MIN_STALL_S, STALL_TRIES * self.longest_try_s)
        chunks, deadline = [], time.monotonic() + stall_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    self.failed.append(f"{t}: no answer in {stall_s:.0f} s (no more tries planned ahead)")
                    _kill(pid)
                    self.workers = 0
                    return None
                data = os.read(r, 1 << 20)
                if not data:
                    break
                chunks.append(data)
        finally:
            os.close(r)
            _reap(pid)
        try:
            ok, value = pickle.loads(b"".join(chunks))
        except Exception as e:  # noqa: BLE001 - a child that died mid-way
            self.failed.append(f"{t}: {type(e).__name__}")
            return None
        if not ok:
            self.failed.append(f"{t}: {value}")
            return None
        self.taken += 1
        return value

    def close(self) -> None:
        """End the children whose tries the search did not ask for."""
        for pid, r in self.running.values():
            _kill(pid)
            os.close(r)
            _reap(pid)
        self.running.clear()
        if self.started:
            log.debug("plan ahead: %d of %d tries planned ahead were used", self.taken, self.started)
        if self.failed:
            log.debug("plan ahead: %d tries planned in-process instead (%s)", len(self.failed), "; ".join(self.failed))


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
