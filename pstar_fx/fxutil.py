"""fxutil: what the passes and the memory model all need to know about a graph: each placeholder's role,
whether a value aliases its input, whether an op draws random numbers, and how many bytes a value holds."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx


ROLES = ("rt", "param", "buffer", "input", "tangent")


def tag(node: fx.Node, role: str, index: int) -> None:
    """Mark a placeholder with its role and its index among placeholders of that role (capture does this)."""
    assert role in ROLES, role
    node.meta["role"], node.meta["index"] = role, index


def role_nodes(graph: fx.Graph, role: str) -> list[fx.Node]:
    """The placeholders of one role, by index: parameters in `Capture.params` order, buffers, inputs."""
    nodes = [n for n in graph.find_nodes(op="placeholder") if n.meta.get("role") == role]
    return sorted(nodes, key=lambda n: n.meta["index"])


# ops whose output shares its input's storage though their schema does not say so
_UNANNOTATED_VIEWS = {torch.ops.aten._unsafe_view.default}


def op_of(node: fx.Node):
    """The op a node runs: its target, or the op a wrapper calls (passes.seed_random's seeded ops)."""
    return getattr(node.target, "seeded_op", node.target)


def aliases_input(node: fx.Node, *, in_place: bool = True) -> bool:
    """The node's output shares memory with its first input: a view (`_unsafe_view` too: matmul's
    reshape of its result), `getitem` of a multi-output op, or (with `in_place`) an in-place op. Such a
    value costs no new bytes."""
    if node.op != "call_function":
        return False
    target = op_of(node)
    if target is operator.getitem:
        return True
    if target in _UNANNOTATED_VIEWS:
        return True
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and (in_place or not r.alias_info.is_write)
                                      for r in schema.returns)


def is_random(node: fx.Node) -> bool:
    """The op draws random numbers (dropout, rand) from the global generator: running the graph again draws
    others. An op passes.seed_random wrapped is not: it draws the same numbers each time it runs."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    # attention with dropout_p == 0 is tagged random but is not
    args = dict(zip((a.name for a in schema.arguments), node.args)) | dict(node.kwargs)
    return args.get("dropout_p", 1.0) != 0.0


def mutated_args(node: fx.Node) -> list:
    """The arguments an in-place op writes (empty for a functional op)."""
    schema = getattr(op_of(node), "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    given = dict(zip((a.name for a in schema.arguments), node.args)) | dict(node.kwargs)
    return [given[a.name] for a in schema.arguments
            if a.alias_info is not None and a.alias_info.is_write and a.name in given]


def value_bytes(val, round_to: int = 1) -> int:
    """Bytes of the storage(s) behind a fake or real value, each rounded up to `round_to`."""
    if isinstance(val, torch.Tensor):
        n = val.untyped_storage().nbytes() if val.layout == torch.strided else 0
        return -(-n // round_to) * round_to
    if isinstance(val, (list, tuple)):
        return sum(value_bytes(v, round_to) for v in val)
    return 0
