"""recompute_ops: the forward values backward can remake for little time, one op (or a few) at a time.

Needs: the joint graph with localized parameter views, the cost model's rates.
Provides: `find_cheap_recomputes` lists values backward reads that a copy of the ops making them, run from
values backward keeps anyway (and parameters, inputs), remakes cheaply: a norm's output (its input and
statistics stay kept for the norm's backward), an activation's output (its input stays kept for the
activation's backward), a copy, and attention's output (its q, k, v stay kept for attention's backward).
Each pick says the bytes it stops keeping and the cost model's seconds to remake them, cheapest seconds per
byte first. `op_segments(picks)` turns any prefix of them into `recompute.Segment`s, which the recompute
pass clones right before backward's first use, as it does for whole forward segments.

Why: a whole segment recomputed also reruns its matmuls. Backward of a bf16 GPT block keeps about 32·h
bytes per token; the two layer norms' outputs, GELU's output and attention's output are 14·h of them, and
remaking them costs memory traffic (and attention's own FLOPs), not matmuls: for GPT3_18B at batch 16 × 1024
79 of 185 GiB of activations for 66 ms of a 2.6 s step's compute (nominal H200 rates). Found from the graph
alone (no module names), so LayerNorm and GELU, RMSNorm and SiLU gating, and Hugging Face models are all the
same case.

What is never picked: a value whose remake would need a value backward does not keep (then the inputs would
live longer instead: nothing saved), one whose kept inputs die before backward needs the value (the copy
would stretch their lives), unseeded random ops (seeded ones, passes.seed_random, redraw the same numbers),
values written in place by an op outside the copy, inputs written in place after the copy's ops ran, the
loss the step returns, and anything costlier per byte than recomputing whole segments (then those are
the better buy).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch.fx as fx

from ..planning.costs import Rates, node_seconds
from ..fxutil import aliases_input, is_random, mutated_args, op_of, value_bytes
from .recompute import Segment, _unsafe, backward_nodes, clone_reads

MAX_OPS = 4          # ops (views not counted) one pick may copy: past a few, it is a segment's job


@dataclass
class OpRecompute:
    value: object                       # the allocation no longer kept: its node, or (node, i) of a multi-output op
    nodes: list[fx.Node]                # forward ops the copy runs (views included), in graph order
    leaves: list[fx.Node]               # what the copy reads: kept values, parameters, inputs
    leaf_values: list                   # the allocation each leaf lives in
    saved_bytes: int                    # bytes of the value (rounded as the planner rounds)
    seconds: float                      # the copy's ops not already copied by an earlier pick, by the cost model
    kind: str = ""                      # the op that makes the value, for the plan summary


@dataclass
class _Component:                       # picks whose copies share ops or read each other's values: one copy
    nodes: set[fx.Node] = field(default_factory=set)
    leaves: set[fx.Node] = field(default_factory=set)
    values: set = field(default_factory=set)


def kind_of(nodes: list[fx.Node], value) -> str:
    """What a pick remakes, as a person says it: the op making the value (aten.native_layer_norm ->
    layer_norm, scaled_dot_product_* -> attention), or dropout when its copy redraws a seeded mask."""
    seeded = [n for n in nodes if op_of(n) is not n.target]       # passes.seed_random's wrappers
    node = seeded[0] if seeded else value[0] if isinstance(value, tuple) else value
    name = getattr(op_of(node), "__name__", str(node.target)).split(".")[0].strip("_")
    if seeded and name in ("bernoulli", "native_dropout", "dropout"):
        return "dropout"
    if "scaled_dot_product" in name:
        return "attention"
    return name.removeprefix("native_")


class _Graph:
    """What the finder asks of the graph: where each value's memory comes from, who reads and writes it."""

    def __init__(self, gm: fx.GraphModule, round_to: int):
        g = gm.graph
        self.round_to = round_to
        self.nodes = list(g.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.backward = backward_nodes(g)
        self._alloc: dict[fx.Node, object] = {}
        self.saved: dict[object, list[fx.Node]] = {}      # allocation -> its forward aliases backward reads
        self.returned: set = set()                        # allocations the step returns (the loss)
        self.last_use: dict[object, int] = {}             # allocation -> position of its last reader
        self.writers: dict[object, list[int]] = {}        # allocation -> positions of ops writing it in place
        self.first_backward_use: dict[fx.Node, int] = {}
        for n in self.nodes:
            for a in n.all_input_nodes:
                k = self.alloc(a)
                self.last_use[k] = max(self.last_use.get(k, -1), self.pos[n])
            for x in mutated_args(n):
                if isinstance(x, fx.Node):
                    self.writers.setdefault(self.alloc(x), []).append(self.pos[n])
            if n.op == "call_function" and n not in self.backward:
                readers = [u for u in n.users if u in self.backward]
                if readers:
                    k = self.alloc(n)
                    self.saved.setdefault(k, []).append(n)
                    self.first_backward_use[n] = min(self.pos[u] for u in readers)
                    if any(u.op == "output" for u in readers):
                        self.returned.add(k)

    def alloc(self, n: fx.Node):
        """The allocation a value lives in: through views to their base; one output of a multi-output op is
        its own allocation (layer norm's output dies early, its statistics live on)."""
        if n in self._alloc:
            return self._alloc[n]
        x = n
        while x.op == "call_function":
            base = x.args[0] if x.args and isinstance(x.args[0], fx.Node) else None
            if (x.target is operator.getitem and base is not None and not aliases_input(base)
                    and isinstance(base.meta.get("val"), (list, tuple))):
                key = (base, x.args[1])
                break
            if base is None or not aliases_input(x):
                key = x
                break
            x = base
        else:
            key = x
        self._alloc[n] = key
        return key

    def value_bytes(self, key) -> int:
        if isinstance(key, tuple):
            val = key[0].meta.get("val")
            val = val[key[1]] if isinstance(val, (list, tuple)) and key[1] < len(val) else None
        else:
            val = key.meta.get("val")
        return value_bytes(val, self.round_to)

    def kept(self, key, dropped: set) -> bool:
        """Backward reads it, or it is a graph input: there whether or not anything is recomputed."""
        return key not in dropped and (key in self.saved or not isinstance(key, tuple) and key.op == "placeholder")


def _copy_for(G: _Graph, value, dropped: set, copied: set[fx.Node]):
    """The ops that remake `value` from kept values, walking back through values nobody keeps (or dropped
    ones, whose own copies already run). None when it cannot be done within MAX_OPS ops that replay."""
    nodes: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    ops = 0
    stack = list(G.saved[value])
    while stack:
        n = stack.pop()
        if n in nodes or n in leaves:
            continue
        k = G.alloc(n)
        if n.op in ("placeholder", "get_attr") or (k != value and G.kept(k, dropped) and
                                                   (isinstance(k, tuple) or k.op != "placeholder")):
            leaves.add(n)            # kept: read it as it is (a parameter's views are copied, not kept)
            continue
        if n.op != "call_function" or n in G.backward:
            return None
        nodes.add(n)
        if not aliases_input(n) and n not in copied:
            ops += 1
            if ops > MAX_OPS:
                return None
        stack.extend(clone_reads(n))
    if any(is_random(n) or _unsafe(n, nodes) for n in nodes):
        return None
    return nodes, leaves


def _replays(G: _Graph, comp: _Component) -> bool:
    """The component's copy, run before backward's first use of any of its values, sees what forward saw and
    stretches no kept value's life."""
    start = min(G.pos[n] for n in comp.nodes)
    at = min(G.first_backward_use[n] for n in comp.nodes if n in G.first_backward_use)
    for value in comp.values:       # written in place only by the copy's own ops (dropout's mask, filled)
        if any(G.nodes[i] not in comp.nodes for i in G.writers.get(value, ())):
            return False
    for n in comp.nodes:
        k = G.alloc(n)
        if k not in comp.values and any(G.nodes[i] not in comp.nodes for i in G.writers.get(k, ())):
            return False
    for leaf in comp.leaves:
        k = G.alloc(leaf)
        if any(i > start for i in G.writers.get(k, ())):
            return False             # written after forward read it: the copy would read something else
        if leaf.op != "placeholder" and G.last_use.get(k, -1) < at:
            return False             # would live longer for the copy: nothing saved
    return True



def _remade(interior: list[fx.Node], backward: set[fx.Node]) -> set[fx.Node]:
    """The ops `recompute` copies for a whole segment: those its values read by backward come from (an op
    whose output only feeds the next boundary, like the block's output projection, is not copied)."""
    inside = set(interior)
    out: set[fx.Node] = set()
    stack = [n for n in interior if any(u in backward for u in n.users)]
    while stack:
        n = stack.pop()
        if n in inside and n not in out:
            out.add(n)
            stack.extend(n.all_input_nodes)
    return out


def find_cheap_recomputes(gm: fx.GraphModule, rates: Rates, round_to: int = 1,
                          segments: list[Segment] | None = None) -> list[OpRecompute]:
    """Values backward could remake cheaply, cheapest seconds per byte first; any prefix of the list can be
    dropped at once (`op_segments`). `round_to`: the planner's allocation rounding (CUDA's 512 B blocks).

    `segments` (find_segments'): a value costlier per byte than recomputing all recomputable segments is no
    pick (whole segments are then the better buy), and one copy stays within one segment: it runs where
    backward uses its values. Without, a residual stream value remade from its block pulls the blocks before
    it into one copy that runs at the start of backward and keeps all of them alive through it."""
    G = _Graph(gm, round_to)
    seconds = {n: node_seconds(n, rates) for n in G.nodes if n.op == "call_function" and n not in G.backward}
    region: dict[fx.Node, int] = {}
    limit = float("inf")
    if segments:
        for i, seg in enumerate(segments):
            region.update((n, i) for n in seg.nodes)
            if seg.boundary is not None:
                region.setdefault(seg.boundary, i - 1)     # the op ending the segment before it
        worth = [s for s in segments if s.recomputable and s.saved_bytes]
        if worth:
            spent = sum(seconds.get(n, 0.0) for s in worth for n in _remade(s.nodes, G.backward))
            limit = spent / sum(s.saved_bytes for s in worth)
    alone = []
    for value, readers in G.saved.items():
        if value in G.returned or not isinstance(value, tuple) and value.op == "placeholder":
            continue
        nbytes = G.value_bytes(value)
        found = _copy_for(G, value, set(), set()) if nbytes else None
        if found is None:
            continue
        per_byte = sum(seconds.get(n, 0.0) for n in found[0]) / nbytes
        if per_byte <= limit:
            alone.append((per_byte, G.pos[readers[0]], value, nbytes))
    alone.sort(key=lambda t: t[:2])

    picks: list[OpRecompute] = []
    dropped: set = set()
    comps: dict[int, _Component] = {}             # the copies so far, by serial number
    comp_of: dict[fx.Node, int] = {}
    reading: dict[object, set[int]] = {}          # allocation -> the copies that read it (some merged away)
    copied: set[fx.Node] = set()
    for _, _, value, nbytes in alone:
        found = _copy_for(G, value, dropped, copied)
        if found is None:
            continue
        nodes, leaves = found
        # one copy with those it shares ops with, and with those that read this value (they remake it now)
        touched = {comp_of[n] for n in nodes | leaves if n in comp_of} | reading.get(value, set())
        touched &= comps.keys()
        merged = _Component(set(nodes), set(leaves), {value})
        for c in touched:
            merged.nodes |= comps[c].nodes
            merged.leaves |= comps[c].leaves
            merged.values |= comps[c].values
        for leaf in list(merged.leaves):
            if G.alloc(leaf) == value:   # a view of it that another copy read: copied too, up to the value
                x = leaf
                while x not in merged.nodes and x.op == "call_function":
                    merged.nodes.add(x)
                    x = x.args[0]
        merged.leaves -= merged.nodes
        if len({region[n] for n in merged.nodes if n in region}) > 1 or not _replays(G, merged):
            continue
        by_pos = G.pos.__getitem__
        picks.append(OpRecompute(value, sorted(nodes, key=by_pos), sorted(leaves, key=by_pos),
                                 [G.alloc(n) for n in sorted(leaves, key=by_pos)], nbytes,
                                 sum(seconds.get(n, 0.0) for n in nodes - copied),
                                 kind_of(sorted(nodes, key=by_pos), value)))
        dropped.add(value)
        copied |= nodes
        for c in touched:
            del comps[c]
        serial = len(picks)
        comps[serial] = merged
        for n in merged.nodes:
            comp_of[n] = serial
        for leaf in merged.leaves:
            reading.setdefault(G.alloc(leaf), set()).add(serial)
    return picks


def op_segments(picks: list[OpRecompute], outside: set[fx.Node] = frozenset()) -> list[Segment]:
    """The picks as segments for `recompute`: picks whose copies share ops, or read a value another pick
    drops, become one copy. A copy that touches a node of `outside` (the interior of whole segments being
    recomputed, which remake those values their own way) is left out, with the picks joined to it."""
    if not picks:
        return []
    maker = {p.value: i for i, p in enumerate(picks)}
    parent = list(range(len(picks)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    nodes = [set(p.nodes) for p in picks]
    for i, p in enumerate(picks):
        for leaf, value in zip(p.leaves, p.leaf_values):
            j = maker.get(value)
            if j is not None:            # it reads a value pick j drops: the views up to it are copied too
                x = leaf
                while x not in nodes[j] and x.op == "call_function":
                    nodes[i].add(x)
                    x = x.args[0]
                parent[root(i)] = root(j)
    owner: dict[fx.Node, int] = {}
    for i, ns in enumerate(nodes):
        for n in ns:
            if n in owner:
                parent[root(i)] = root(owner[n])
            else:
                owner[n] = i
    groups: dict[int, set[fx.Node]] = {}
    left_out: set[int] = set()
    for i, p in enumerate(picks):
        groups.setdefault(root(i), set()).update(nodes[i])
        if outside and not outside.isdisjoint(nodes[i] | set(p.leaves)):
            left_out.add(root(i))
    pos = {n: k for k, n in enumerate(picks[0].nodes[0].graph.nodes)}
    return [Segment(-1, sorted(ns, key=pos.__getitem__)) for r, ns in groups.items() if r not in left_out]
