"""runner: the lowered graph run node by node, with the CPU device tier's budget enforced after each node."""
from __future__ import annotations

import torch
import torch.fx as fx

from ..config import format_bytes
from ..planning.liveness import LiveSet, last_uses


def run_graph(gm: fx.GraphModule, args: list, rt, skip_args: int) -> tuple:
    """Run the lowered graph node by node, measuring the device bytes of live values after each node.

    Chunk-backed tensors and the first `skip_args` arguments (rt, buffers: accounted by the store) are not
    counted again. Values are dropped at their last use, as the generated code does.
    """
    graph = gm.graph
    frees = last_uses(graph)
    env: dict[fx.Node, object] = {}
    live = LiveSet()
    budget = rt.config.device_memory
    stats = rt.stats
    keys: dict[fx.Node, list[int]] = {}
    arg_iter = iter(args)
    n_placeholder = 0

    def load(a):
        return fx.node.map_arg(a, lambda n: env[n])

    for node in graph.nodes:
        if node.op == "placeholder":
            val = next(arg_iter)
            n_placeholder += 1
        elif node.op == "call_function":
            val = node.target(*load(node.args), **load(node.kwargs))
        elif node.op == "call_method":
            obj, *rest = load(node.args)
            val = getattr(obj, node.target)(*rest, **load(node.kwargs))
        elif node.op == "get_attr":         # a constant the model's forward made (torch.tensor(...))
            val = fx.graph_module._get_attr(gm, node.target)
        elif node.op == "output":
            return load(node.args[0])
        else:
            raise RuntimeError(f"unexpected node {node.format_node()}")
        env[node] = val
        if not (node.op == "placeholder" and n_placeholder <= skip_args):
            ks = keys[node] = []
            for t in _tensors(val):
                if t.device == rt.device and not rt.owns(t):
                    k = t.untyped_storage().data_ptr()
                    live.add(k, t.untyped_storage().nbytes())
                    ks.append(k)
            total = stats.device_bytes + live.bytes
            if total > stats.device_peak_bytes:
                stats.device_peak_bytes = total
                if budget is not None and total > budget:
                    raise MemoryError(f"device tier over budget at {node.name}: {format_bytes(total)} > "
                                      f"device_memory {format_bytes(budget)}")
        for value in frees.get(node, []):
            for k in keys.pop(value, ()):
                live.drop(k)
            env.pop(value, None)
        if not node.users and node in keys:
            for k in keys.pop(node):
                live.drop(k)
    raise RuntimeError("graph has no output node")


def _tensors(val):
    if isinstance(val, torch.Tensor):
        yield val
    elif isinstance(val, (list, tuple)):
        for v in val:
            yield from _tensors(v)
