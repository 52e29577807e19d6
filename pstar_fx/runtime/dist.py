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
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


class DataParallel:
    """The collectives of one engine's step."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def all_reduce_(self, t: torch.Tensor) -> None:
        dist.all_reduce(t)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks of a scalar (the step's loss)."""
        t = x.detach().reshape(1).to(torch.float64).clone()
        dist.all_reduce(t)
        return (t / self.world).reshape(())

    def broadcast_(self, t: torch.Tensor) -> None:
        """Rank 0's values everywhere (initial weights and buffers: every rank starts from one model). NCCL
        moves GPU memory only: a host chunk crosses through a GPU copy."""
        if t.device.type == "cpu" and dist.get_backend() == "nccl":
            tmp = t.to(torch.device("cuda", torch.cuda.current_device()))
            dist.broadcast(tmp, 0)
            t.copy_(tmp)
        else:
            dist.broadcast(t, 0)

    def barrier(self) -> None:
        dist.barrier()
