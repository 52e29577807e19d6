"""lean_loss: cross-entropy in the memory of its log-probabilities, forward and backward.

Needs: the joint graph (any stage before the planner).
Provides:
  backward  every `nll_loss_backward` -> `_log_softmax_backward_data` pair that reads a 2-D log_softmax
            output nobody reads afterwards becomes one in-place op, `pstar_fx::cross_entropy_backward_`,
            which turns the saved log-probabilities into the gradient of the logits:
            scale * (softmax - onehot(target)).
  forward   a 2-D `_log_softmax` whose input is a fresh tensor read by nothing else (autocast's fp32
            copy of the logits) runs in place on it, `pstar_fx::log_softmax_`, a block of rows at a time.

Why: a language model's loss is its widest tensor. For a GPT with a 50257-token vocabulary at 16 x 1024
tokens, the fp32 log-probabilities take 3.07 GiB; ATen's backward allocates a second such tensor for the
nll gradient (zeros with one entry per row) and a third for the log_softmax gradient, while the first is
still alive: 9.2 GiB at the top of backward, which is where a recomputing step peaks. In place, it is
the 3.07 GiB already there. Forward held the fp32 copy of the logits and its log_softmax at once (6.1
GiB); in place, 3.07. The math is ATen's (grad - exp(out) * sum(grad) with one non-zero per row; the
forward is torch.log_softmax on each block), so results match to rounding.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .contract import CAPTURED, LEAN_LOSS, Pass, PassContext

NAME = "lean_cross_entropy"


def run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return lean_cross_entropy(gm)


PASS = Pass(NAME, run, requires=frozenset({CAPTURED}), provides=frozenset({LEAN_LOSS}), optional=True,
            why="the loss's widest tensors are computed in the memory of its log-probabilities (before the plan)")

aten = torch.ops.aten
_REDUCTION_MEAN = 1                    # ATen's reduction enum: 0 none, 1 mean, 2 sum
_ALIAS_OPS = (aten.detach.default, aten.alias.default)


@torch.library.custom_op("pstar_fx::cross_entropy_backward_", mutates_args=("log_probs",))
def cross_entropy_backward_(log_probs: torch.Tensor, grad_output: torch.Tensor, target: torch.Tensor,
                            total_weight: torch.Tensor, reduction: int, ignore_index: int) -> None:
    """log_probs [N, C] (log_softmax over dim 1) becomes d loss / d logits, in place."""
    valid = target != ignore_index
    scale = grad_output / total_weight if reduction == _REDUCTION_MEAN else grad_output
    row_scale = torch.where(valid, scale.to(log_probs.dtype), 0.0)          # [N]
    # in ATen's order (grad - exp(out) * sum(grad), grad being -scale at the target): scale the softmax,
    # then subtract scale at the target; subtracting 1 first and scaling after rounds differently, and a
    # near-zero gradient (BERT's query bias) then lands 6x further from float64 than torch's own result
    log_probs.exp_()                                                        # softmax
    log_probs.mul_(row_scale.unsqueeze(1))
    hit = torch.where(valid, target, 0).unsqueeze(1)
    log_probs.scatter_add_(1, hit, -row_scale.unsqueeze(1))


@cross_entropy_backward_.register_fake
def _(log_probs, grad_output, target, total_weight, reduction, ignore_index):
    return None


_BLOCK_BYTES = 64 * 2**20     # the temporary of one block of rows (node.meta["scratch_bytes"], for the planner)


@torch.library.custom_op("pstar_fx::log_softmax_", mutates_args=("x",))
def log_softmax_(x: torch.Tensor) -> None:
    """x [N, C] becomes log_softmax(x, dim=1), in place, `_BLOCK_BYTES` of rows at a time."""
    rows = max(1, _BLOCK_BYTES // max(1, x.shape[1] * x.element_size()))
    for start in range(0, x.shape[0], rows):
        block = x[start:start + rows]
        block.copy_(torch.log_softmax(block, dim=1))


@log_softmax_.register_fake
def _(x):
    return None


def scratch_bytes(node: fx.Node) -> int:
    """Bytes an op this pass inserted allocates while it runs, besides its graph values: log_softmax_'s one
    block of rows. Written into the op's `node.meta["scratch_bytes"]`, where the planner reads it."""
    if node.op != "call_function" or node.target is not torch.ops.pstar_fx.log_softmax_.default:
        return 0
    x = node.args[0].meta.get("val")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        return 0
    row = x.shape[1] * x.element_size()
    rows = max(1, _BLOCK_BYTES // max(1, row))
    return min(rows, x.shape[0]) * row


def _base(node: fx.Node) -> fx.Node:
    """Through detach/alias nodes to the value they alias."""
    while node.op == "call_function" and node.target in _ALIAS_OPS:
        node = node.args[0]
    return node


def lean_cross_entropy(gm: fx.GraphModule) -> fx.GraphModule:
    _lean_backward(gm.graph)
    _lean_forward(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm


def _lean_forward(g: fx.Graph) -> None:
    for ls in list(g.find_nodes(op="call_function", target=aten._log_softmax.default)):
        x, dim, half_to_float = ls.args[:3]
        val = ls.meta.get("val")
        if (half_to_float or val is None or val.dim() != 2 or dim not in (1, -1) or not isinstance(x, fx.Node)
                or len(x.users) != 1 or x.target is not aten._to_copy.default
                or x.meta.get("val") is None or x.meta["val"].dtype != val.dtype):
            continue
        with g.inserting_before(ls):
            op = g.call_function(torch.ops.pstar_fx.log_softmax_.default, (x,))
        op.meta["scratch_bytes"] = scratch_bytes(op)     # the planner reads it (planning/liveness.py)
        ls.replace_all_uses_with(x)
        g.erase_node(ls)


def _lean_backward(g: fx.Graph) -> None:
    order = {n: i for i, n in enumerate(g.nodes)}
    for lsb in list(g.find_nodes(op="call_function", target=aten._log_softmax_backward_data.default)):
        nb, out, dim, input_dtype = lsb.args[:4]
        if not (isinstance(nb, fx.Node) and nb.target is aten.nll_loss_backward.default and len(nb.users) == 1):
            continue
        grad_output, nll_input, target, weight, reduction, ignore_index, total_weight = nb.args[:7]
        ls = _base(out)
        if weight is not None or _base(nll_input) is not ls or ls.target is not aten._log_softmax.default:
            continue
        val = ls.meta.get("val")
        if val is None or val.dim() != 2 or dim not in (1, -1) or input_dtype != val.dtype:
            continue
        # every other reader of the log-probabilities (through aliases) runs before: they are overwritten
        readers, stack = [], [ls]
        while stack:
            v = stack.pop()
            for u in v.users:
                if u.op == "call_function" and u.target in _ALIAS_OPS:
                    stack.append(u)
                elif u is not nb and u is not lsb:
                    readers.append(u)
        if any(u.op == "output" or order[u] > order[lsb] for u in readers):
            continue
        with g.inserting_before(lsb):
            g.call_function(torch.ops.pstar_fx.cross_entropy_backward_.default,
                            (ls, grad_output, target, total_weight, reduction, ignore_index))
        lsb.replace_all_uses_with(ls)
        g.erase_node(lsb)
        g.erase_node(nb)
        if out is not ls and not out.users:
            g.erase_node(out)                                # the detach only lsb read
