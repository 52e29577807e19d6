"""insert_chunk_ops: make every chunk move an explicit node, and read parameters from chunk buffers.

Needs: the graph after `fuse_optimizer` and the Plan made from it. Provides: `rt.prefetch(c)`,
`rt.fetch(c)` and `rt.release(c)` where the plan's schedule puts them, `rt.adam(c)` moved where the plan puts
it (the end of its block's span: planning/blocks.py), `rt.offload(c)` (gradients of a
host-resident chunk go to the host) before `rt.adam(c)`, and `rt.param(i)` (a view of parameter i in its
chunk's compute buffer) right before each op that reads it. Parameter placeholders are removed: the
lowered step takes (rt, buffers..., inputs..., tangent).

Data parallelism (`dp`): "replicated": `rt.all_reduce(c)` before each chunk's offload or update sums its
gradient over the ranks. "chunked" (each chunk's state on its owner, rank c % world): `rt.reduce(c)` takes
the update's place, summing the gradient into the owner's slot, and the update (with its offload) moves
after the next chunk's reduce, so the collective runs while backward goes on; `rt.fetch` of a chunk waits
for its broadcast from the owner, which `rt.prefetch` started (the runtime does that part).
"""
from __future__ import annotations

import torch.fx as fx

from ..fxutil import role_nodes
from ..layout import Layout
from ..planning import Plan
from .contract import CHUNK_OPS, FUSED, PLANNED, Pass, PassContext

NAME = "insert_chunk_ops"


def run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return insert_chunk_ops(gm, ctx.layout, ctx.plan, ctx.dp)


PASS = Pass(NAME, run, requires=frozenset({FUSED, PLANNED}), provides=frozenset({CHUNK_OPS}),
            why="every chunk move is a node where the plan's schedule puts it")


def insert_chunk_ops(gm: fx.GraphModule, layout: Layout, plan: Plan, dp: str | None = None) -> fx.GraphModule:
    g = gm.graph
    rt = role_nodes(g, "rt")[0]
    params = role_nodes(g, "param")
    first_op = next(n for n in g.nodes if n.op != "placeholder")

    def emit(op: str, chunk: int) -> fx.Node:
        return g.call_method(op, (rt, chunk))

    if plan.moves.updates_after:            # updates planned at the end of their block's span (planning/blocks.py)
        named = {n.name: n for n in g.nodes}
        placed: dict[str, fx.Node] = {}     # anchor -> the last update moved after it (they keep their order)
        for node in [n for n in g.nodes if n.op == "call_method" and n.target == "adam"]:
            anchor = plan.moves.updates_after.get(node.args[1])
            if anchor is not None:
                placed.get(anchor, named[anchor]).append(node)
                placed[anchor] = node
    for node in list(g.nodes):
        for op, c in plan.schedule_before.get(node.name, []):
            with g.inserting_before(node if node.op != "placeholder" else first_op):
                emit(op, c)
        anchor = node
        for op, c in plan.schedule_after.get(node.name, []):
            if anchor.op == "placeholder":
                with g.inserting_before(first_op):
                    emit(op, c)
                continue
            with g.inserting_after(anchor):
                anchor = emit(op, c)
        if node.op == "call_method" and node.target == "adam" and dp != "chunked":
            with g.inserting_before(node):
                if dp == "replicated":
                    emit("all_reduce", node.args[1])
                if plan.placement[node.args[1]] == "host":
                    emit("offload", node.args[1])
    if dp == "chunked":
        updates = [n for n in g.nodes if n.op == "call_method" and n.target == "adam"]
        reduces = []
        for node in updates:
            with g.inserting_before(node):
                reduces.append(emit("reduce", node.args[1]))
        for node, later in zip(updates, reduces[1:]):
            later.append(node)                 # the update waits one chunk: its reduce overlaps backward
        for node in updates:
            if plan.placement[node.args[1]] == "host":
                with g.inserting_before(node):
                    emit("offload", node.args[1])

    for slot, p in zip(layout.slots, params):
        for user in list(p.users):
            with g.inserting_before(user):
                view = g.call_method("param", (rt, slot.index))
            view._rename(p.name)
            view.meta["param"] = (p.meta.get("val"), slot.offset)   # what the view is, for compile_regions
            user.replace_input_with(p, view)
        g.erase_node(p)
    g.lint()
    gm.recompile()
    return gm
