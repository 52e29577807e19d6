"""localize_param_views: recompute every view of a parameter right before each op that reads it.

Needs: a joint graph whose parameter placeholders are tagged (capture does it).
Provides: no view of a parameter (t, view, permute, detach, ...) lives across other ops. Why: a parameter's
data is its chunk's compute buffer, which may be released and refilled between forward and backward; a
view made in forward and kept for backward would alias a buffer that by then holds another chunk. Views
cost nothing to recompute.
"""
from __future__ import annotations

import torch.fx as fx

from ..fxutil import aliases_input, node_copy, role_nodes
from .contract import CAPTURED, VIEWS_LOCAL, Pass, PassContext

NAME = "localize_param_views"


def run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return localize_param_views(gm)


PASS = Pass(NAME, run, requires=frozenset({CAPTURED}), provides=frozenset({VIEWS_LOCAL}),
            why="no view of a parameter outlives its chunk's compute buffer")


def is_view(node: fx.Node) -> bool:
    return aliases_input(node, in_place=False)


def localize_param_views(gm: fx.GraphModule) -> fx.GraphModule:
    g = gm.graph
    params = set(role_nodes(g, "param"))
    views: list[fx.Node] = []
    derived = set(params)
    for node in g.nodes:
        if is_view(node) and node.args and node.args[0] in derived:
            views.append(node)
            derived.add(node)
    view_set = set(views)

    def clone_chain(v: fx.Node) -> fx.Node:
        base = v.args[0]
        new_base = base if base in params else clone_chain(base)
        return node_copy(g, v, lambda n: new_base if n is base else n)

    for user in list(g.nodes):
        if user in view_set:
            continue
        for arg in [a for a in user.all_input_nodes if a in view_set]:
            with g.inserting_before(user):
                user.replace_input_with(arg, clone_chain(arg))
    for v in reversed(views):
        if not v.users:
            g.erase_node(v)
    g.lint()
    gm.recompile()
    return gm
