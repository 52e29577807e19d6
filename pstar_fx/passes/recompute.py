"""recompute: drop the activations of chosen forward segments and recompute them in backward.

Needs: the joint graph with localized parameter views (placeholders tagged by role).
Provides: for each chosen segment, no value computed inside it is read by backward; instead, right before
backward first needs any of them, a copy of the segment's forward ops recomputes them from the segment's
input (kept) and the parameters (fetched again if the plan evicted them).

A segment is the span of forward ops between two points where exactly one activation is alive: the
residual stream between transformer sub-blocks, found from the graph alone, no module names needed.
Activation checkpointing per block is the choice of every segment. Segments with unseeded random ops or
in-place ops on values from outside are never recomputed (recomputing would not reproduce their values);
seeded random ops (passes.seed_random) replay the same numbers and in-place ops on the segment's own
values are recomputed with them. A batch norm in training mode also writes BatchNorm's running statistics
(outside values): its copy is recomputed without that update (`fxutil.without_stats_update`), so each
statistic moves once per step, as in eager.

`group_segments` joins runs of adjacent segments into one: the boundaries inside a run are recomputed
too instead of kept, which trades fewer kept activations (a transformer has two boundaries per block:
after attention and after the MLP) for a larger recompute burst in backward, at no extra compute.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from ..fxutil import (aliases_input, is_random, mutated_args, node_copy, role_nodes, running_stats_args,
                      value_bytes, without_stats_update)
from .contract import RECOMPUTED, VIEWS_LOCAL, Pass, PassContext

NAME = "recompute"


def run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return recompute(gm, list(ctx.segments), lint=ctx.lint) if ctx.segments else gm


PASS = Pass(NAME, run, requires=frozenset({VIEWS_LOCAL}), provides=frozenset({RECOMPUTED}),
            why="backward remakes the activations of ctx.segments; the plan step chooses them, try by try")


@dataclass
class Segment:
    start: int                                        # index of the boundary node before it (-1: graph start)
    nodes: list[fx.Node] = field(default_factory=list)  # interior forward ops
    saved_bytes: int = 0                              # bytes of interior values that backward reads
    recomputable: bool = True
    boundary: fx.Node | None = None                   # the kept node at `start` (None at graph start)
    end: int = -1                                     # index of the boundary node after it


def _unsafe(node: fx.Node, interior: set[fx.Node]) -> bool:
    """Ops that do not reproduce their values when run again: unseeded random ops, and in-place ops on a
    tensor made outside the segment (a buffer: recomputing would update it twice). An in-place op on a
    tensor the segment itself makes (dropout's mask, filled in place) is recomputed with it; batch norm's
    running statistics are not written by its copy (`clone_for_backward`)."""
    if is_random(node):
        return True
    dropped = running_stats_args(node) if without_stats_update(node) is not None else []
    for x in mutated_args(node):
        if any(x is d for d in dropped):
            continue
        while isinstance(x, fx.Node) and aliases_input(x, in_place=False) and x.args:
            x = x.args[0]              # the view's base: that is what is written
        if not (isinstance(x, fx.Node) and x in interior):
            return True
    return False


def find_segments(gm: fx.GraphModule) -> list[Segment]:
    g = gm.graph
    nodes = list(g.nodes)
    params = set(role_nodes(g, "param"))
    backward = backward_nodes(g)
    dynamic: set[fx.Node] = set(params)         # depends on a parameter: an activation
    for n in nodes:
        if n.op == "call_function" and n not in backward and any(a in dynamic for a in n.all_input_nodes):
            dynamic.add(n)
    forward = [n for n in nodes if n in dynamic and n not in params and n not in backward]
    fw_index = {n: i for i, n in enumerate(forward)}
    last_fw_use = {}
    for n in forward:
        for a in n.all_input_nodes:
            if a in fw_index:
                last_fw_use[a] = fw_index[n]
    segments = [Segment(-1)]
    alive: set[fx.Node] = set()
    for i, n in enumerate(forward):
        for a in n.all_input_nodes:
            if a in alive and last_fw_use.get(a) == i:
                alive.discard(a)
        if last_fw_use.get(n, -1) > i:
            alive.add(n)
        seg = segments[-1]
        if alive == {n} and not aliases_input(n) and seg.nodes:
            seg.end = i
            segments.append(Segment(i, boundary=n))   # n is a boundary: kept, and starts the next segment
        else:
            seg.nodes.append(n)
    segments[-1].end = len(forward)
    for seg in segments:
        owner: dict[fx.Node, fx.Node] = {}
        saved: set[fx.Node] = set()
        interior = set(seg.nodes)
        for n in seg.nodes:
            if _unsafe(n, interior):
                seg.recomputable = False
            base = n.args[0] if aliases_input(n) and n.args and isinstance(n.args[0], fx.Node) else None
            owner[n] = owner.get(base, base) if base is not None else n
            if any(u in backward for u in n.users):
                saved.add(owner[n])
        seg.saved_bytes = sum(value_bytes(o.meta.get("val")) for o in saved if o in owner)
    return [s for s in segments if s.nodes]


def group_segments(segments: list[Segment], size: int) -> list[Segment]:
    """Runs of up to `size` adjacent segments, each joined into one (inner boundaries become interior)."""
    groups: list[Segment] = []
    run = 0
    for seg in segments:
        last = groups[-1] if groups else None
        if last is not None and run < size and last.end == seg.start and last.recomputable and seg.recomputable:
            saved = last.saved_bytes + seg.saved_bytes + value_bytes(seg.boundary.meta.get("val"))
            groups[-1] = Segment(last.start, last.nodes + [seg.boundary] + seg.nodes, saved, True, last.boundary,
                                 seg.end)
            run += 1
        else:
            groups.append(seg)
            run = 1
    return groups


def recompute(gm: fx.GraphModule, segments: list[Segment], lint: bool = True) -> fx.GraphModule:
    """Rewrite `gm` so that backward recomputes the interior values of `segments`."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    backward = backward_nodes(g)
    for seg in segments:
        if not seg.recomputable:
            raise ValueError("segment with unseeded random ops or in-place ops on outside values cannot be "
                             "recomputed")
        interior = set(seg.nodes)
        uses = [(u, n) for n in seg.nodes for u in n.users if u in backward]
        if not uses:
            continue
        first = min((u for u, _ in uses), key=order.__getitem__)
        clones: dict[fx.Node, fx.Node] = {}

        def clone(n: fx.Node) -> fx.Node:
            if n not in interior:
                return n
            if n not in clones:
                for a in clone_reads(n):
                    clone(a)
                with g.inserting_before(first):
                    clones[n] = clone_for_backward(g, n, lambda a: clones.get(a, a))
            return clones[n]

        for user, n in uses:
            user.replace_input_with(n, clone(n))
    if lint:
        g.lint()
    gm.recompile()
    return gm


def clone_for_backward(g: fx.Graph, n: fx.Node, arg_transform) -> fx.Node:
    """A copy of forward op `n` for backward to read: the same op, except that a batch norm does not update
    BatchNorm's running statistics again (forward's copy already did; the output and batch statistics it
    recomputes are the same)."""
    rewrite = without_stats_update(n)
    if rewrite is None:
        return node_copy(g, n, arg_transform)
    target, args, kwargs = rewrite
    remade = g.call_function(target, fx.map_arg(args, arg_transform), fx.map_arg(kwargs, arg_transform))
    remade.meta = dict(n.meta)
    return remade


def clone_reads(n: fx.Node) -> list[fx.Node]:
    """The values `clone_for_backward`'s copy of `n` reads (a batch norm's copy: not the running statistics)."""
    rewrite = without_stats_update(n)
    if rewrite is None:
        return n.all_input_nodes
    reads: list[fx.Node] = []
    fx.map_arg((rewrite[1], rewrite[2]), reads.append)
    return list(dict.fromkeys(reads))


def backward_nodes(g: fx.Graph) -> set[fx.Node]:
    """The backward half of the joint graph: every op from the first one that reads the loss gradient on.

    By position, not by dependence: backward also holds ops that touch only saved forward values
    (detach, transpose of a saved activation), and those belong to backward too.
    """
    back: set[fx.Node] = set()
    tangent_deps: set[fx.Node] = set()
    for n in g.nodes:
        if n.op == "placeholder":
            if n.meta.get("role") == "tangent":
                tangent_deps.add(n)
            continue
        if back or any(a in tangent_deps for a in n.all_input_nodes):
            tangent_deps.add(n)
            back.add(n)
    return back
