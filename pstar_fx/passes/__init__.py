"""Graph passes: one file each, each opening with its NAME, its contract (`PASS`: what it requires and provides)
and `run(gm, ctx) -> gm`. `PIPELINE` is the compiler, in order; `pipeline/lower.py` checks its contracts, then
runs it (Config.disable_passes switches the optional ones off); `engine.graph_before(name)` prints the graph a
pass received, and `engine.graph.code` is the result of the last.

    seed_random_ops       each random op draws from its own seed per step (Config.seed, step, micro-batch, op),
                          so running it again redraws the same.
    localize_param_views  every view of a parameter is computed right before its one user, so a parameter is
                          read only where an op reads it.
    lean_cross_entropy    cross-entropy's log_softmax runs in place on its fp32 input, and its backward
                          overwrites the saved log-probabilities in place instead of allocating two more tensors
                          of their size.
    plan                  the driver's step (pipeline/recompute_search.py): for each try, `recompute` (backward
                          recomputes chosen forward segments or cheap values instead of keeping them), then
                          `fuse_optimizer` (each gradient written into its chunk, `rt.grad`, each chunk updated,
                          `rt.adam`, right after its last use; with compiled compute, each node marked with its
                          block's span: planning/blocks.py), then the planner (by block or op by op, the faster);
                          the least recompute that fits.
    insert_chunk_ops      `rt.fetch/prefetch/release/offload` where the plan's schedule puts them (updates moved to
                          their block's end where the plan is by block), and `rt.param` views; parameters are no
                          longer graph inputs.
    grads_in_place        a weight gradient a matmul makes is written by it into its chunk's gradient slot
                          (`rt.grad_mm`), never a tensor of its own.
    compile_regions       each run of ATen ops between chunk nodes (and, by block, between blocks) is one call of a
                          function Inductor compiles (Config.compute); the plan's peaks count what the regions hold
                          (a PlanDelta).

Evaluation runs the same list up to insert_chunk_ops on a forward-only capture, its plan step planning on the
training plan's placement (`pipeline/lower.py`).
"""
from __future__ import annotations

import torch.fx as fx

from . import (compile_regions, fuse_optimizer, grads_in_place, insert_chunk_ops, lean_loss, localize_views,
               recompute, seed_random)
from .contract import PLANNED, Pass, PassContext


def _plan(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return ctx.plan_step(gm, ctx)


PLAN = Pass("plan", _plan, requires=recompute.PASS.requires | fuse_optimizer.PASS.requires,
            provides=recompute.PASS.provides | fuse_optimizer.PASS.provides | {PLANNED},
            runs=(recompute.NAME, fuse_optimizer.NAME),
            why="the least recompute that fits: each try recomputed, fused and planned (the driver's ctx.plan_step)")

PIPELINE: list[Pass] = [
    seed_random.PASS,
    localize_views.PASS,
    lean_loss.PASS,
    PLAN,
    insert_chunk_ops.PASS,
    grads_in_place.PASS,
    compile_regions.PASS,
]

__all__ = ["PIPELINE", "PLAN"]
