"""Graph passes. Each is `GraphModule -> GraphModule`, one file each, applied in the order of `PASSES`.

    localize_param_views  needs: the captured joint graph.  provides: every view of a parameter is computed
                          right before its one user, so a parameter is read only where an op reads it.
    fuse_optimizer        needs: localized views, a Layout.  provides: each gradient is written into its
                          chunk (`rt.grad`) and each chunk is updated (`rt.adam`) right after its last use.
    insert_chunk_ops      needs: fused optimizer, a Plan.  provides: `rt.fetch/prefetch/release/offload`
                          and `rt.param` views; parameters are no longer graph inputs.

`Engine(passes_off=...)` can switch a pass off (for debugging: the step then keeps whole-model gradients or
re-reads parameters), and `Engine.graph_before(name)` dumps the graph a pass received.
"""
from .fuse_optimizer import fuse_optimizer
from .insert_chunk_ops import insert_chunk_ops
from .localize_views import localize_param_views

__all__ = ["localize_param_views", "fuse_optimizer", "insert_chunk_ops"]
