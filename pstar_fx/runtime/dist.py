"""dist: data parallelism on torch.distributed — the process group, and what crosses between ranks.

Launched by torchrun (or any launcher setting RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), every rank
compiles the same step and feeds its own micro-batch. In "replicated" mode every rank holds the whole
model's state: right before each chunk's update (`rt.adam`, or its offload to the host), its gradient is
summed over the ranks (`rt.all_reduce(c)`, a node of the lowered graph), each rank having run backward on
`loss / world`. So every rank applies the same update, and the result is one process training on the
concatenated batch. The global norm, the overflow verdict and every transaction follow from the summed
gradients, identically on every rank. NCCL on CUDA, gloo on the CPU.
"""
from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) as the launcher set them; (0, 1, 0) for one process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def init(device: str, timeout_s: float) -> tuple[int, int]:
    """Join the process group when the launcher started several ranks and the user has not; (rank, world)."""
    rank, world, _ = world_from_env()
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        # PSTAR_FX_DIST_BACKEND=gloo runs CUDA ranks over gloo: several ranks sharing one GPU (NCCL refuses
        # that), to test the partitioned runtime's stream ordering on a one-GPU machine
        backend = os.environ.get("PSTAR_FX_DIST_BACKEND") or ("nccl" if device.startswith("cuda") else "gloo")
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        # the group we made, we leave: a gloo group still up at interpreter exit aborted ranks that had finished
        # ("terminate called without an active exception", exit -6) now and then
        atexit.register(_leave)
    if dist.get_backend() == "nccl":
        # NCCL makes its communicator (and its buffers, outside PyTorch's allocator) at the first collective:
        # make it now, before the engine reads the GPU's free memory as its budget
        dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())))
    return dist.get_rank(), dist.get_world_size()


def _leave() -> None:
    """At exit, after the last step: meet the other ranks once more, then leave the group. A gloo worker thread frees
    a finished collective's tensors after the collective returned, and freeing a tensor Python made takes the GIL:
    one still doing that when the interpreter shuts down is ended mid-call and aborts the process (exit -6,
    "terminate called without an active exception": a core dump of tests/test_dist.py's rank showed
    ProcessGroupGloo::runLoop in ~AsyncBroadcastWork waiting for the GIL during Py_FinalizeEx). The barrier waits
    with the GIL released, so those frees finish first; a rank already gone ends it early or after 10 s at most."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "gloo":      # (NCCL's barrier has no timeout of its own: a rank gone would hang it)
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=10), wait_all_ranks=True)
            except Exception:  # noqa: BLE001 - a rank that failed or left: leaving is all that is left to do
                pass
        dist.destroy_process_group()


def measure_bus_bandwidth(device: torch.device, dtype: torch.dtype, elems: int = 4 * 2**20) -> float:
    """Bytes/s of a chunk broadcast between the ranks (a ring broadcast's bus bandwidth is its algorithm
    bandwidth), the best of 3 after a warm-up, as rank 0 measured it: every rank gets the same figure."""
    import time
    where = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else \
        (device if device.type == "cuda" else torch.device("cpu"))
    t = torch.zeros(elems, dtype=dtype, device=where)
    best = float("inf")
    for k in range(4):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(t, 0)
        if where.type == "cuda":
            torch.cuda.synchronize(where)
        if k:
            best = min(best, time.perf_counter() - t0)
    box = [t.numel() * t.element_size() / max(best, 1e-9)]
    dist.broadcast_object_list(box, 0)
    return float(box[0])


def _in_place(t: torch.Tensor, collective) -> None:
    """Run a synchronous in-place collective on `t`. NCCL moves GPU memory only: a host tensor crosses through a
    GPU copy."""
    if t.device.type == "cpu" and dist.get_backend() == "nccl":
        tmp = t.to(torch.device("cuda", torch.cuda.current_device()))
        collective(tmp)
        t.copy_(tmp)
    else:
        collective(t)


class Pending:
    """An asynchronous collective: `wait()` makes the current CUDA stream (or, on the CPU, the caller) wait."""

    def __init__(self, work):
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def abandon(self) -> None:
        """After a failed step: let it finish writing its buffer; a group that already failed is not our error
        to raise (the step's own error is)."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001
            pass


class DataParallel:
    """The collectives of one engine's step."""

    def __init__(self, rank: int, world: int, chunked: bool = False):
        self.rank, self.world, self.chunked = rank, world, chunked

    def owner(self, c: int) -> int:
        """The rank that holds chunk c's state (chunked mode)."""
        return c % self.world

    def broadcast_chunk(self, buf: torch.Tensor, c: int) -> Pending:
        """Chunk c's compute copy, made in `buf` on its owner, into `buf` on every rank (started, not waited)."""
        return Pending(dist.broadcast(buf, self.owner(c), async_op=True))

    def reduce_chunk(self, grad: torch.Tensor, c: int) -> Pending:
        """Every rank's gradient of chunk c summed into the owner's `grad` (started, not waited)."""
        if grad.device.type == "cuda" and dist.get_backend() == "gloo":   # gloo cannot reduce CUDA tensors
            return Pending(dist.all_reduce(grad, async_op=True))
        return Pending(dist.reduce(grad, self.owner(c), async_op=True))

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, in place."""
        _in_place(t, dist.all_reduce)
        return t

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks of a scalar (the step's loss)."""
        t = x.detach().reshape(1).to(torch.float64).clone()
        dist.all_reduce(t)
        return (t / self.world).reshape(())

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> None:
        """Rank `src`'s values everywhere (initial weights and buffers: every rank starts from rank 0's model)."""
        _in_place(t, lambda x: dist.broadcast(x, src))

    def scratch_device(self) -> torch.device:
        """Where a temporary that crosses between ranks lives: NCCL needs GPU memory, gloo is happiest on the host."""
        nccl = dist.get_backend() == "nccl"
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def barrier(self) -> None:
        dist.barrier()


FREE_MEMORY_GRAIN = 64 * 2**20


def launch(config):
    """This process's place in a launch: one GPU per launched rank (`cuda:LOCAL_RANK` for "cuda"), the process
    group joined, and a CUDA device's free memory (rounded down to 64 MiB) as its budget when
    `config.device_memory` is None. Returns (the Config with the device and budget resolved, rank, world)."""
    import dataclasses
    _, launched, local_rank = world_from_env()
    if launched > 1:
        if config.device in ("cuda", "auto") and torch.cuda.is_available():
            config = dataclasses.replace(config, device=f"cuda:{local_rank}")   # one GPU per rank
        if config.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(config.device))
    rank, world = init(config.device, config.dist_timeout)
    if config.device.startswith("cuda") and config.device_memory is None:
        free, _ = torch.cuda.mem_get_info(torch.device(config.device))
        # rounded down to 64 MiB: free memory varies by a few MiB from one process to the next, and the budget is
        # part of the plan cache's key (pipeline/plan_cache.py), so an exact figure would miss on every run
        config = dataclasses.replace(config, device_memory=free // FREE_MEMORY_GRAIN * FREE_MEMORY_GRAIN)
    return config, rank, world
