"""seed_random: every random op draws from a generator seeded by (Config.seed, step, micro-batch, op).

Needs: the captured joint graph with the `rt` placeholder.
Provides: each op that draws random numbers (dropout's bernoulli, rand, the attention kernels' dropout) is
called through a wrapper that first reseeds the device's default generator for that op alone
(`rt.seed_random(k)`, k = the op's index in the graph). Its arguments are unchanged, so the other passes
and the cost model read it as the op it wraps (`fxutil.op_of`).

What this buys: the same op in the same step draws the same numbers however often it runs. Recompute's copy
of a segment with dropout replays its masks, a replayed step (transaction "replay") draws what it drew
the first time, and two runs with one seed are identical, whatever else used torch's global generator.
The runtime restores the global generator's state after each run of the graph, so the user's own random
stream is not disturbed by the step.
"""
from __future__ import annotations

import torch.fx as fx

from ..fxutil import is_random, role_nodes
from .contract import CAPTURED, RANDOM_SEEDED, Pass, PassContext

NAME = "seed_random_ops"


def run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return seed_random_ops(gm)


PASS = Pass(NAME, run, requires=frozenset({CAPTURED}), provides=frozenset({RANDOM_SEEDED}),
            why="a random op redraws the same numbers when recomputed or replayed")

_WRAPPERS: dict = {}


def seeded(op):
    """The wrapper of `op` the graph calls: `f(*args, _rt, _rng, **kwargs)` reseeds, then runs `op`."""
    if op not in _WRAPPERS:
        def call(*args, _rt, _rng, **kwargs):
            _rt.seed_random(_rng)
            return op(*args, **kwargs)
        name = "seeded_" + "".join(c if c.isalnum() else "_" for c in str(op))
        call.__name__ = call.__qualname__ = name
        call.__module__ = __name__
        call.seeded_op = op
        _WRAPPERS[op] = call
    return _WRAPPERS[op]


def seed_random_ops(gm: fx.GraphModule) -> fx.GraphModule:
    g = gm.graph
    rt = role_nodes(g, "rt")[0]
    k = 0
    for node in g.nodes:
        if node.op == "call_function" and is_random(node):
            node.target = seeded(node.target)
            node.kwargs = {**node.kwargs, "_rt": rt, "_rng": k}
            k += 1
    g.lint()
    gm.recompile()
    return gm
