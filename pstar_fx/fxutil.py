"""fxutil: what the passes and the memory model all need to know about a graph: each placeholder's role,
whether a value aliases its input, whether an op draws random numbers, and how many bytes a value holds."""
from __future__ import annotations

import operator
import re

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


_ALIASING: dict[tuple[int, bool], tuple[object, bool]] = {}     # (id(op), in_place) -> (op, aliases_input)


def aliases_input(node: fx.Node, *, in_place: bool = True) -> bool:
    """The node's output shares memory with its first input: a view (`_unsafe_view` too: matmul's
    reshape of its result), `getitem` of a multi-output op, or (with `in_place`) an in-place op. Such a
    value costs no new bytes."""
    if node.op != "call_function":
        return False
    target = op_of(node)
    # read from the op's schema once per op: the planner asks several times per node of every recompute try (1.7 M
    # times in the 70B LoRA's search, 5 of its 62 s); keyed by id, the op kept to tell a reused id apart
    known = _ALIASING.get((id(target), in_place))
    if known is None or known[0] is not target:
        known = _ALIASING[(id(target), in_place)] = (target, _op_aliases_input(target, in_place))
    return known[1]


def _op_aliases_input(target, in_place: bool) -> bool:
    if target is operator.getitem or target in _UNANNOTATED_VIEWS:
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


def _given(node: fx.Node, schema) -> dict:
    return dict(zip((a.name for a in schema.arguments), node.args)) | dict(node.kwargs)


def mutated_args(node: fx.Node) -> list:
    """The arguments an in-place op writes (empty for a functional op), batch norm's running statistics
    included (`running_stats_args`: its schema does not say it writes them)."""
    schema = getattr(op_of(node), "_schema", None)
    if schema is None:
        return []
    stats = [a for a in running_stats_args(node) if isinstance(a, fx.Node)]
    if not schema.is_mutable:
        return stats
    given = _given(node, schema)
    written = [given[a.name] for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write and a.name in given]
    return written + [a for a in stats if a not in written]


# Batch norms that update running_mean / running_var in place when `training` is true. The legacy ones
# (native, cuDNN, MIOpen) do it although their schema marks no argument as written, so the schema alone
# would call them functional: a recomputed copy would then move BatchNorm's statistics a second time.
# op -> the overload that computes the same output and batch statistics without touching running ones
# (None: the same op, its running statistics given as None).
_STATS_UPDATING = {
    torch.ops.aten.native_batch_norm.default: None,
    torch.ops.aten.cudnn_batch_norm.default: None,
    torch.ops.aten.miopen_batch_norm.default: None,
    torch.ops.aten._native_batch_norm_legit.default: torch.ops.aten._native_batch_norm_legit.no_stats,
}


def running_stats_args(node: fx.Node) -> list:
    """The running statistics (running_mean, running_var: BatchNorm's buffers) a batch norm in training
    mode updates each time it runs; empty for any other op, and for a batch norm in eval mode."""
    if node.op != "call_function" or op_of(node) not in _STATS_UPDATING:
        return []
    given = _given(node, op_of(node)._schema)
    if not given.get("training", False):
        return []
    return [given[k] for k in ("running_mean", "running_var") if given.get(k) is not None]


def without_stats_update(node: fx.Node) -> tuple | None:
    """(target, args, kwargs) of the same batch norm minus its running-statistics update: the same output
    and batch statistics (training mode computes both from the batch alone), BatchNorm's buffers untouched.
    What a recomputed copy runs, so that a step moves each running statistic once. None for other ops (and
    for one wrapped by passes.seed_random: batch norm draws nothing, so none is)."""
    if not running_stats_args(node) or op_of(node) is not node.target:
        return None
    schema = node.target._schema
    given = _given(node, schema)
    plain = _STATS_UPDATING[node.target]
    if plain is None:
        given["running_mean"] = given["running_var"] = None
        return node.target, tuple(given[a.name] for a in schema.arguments if a.name in given), {}
    names = [a.name for a in plain._schema.arguments]
    return plain, tuple(given[n] for n in names), {}


def value_bytes(val, round_to: int = 1) -> int:
    """Bytes of the storage(s) behind a fake or real value, each rounded up to `round_to`."""
    if isinstance(val, torch.Tensor):
        n = val.untyped_storage().nbytes() if val.layout == torch.strided else 0
        return -(-n // round_to) * round_to
    if isinstance(val, (list, tuple)):
        return sum(value_bytes(v, round_to) for v in val)
    return 0


class NodeRef(int):
    """A node of a graph, by its position: what a node in an op's arguments becomes where the node itself must not
    be held (`code_later`) or compared (a region's key)."""

    def __repr__(self):
        return f"%{int(self)}"


def args_by_position(node: fx.Node, at: dict[fx.Node, int]):
    """(args, kwargs) of `node` with each node in them a NodeRef of its position in `at`."""
    return fx.map_arg((node.args, node.kwargs), lambda a: NodeRef(at[a]))


def code_later(graph: fx.Graph):
    """A function giving `graph`'s Python code as a GraphModule of it has it now (`gm.code`), made when called.
    Taking it is cheap (per node: its name, op, target, arguments with nodes as positions, and type), generating
    it is not (~0.4 s at 18B). What is taken holds no node: a graph's nodes hold its values' fake tensors, which a
    record must not keep alive (ranks aborted at exit when it did)."""
    at = {n: i for i, n in enumerate(graph.nodes)}
    nodes = [(n.name, n.op, n.target, *args_by_position(n, at), n.type) for n in graph.nodes]
    codegen = graph._codegen

    def code() -> str:
        g = fx.Graph()
        g._codegen = codegen
        made: list[fx.Node] = []
        node_of = lambda a: made[a] if isinstance(a, NodeRef) else a  # noqa: E731
        for name, op, target, args, kwargs, type_ in nodes:
            made.append(g.create_node(op, target, fx.node.map_aggregate(args, node_of),
                                      fx.node.map_aggregate(kwargs, node_of), name, type_))
        return g.python_code(root_module="self").src
    return code


def _has_node_internals(g: fx.Graph) -> bool:
    """Whether `g` has the internals `create_node` uses that `node_copy` and `copy_graph` use directly."""
    space, lookup = getattr(g, "_graph_namespace", None), getattr(g, "_find_nodes_lookup_table", None)
    return all(hasattr(o, a) for o, a in [(space, "create_name"), (space, "associate_name_with_obj"),
                                          (space, "_used_names"), (space, "_base_count"),
                                          (lookup, "insert"), (g, "_insert"), (g, "_len")])


_FAST = _has_node_internals(fx.Graph())      # (this torch's Graph: asked once, not per node copied)


_NUMBERED = re.compile(r"^(.*?)(?:_(\d+))?$")


def _unused_name(space, name: str) -> str:
    """`name`, or where `g` has it (a node copied into its own graph: the recompute pass's clones, a localized
    view) the next free `base_N`, as torch 2.13's `create_name` picks it. Torch up to 2.11 looks the count up under
    the whole name (`mm_12`) instead of its base (`mm`) and so tries `mm_1`, `mm_2`, ... every time: quadratic in
    the graph's size (93 of the 197 s a 70B LoRA plan took on the H200 box's torch 2.11, in `create_name`). A name
    handed over unused skips that loop on any torch."""
    if name not in space._used_names:
        return name
    base = _NUMBERED.match(name).group(1)
    num = space._base_count.get(base, 0) + 1
    while f"{base}_{num}" in space._used_names:
        num += 1
    return f"{base}_{num}"


def _add(g: fx.Graph, node: fx.Node, args: tuple, kwargs: dict, name: str | None = None) -> fx.Node:
    """A node like `node` with `args`/`kwargs` (named `name`, else as `node`), made and linked at `g`'s insert point
    as `create_node` does, without its walk over every argument to warn about raw SymInts (60% of a copy's time in
    torch 2.13): the arguments come from a checked graph. Meta copied shallowly, as `Graph.node_copy` does."""
    space = g._graph_namespace
    name = space.create_name(_unused_name(space, name or node.name), None)
    n = fx.Node(g, name, node.op, node.target, args, kwargs, node.type)
    space.associate_name_with_obj(name, n)
    g._insert(n)
    g._find_nodes_lookup_table.insert(n)
    g._len += 1
    n.meta.update(node.meta)        # (into the node's own empty dict: assigning `meta` re-files the node in the
    return n                        # graph's lookup table, ~10 us a node, hashing its target)


def node_copy(g: fx.Graph, node: fx.Node, arg_transform, name: str | None = None) -> fx.Node:
    """`g.node_copy(node, arg_transform)` (at `g`'s insert point), for the passes that copy thousands of nodes;
    `name`: the copy's name (else `node`'s, or the next free one like it)."""
    if not _FAST or node.op in ("output", "placeholder"):
        n = g.node_copy(node, arg_transform)
        if name is not None:
            n._rename(name)
        return n
    return _add(g, node, fx.map_arg(node.args, arg_transform), fx.map_arg(node.kwargs, arg_transform), name)


def copy_graph(src: fx.Graph) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A copy of `src` (its output included; each node's meta copied shallowly, as `Graph.graph_copy` does) and the
    map from its nodes to the copy's. The recompute search copies the whole step for every try, without
    `create_node`'s argument walk (`_add`); `graph_copy` where torch's Graph lacks the internals this uses."""
    g = fx.Graph()
    g._codegen = src._codegen
    nodes: dict[fx.Node, fx.Node] = {}
    if not _FAST:
        g.output(g.graph_copy(src, nodes))
        return g, nodes
    remap = nodes.__getitem__
    for node in src.nodes:
        args, kwargs = fx.map_arg(node.args, remap), fx.map_arg(node.kwargs, remap)
        if node.op == "output":
            g.output(args[0])
            break
        nodes[node] = _add(g, node, args, kwargs)
    return g, nodes
