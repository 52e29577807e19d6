"""liveness: the bytes a graph's values hold, node by node — what the planner charges to the device for activations.

Each value lives from the node that makes it to its last reader; views share their base's allocation; an op's
temporaries (`node.meta["scratch_bytes"]`, written by the pass that inserted it, and CUDA's reduction staging)
count while it runs.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..fxutil import aliases_input, value_bytes


class LiveSet:
    """Bytes held by graph values: each owner (an allocation) lives while any value aliasing it lives."""

    def __init__(self):
        self.bytes = 0
        self.peak = 0
        self._refs: dict[object, list] = {}   # owner key -> [nbytes, refcount]

    def add(self, key, nbytes: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [nbytes, 1]
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
        else:
            entry[1] += 1

    def holds(self, key) -> bool:
        return key in self._refs

    def drop(self, key) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self._refs[key]


def last_uses(graph: fx.Graph | list[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """node -> values whose last reader is that node (freed right after it runs); of the graph's nodes in
    their order, or of a list of them in its own."""
    last: dict[fx.Node, fx.Node] = {}
    for node in (graph.nodes if isinstance(graph, fx.Graph) else graph):
        for arg in node.all_input_nodes:
            last[arg] = node
    out: dict[fx.Node, list[fx.Node]] = {}
    for value, node in last.items():
        out.setdefault(node, []).append(value)
    return out


# CUDA's reduction kernels (a bias gradient: sum over the rows) stage partial sums in a global buffer when one
# output's reduction is split across thread blocks: up to 4x the input's bytes, 16 MiB at most, seen for the
# small GPT's bias gradients (bench/small_peak.py, a memory snapshot at the peak)
_REDUCTIONS = {torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim}
CUDA_REDUCE_STAGING_BYTES = 16 * 2**20


def op_scratch_bytes(node: fx.Node, cuda: bool) -> int:
    """Bytes an op allocates while it runs besides its graph values (the planner adds them at that node)."""
    extra = node.meta.get("scratch_bytes", 0)     # written by the pass that inserted the op
    if cuda and node.op == "call_function" and node.target in _REDUCTIONS and node.args:
        x = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if isinstance(x, torch.Tensor):
            extra += min(CUDA_REDUCE_STAGING_BYTES, 4 * x.numel() * x.element_size())
    return extra


def activation_profile(graph: fx.Graph, skip: set[fx.Node], round_to: int = 1,
                       cuda: bool = False, order: list[fx.Node] | None = None,
                       frees: dict[fx.Node, list[fx.Node]] | None = None) -> tuple[list[int], int]:
    """Predicted live bytes of graph values after each node (excluding `skip`: chunk-backed values).

    Each output of a multi-output op is its own allocation: layer norm's normalized output dies after
    the next op while its mean and rstd live on for backward (counting the tuple as one block kept all
    three alive: 24 MiB per layer too many for a GPT on the H200, by bench/peak_probe.py).
    `order`: run the nodes in this order instead (a pass's reordering, before it is made); `frees`: node ->
    values freed after it (default: each value at its last use in that order).
    """
    live = LiveSet()
    owner: dict[fx.Node, list] = {}          # node -> the allocations it keeps alive
    order = list(graph.nodes) if order is None else order
    frees = last_uses(order) if frees is None else frees
    per_node = []
    peak = 0

    def hold(node: fx.Node, keys: list) -> None:
        owner[node] = keys
        for k in keys:
            live.add(k, 0)

    for node in order:
        if node in skip or node.op == "output":
            pass
        elif (node.target is operator.getitem and isinstance(node.args[0], fx.Node)
              and live.holds((node.args[0], node.args[1]))):
            hold(node, [(node.args[0], node.args[1])])       # one output of a multi-output op
        elif aliases_input(node) and node.args and isinstance(node.args[0], fx.Node):
            base = owner.get(node.args[0])
            if base is not None:
                hold(node, base)
        else:
            val = node.meta.get("val")
            if isinstance(val, (list, tuple)):
                keys = []
                for i, v in enumerate(val):
                    nb = value_bytes(v, round_to)
                    if nb:
                        live.add((node, i), nb)
                        keys.append((node, i))
                if keys:
                    owner[node] = keys
            else:
                nb = value_bytes(val, round_to)
                if nb:
                    live.add(node, nb)
                    owner[node] = [node]
        scratch = -(-op_scratch_bytes(node, cuda) // round_to) * round_to   # an op's temporaries while it runs
        per_node.append(live.bytes + scratch)
        peak = max(peak, live.bytes + scratch)
        for value in frees.get(node, []):
            for k in owner.pop(value, ()):
                live.drop(k)
        if node.op != "placeholder" and not node.users:
            for k in owner.pop(node, ()):
                live.drop(k)
    return per_node, max(peak, live.peak)
