"""Graph passes. Each is `GraphModule -> GraphModule`, one file each, applied in this order:

    seed_random_ops       needs: the captured joint graph.  provides: each random op draws from its own seed
                          per step (Config.seed, step, micro-batch, op), so running it again redraws the same.
    localize_param_views  needs: the captured joint graph.  provides: every view of a parameter is computed
                          right before its one user, so a parameter is read only where an op reads it.
    lean_cross_entropy    needs: the joint graph.  provides: cross-entropy's log_softmax runs in place on its
                          fp32 input, and its backward overwrites the saved log-probabilities in place
                          instead of allocating two more tensors of their size.
    recompute             needs: localized views, a choice of segments.  provides: backward recomputes those
                          segments' activations instead of keeping them (the planner chooses, only when
                          memory demands it, so for a model that fits this pass changes nothing). Segments
                          are whole forward spans (recompute.find_segments) or the copies of cheap values,
                          remade op by op: norms, activations, attention's output, by seconds per byte saved
                          (recompute_ops.find_cheap_recomputes, which the planner tries first).
    fuse_optimizer        needs: localized views, a Layout.  provides: each gradient is written into its
                          chunk (`rt.grad`) and each chunk is updated (`rt.adam`) right after its last use.
    insert_chunk_ops      needs: fused optimizer, a Plan.  provides: `rt.fetch/prefetch/release/offload`
                          and `rt.param` views; parameters are no longer graph inputs.
    grads_in_place        needs: the lowered graph.  provides: a weight gradient a matmul makes is written by it
                          into its chunk's gradient slot (`rt.grad_mm`), never a tensor of its own.
    compile_regions       needs: the lowered graph, its Plan.  provides: each run of ATen ops between chunk
                          nodes is one call of a function Inductor compiles (Config.compute); the plan's
                          peaks count what the regions hold.

`engine.graph_before(name)` prints the graph a pass received; `engine.graph.code` is the result of the last.
"""
from .fuse_optimizer import fuse_optimizer
from .insert_chunk_ops import insert_chunk_ops
from .lean_loss import lean_cross_entropy
from .localize_views import localize_param_views
from .recompute import find_segments, recompute
from .compile_regions import build_regions, compile_regions
from .grads_in_place import grads_in_place
from .seed_random import seed_random_ops

__all__ = ["seed_random_ops", "localize_param_views", "lean_cross_entropy", "find_segments", "recompute",
           "fuse_optimizer", "insert_chunk_ops", "grads_in_place", "compile_regions", "build_regions"]
