"""host_adam: how much of the host Adam the step cannot hide, by simulating it against the cost model's node
times — inside backward with a pool of pinned gradient buffers (`_host_adam_pipeline`), or after the verdict, into
the next step's forward, for a deferred step (`_after_verdict_exposed`); `worker_stall` is the after-verdict
simulation that step and a correction (correction.py) share.
"""
from __future__ import annotations

from ..layout import Layout


def _host_adam_pipeline(placement: list[str], layout: Layout, node_secs: list[float], reads: list[set[int]],
                        adam_at: dict[int, int], host_adam: float, cuda: bool, n_spare_buffers: int | None,
                        most: int = 32, buffers: int | None = None) -> tuple[int, float, float]:
    """(host gradient buffers, seconds of host Adam the step cannot hide, seconds of it hidden behind the next
    forward), by simulating the pipeline; `host_adam`: the host Adam's parameters/s with the configured moments.

    Backward hands each host chunk's gradient to one worker that runs the host Adam chunk after chunk.
    A gradient waits in a host buffer until its Adam is done; with every buffer taken, the thread that
    launches GPU work blocks, and the GPU runs dry. The updates not started when the step's compute ends run
    in the order the next forward reads their chunks (runtime/host_worker.py), beside it: the forward stalls
    by the latest chunk's lateness. The smallest buffer count that never
    blocks (within `n_spare_buffers` more than the 2 always counted, at most `most`) is chosen; the CPU runtime is
    synchronous and uses one. The third figure: the seconds of host Adam the estimate hides behind the next
    forward (running when the step's compute ends, until the forward's first read of a host chunk): a correction
    waits for every update first, and cannot (0 on the CPU runtime, whose Adam is inline).
    `buffers`: simulate that many buffers instead of choosing (the pool already sized, at another rate).
    """
    host = [c for c in sorted(adam_at, key=adam_at.__getitem__) if placement[c] == "host"]
    if not host:
        return (1 if "host" in placement else 0), 0.0, 0.0
    if not cuda:
        return 1, sum(layout.chunks[c].used_elems for c in host) / host_adam, 0.0
    clock, t = [], 0.0
    for s in node_secs:
        t += s
        clock.append(t)
    first_host_read = next((clock[i] - node_secs[i] for i, r in enumerate(reads)
                            if any(placement[c] == "host" for c in r)), 0.0)
    first_read, _ = first_reads(node_secs, reads)       # the next forward's, as this step's
    adam_s = [layout.chunks[c].used_elems / host_adam for c in host]

    def simulate(k: int, with_tail: bool = False):
        delay, start, done = 0.0, [], []
        for i, c in enumerate(host):
            ready = clock[adam_at[c]] + delay
            if i >= k and done[i - k] > ready:       # every buffer holds a gradient Adam has not read
                delay += done[i - k] - ready
                ready = done[i - k]
            start.append(max(ready, done[-1] if done else 0.0))
            done.append(start[-1] + adam_s[i])
        end = clock[-1] + delay                        # the step's compute ends
        tail = done[-1] - end                          # Adam left then
        # the updates not started by then run in the order the next forward reads their chunks (host_worker.py),
        # which stalls where it reads a chunk before its update is done: by the latest chunk's lateness
        late = [i for i in range(len(host)) if start[i] >= end]
        t = start[late[0]] if late else 0.0
        for i in sorted(late, key=lambda i: first_read.get(host[i], first_host_read)):
            t += adam_s[i]
            done[i] = t
        stall = max((done[i] - end - first_read.get(host[i], first_host_read) for i in range(len(host))
                     if done[i] > end), default=0.0)
        exposed = delay + max(0.0, stall)
        return (exposed, min(max(0.0, tail), first_host_read)) if with_tail else exposed

    cap = most if n_spare_buffers is None else max(2, min(most, 2 + n_spare_buffers))
    best = buffers if buffers is not None else min(range(2, cap + 1), key=lambda k: (round(simulate(k), 3), k))
    return (best, *simulate(best, with_tail=True))


def _after_verdict_exposed(placement: list[str], layout: Layout, node_secs: list[float], reads: list[set[int]],
                           adam_at: dict[int, int], host_adam: float, copy_s: dict[int, float],
                           device_s: float) -> float:
    """Seconds a deferred step adds to the compute for updates that run after the verdict.

    The verdict ends the step. The device chunks' updates run on their own stream beside the next forward, their
    kept gradients that wait on the host coming back meanwhile (`device_s`, what they add to the forward:
    correction.py `device_after_verdict_seconds`). Meanwhile the worker runs the host Adam chunk after chunk, in
    chunk order, from the verdict on (`worker_stall`). The step grows by `device_s` and the latest chunk's lateness.
    """
    host = sorted(c for c in adam_at if placement[c] == "host")
    return device_s + worker_stall(host, layout, node_secs, reads, host_adam, copy_s, forward_start=device_s)


def worker_stall(order: list[int], layout: Layout, node_secs: list[float], reads: list[set[int]], rate: float,
                 copy_s: dict[int, float], worker_start: float = 0.0, forward_start: float = 0.0) -> float:
    """Seconds the next forward stalls for host jobs the worker runs after the verdict, one chunk after another in
    `order` at `rate` parameters/s, from `worker_start` on (seconds after the verdict); the forward's GPU work starts
    at `forward_start`. A chunk's compute copy crosses (`copy_s[c]`: the schedule's copy seconds) once its job is
    done, and the forward stalls where it would read the chunk before that. A stall delays every later read alike,
    so the forward grows by the latest chunk's lateness (0 when none is late)."""
    first_read, t = first_reads(node_secs, reads)
    done, stall = worker_start, 0.0
    for c in order:
        done += layout.chunks[c].used_elems / rate
        stall = max(stall, done + copy_s.get(c, 0.0) - (forward_start + first_read.get(c, t)))
    return stall


def first_reads(node_secs: list[float], reads: list[set[int]]) -> tuple[dict[int, float], float]:
    """({chunk: the compute seconds before the step first reads it}, the step's compute seconds)."""
    t, first_read = 0.0, {}
    for i, r in enumerate(reads):
        for c in r:
            first_read.setdefault(c, t)
        t += node_secs[i]
    return first_read, t
