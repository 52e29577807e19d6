"""grads_in_place: a weight gradient made by a matmul is written by that matmul into its chunk's gradient slot.

Needs: the lowered graph (after insert_chunk_ops). Provides: `rt.grad(i, g)` whose `g` is a matmul's output seen
through views that keep its memory order (a Linear's weight gradient: `t(t(mm(dy^T, x)))`) becomes
`rt.grad_mm(i, a, b)` where the matmul was: `torch.mm(a, b, out=<parameter i's span of the slot>)`. The gradient
is then never a tensor of its own: one write of it instead of a write, a read and a second write (at 4.2B on
the H200, 493 device-to-device copies, 8.6 ms of a 0.77 s step), and its bytes are not allocated beside the
slot. The same GEMM runs, so the values are the same bits.

Only when no update, offload or reduce lies between the matmul and its `rt.grad` (the slot is taken where the
matmul runs, and the plan counted slots from a chunk's first gradient write to its update), the matmul's result
has no other reader and is in the slot's dtype, the parameter's span of the slot starts 16-byte aligned, and the
views end contiguous at offset 0 with all its elements (so flattening them, which is how `rt.grad` writes, is
the matmul's own order).
The plan was made before this pass: it counts the gradient that no longer exists, an upper bound.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .contract import CHUNK_OPS, GRADS_IN_SLOTS, Pass, PassContext

NAME = "grads_in_place"


def run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return grads_in_place(gm, ctx.layout, ctx.dtype)


PASS = Pass(NAME, run, requires=frozenset({CHUNK_OPS}), provides=frozenset({GRADS_IN_SLOTS}), optional=True,
            why="a matmul writes its weight gradient into the chunk's slot: one write instead of three")

_VIEWS = {torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.alias.default, torch.ops.aten.detach.default}


# the chunk nodes after which a gradient slot may be free again (a chunk's gradient leaves its slot)
_GIVE_BACK = {"adam", "offload", "reduce", "all_reduce"}


def _matmul_behind(g: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """The mm whose output `g` is through single-reader views, and those views; None if there is none."""
    chain = []
    n = g
    while n.op == "call_function" and n.target in _VIEWS and len(n.users) == 1:
        chain.append(n)
        n = n.args[0]
        if not isinstance(n, fx.Node):
            return None
    if not (n.op == "call_function" and n.target is torch.ops.aten.mm.default and len(n.users) == 1):
        return None
    return n, chain


def _between(a: fx.Node, b: fx.Node):
    n = a.next
    while n is not b:
        yield n
        n = n.next


def grads_in_place(gm: fx.GraphModule, layout, compute_dtype: torch.dtype) -> fx.GraphModule:
    g = gm.graph
    for node in list(g.nodes):
        if not (node.op == "call_method" and node.target == "grad" and isinstance(node.args[2], fx.Node)):
            continue
        rt, index, value = node.args
        found = _matmul_behind(value)
        if found is None:
            continue
        mm, chain = found
        out, val = mm.meta.get("val"), value.meta.get("val")
        aligned = layout.slots[index].offset * compute_dtype.itemsize % 16 == 0   # else GEMMs take a slow path
        if not (aligned and isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor)
                and out.dtype == compute_dtype and out.is_contiguous() and val.is_contiguous()
                and val.storage_offset() == 0 and val.numel() == out.numel()):
            continue
        if any(n.op == "call_method" and n.target in _GIVE_BACK for n in _between(mm, node)):
            continue       # the slot would be taken before another chunk's update gave one back
        with g.inserting_before(mm):    # where the matmul ran: its inputs die where they did
            g.call_method("grad_mm", (rt, index, *mm.args))
        g.erase_node(node)
        for n in (*chain, mm):
            g.erase_node(n)
    g.lint()
    gm.recompile()
    return gm
