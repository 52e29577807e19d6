"""fuse_optimizer: write each gradient into its chunk and update each chunk right after its last use.

Needs: a joint graph with localized parameter views, whose output is (loss, grads...), and a Layout.
Provides: the output is (loss,); after the node producing parameter i's
gradient comes `rt.grad(i, g)`; after the last node that reads or writes chunk c comes `rt.adam(c)`.
Why: the optimizer runs inside backward, so whole-model gradients never exist at once, and a chunk's
gradient buffer lives only from its first gradient to its update.

Where the compute is compiled (Config.compute), the nodes are also grouped into the model's blocks
(planning/blocks.py: `node.meta["span"]`): the planner may then hold chunks and put updates by block.
"""
from __future__ import annotations

import torch.fx as fx

from ..fxutil import role_nodes
from ..layout import Layout
from ..planning import blocks
from .recompute import backward_nodes
from .contract import FUSED, VIEWS_LOCAL, Pass, PassContext

NAME = "fuse_optimizer"


def run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return fuse_optimizer(gm, ctx.layout, lint=ctx.lint, spans=ctx.config.compiles_compute and blocks.enabled())


PASS = Pass(NAME, run, requires=frozenset({VIEWS_LOCAL}), provides=frozenset({FUSED}),
            why="the update runs inside backward: whole-model gradients never exist at once")


def fuse_optimizer(gm: fx.GraphModule, layout: Layout, lint: bool = True, spans: bool = False) -> fx.GraphModule:
    g = gm.graph
    rt = role_nodes(g, "rt")[0]
    params = role_nodes(g, "param")
    if spans:
        blocks.mark_spans(g, params, [s.param.name for s in layout.slots], backward_nodes(g))
    output = g.output_node()
    outs = list(output.args[0])
    grads = outs[1:]
    output.args = ((outs[0],),)

    order = {n: i for i, n in enumerate(g.nodes)}
    last_touch: dict[int, tuple[float, fx.Node]] = {}   # chunk -> (position, node the update goes after)

    def touch(chunk: int, position: float, node: fx.Node) -> None:
        if chunk not in last_touch or position > last_touch[chunk][0]:
            last_touch[chunk] = (position, node)

    for slot, p in zip(layout.slots, params):
        for user in p.users:
            touch(slot.chunk, order[user], user)
    for slot, grad in zip(layout.slots, grads):
        if grad is None:
            continue
        with g.inserting_after(grad):
            write = g.call_method("grad", (rt, slot.index, grad))
        if blocks.SPAN in grad.meta:
            write.meta[blocks.SPAN] = grad.meta[blocks.SPAN]
        touch(slot.chunk, order[grad] + 0.5, write)
    for chunk, (_, node) in sorted(last_touch.items(), key=lambda kv: -kv[1][0]):
        if layout.chunks[chunk].grad_spans():
            with g.inserting_after(node):
                g.call_method("adam", (rt, chunk))
    if lint:
        g.lint()
    gm.recompile()
    return gm
