"""runtime: what runs the lowered step — one owner per kind of state.

    chunk_ops     ChunkRuntime: the `rt` the lowered graph calls; each method hands its chunk to the owner below
    store         ChunkStore: each chunk's persistent state on its tier; every allocation, accounted
    movers        Mover: compute copies into device slots, gradients out (CpuCopies, CudaCopies)
    transactions  one class per transaction: how a step runs its passes, keeps, commits and rolls back
    step          Stepper: the step count, schedule and loss scale; delegates the step to its transaction
    updater       Updater: each chunk's update for the open pass (step_log.Pass); the only chunk_update caller
    verdict       the step's norm vector and finiteness flags, added up exactly
    kept          kept gradients, accumulators, host gradient buffers
    host_worker   the host Adam's worker thread, updates in flight, the step settling
    host_rate     HostRateCheck: the host Adam's rate in training against its plan's (learned for later plans)
    undo          rollback, correction, a replay's restores: the only chunk_undo caller
    step_log      the passes a step runs, what a step did (StepLog), StepRolledBack
    dist          the process group and the collectives of data parallelism
    runner        run_graph: the graph node by node with the CPU device tier's budget enforced
    rng           StepRandom: the seeds of the step's random ops, from (seed, step, micro-batch, op)
    telemetry     MemoryStats and seconds per phase
"""
from .chunk_ops import ChunkRuntime
from .runner import run_graph
from .step_log import StepRolledBack
from .telemetry import MemoryStats

__all__ = ["ChunkRuntime", "MemoryStats", "StepRolledBack", "run_graph"]
