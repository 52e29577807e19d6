"""capture: model + example inputs -> one joint FX graph of forward and backward, traced without real memory.

The model is copied structurally with every parameter and buffer replaced by a FakeTensor (parameters in
the compute dtype, on the target device), then AOTAutograd's joint export traces forward + backward into
one ATen graph. Nothing is allocated, so a 10B model captures in seconds on a laptop-sized machine.

Graph contract (what later passes may rely on):
  placeholders, in order: one per unique parameter (`Capture.params`), one per buffer, one per user input,
  then `tangent` (the loss gradient fed to backward, normally 1.0);
  output: a flat tuple (new values of mutated buffers..., loss, grads in `Capture.params` order);
  a tied parameter is one placeholder; its gradient contributions are summed in the graph.
"""
from __future__ import annotations

import contextlib
import copy
import os
import traceback
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode


class CaptureError(RuntimeError):
    """The model cannot be captured as one graph. The message names the op and the model's source line."""


@dataclass
class ParamInfo:
    name: str                      # the model's own name (first of `aliases`)
    aliases: list[str]             # every name under which the model holds this parameter (tied weights)
    shape: torch.Size
    requires_grad: bool
    has_grad: bool = False         # the graph produces a gradient for it

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass
class InputInfo:
    shape: torch.Size
    dtype: torch.dtype
    index_bound: int | None = None   # integer input used as indices: valid values are [0, bound)
    ignore_index: int | None = None  # a value allowed besides [0, bound) (cross_entropy's ignore_index)


@dataclass
class Capture:
    gm: fx.GraphModule
    params: list[ParamInfo]
    buffers: list[str]
    mutated_buffers: list[str]       # the output's leading values, in this order
    inputs: list[InputInfo]
    device: torch.device
    dtype: torch.dtype
    fake_mode: FakeTensorMode = field(repr=False)

    def placeholders(self) -> list[fx.Node]:
        return list(self.gm.graph.find_nodes(op="placeholder"))


def capture(model: nn.Module, example_inputs: tuple, device: torch.device, dtype: torch.dtype) -> Capture:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, (tuple, list)) or not all(isinstance(x, torch.Tensor) for x in example_inputs):
        raise TypeError("example_inputs: expected a tuple of tensors, one per positional argument of forward()")
    fake_mode = FakeTensorMode()
    fake_model = _fake_copy(model, fake_mode, device, dtype)
    with fake_mode:
        fake_inputs = tuple(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
                            for x in example_inputs)
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32
                else contextlib.nullcontext())
    try:
        with contextlib.ExitStack() as stack, autocast:
            joint = aot_export_joint_with_descriptors(stack, fake_model, fake_inputs)
    except Exception as e:  # noqa: BLE001 - re-raised with the user's source line
        raise CaptureError(_explain_capture_failure(model, e)) from e
    return _normalize(joint.graph_module, model, example_inputs, device, dtype, fake_mode)


def _fake_copy(model: nn.Module, mode: FakeTensorMode, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A structural copy of `model` whose parameters/buffers are FakeTensors; tied parameters stay tied."""
    memo: dict[int, object] = {}
    with mode:
        for p in model.parameters():
            pdtype = dtype if p.is_floating_point() else p.dtype
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=pdtype, device=device),
                                       requires_grad=p.requires_grad)
        for b in model.buffers():
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
    return copy.deepcopy(model, memo)


def _normalize(gm: fx.GraphModule, model: nn.Module, example_inputs, device, dtype, fake_mode) -> Capture:
    g = gm.graph
    g._codegen = fx.graph.CodeGen()  # plain positional signature instead of pytree flattening
    by_name = dict(model.named_parameters(remove_duplicate=False))
    placeholders = list(g.find_nodes(op="placeholder"))
    output = g.output_node()
    out_descs = output.meta.get("desc") or [None] * len(output.args[0])
    outs = list(output.args[0])

    grad_of: dict[str, fx.Node | None] = {}
    mutated: dict[str, fx.Node] = {}
    loss = None
    for node, desc in zip(outs, out_descs):
        kind = type(desc).__name__
        if kind == "GradAOTOutput":
            grad_of[desc.grad_of.target] = node
        elif kind == "InputMutationAOTOutput":
            target = getattr(desc.mutated_input, "target", None)
            if type(desc.mutated_input).__name__ != "BufferAOTInput":
                raise CaptureError(f"forward() mutates an input in place ({desc.mutated_input}); only buffers may be mutated")
            mutated[target] = node
        elif kind == "PlainAOTOutput":
            if loss is not None:
                raise CaptureError("forward() must return one scalar loss tensor, but it returns several outputs")
            loss = node
    val = loss.meta.get("val") if loss is not None else None
    if not isinstance(val, torch.Tensor) or val.dim() != 0 or not val.is_floating_point():
        raise CaptureError("forward() must return a scalar (0-d) floating-point loss tensor, got "
                           + (f"shape {tuple(val.shape)} {val.dtype}" if isinstance(val, torch.Tensor) else repr(val)))

    params: list[ParamInfo] = []
    first_by_id: dict[int, tuple[ParamInfo, fx.Node]] = {}
    buffers, inputs, input_nodes, tangent = [], [], [], None
    for node in placeholders:
        desc = node.meta.get("desc")
        kind = type(desc).__name__
        if kind == "ParamAOTInput":
            p = by_name[desc.target]
            grad = grad_of.get(desc.target)
            if id(p) in first_by_id:   # a tied weight: one placeholder, gradients summed
                info, first = first_by_id[id(p)]
                info.aliases.append(desc.target)
                node.replace_all_uses_with(first)
                g.erase_node(node)
                if grad is not None:
                    prev = grad_of.get(info.name)
                    if prev is None:
                        grad_of[info.name] = grad
                    else:
                        with g.inserting_before(output):
                            grad_of[info.name] = g.call_function(torch.ops.aten.add.Tensor, (prev, grad))
                            grad_of[info.name].meta["val"] = prev.meta["val"]
                continue
            info = ParamInfo(desc.target, [desc.target], p.shape, p.requires_grad)
            first_by_id[id(p)] = (info, node)
            params.append(info)
            node.name = node.target = "p_" + _ident(desc.target)
        elif kind == "BufferAOTInput":
            buffers.append(desc.target)
            node.name = node.target = "b_" + _ident(desc.target)
        elif kind == "PlainAOTInput":
            x = example_inputs[desc.idx]
            inputs.append(InputInfo(x.shape, x.dtype))
            input_nodes.append(node)
            node.name = node.target = f"input_{desc.idx}"
        elif kind == "TangentAOTInput":
            tangent = node
            node.name = node.target = "tangent"
        else:
            raise CaptureError(f"unexpected graph input {desc!r}")
    for info in params:
        info.has_grad = grad_of.get(info.name) is not None

    # The new output: mutated buffers, loss, one gradient (or None) per unique parameter.
    mutated_names = [b for b in buffers if b in mutated]
    new_out = [mutated[b] for b in mutated_names] + [loss] + [grad_of.get(i.name) for i in params]
    output.args = (tuple(new_out),)
    output.meta.pop("desc", None)
    if tangent is None:
        raise CaptureError("the loss does not require grad: no parameter of the model contributes to it")
    for node, info in zip(input_nodes, inputs):
        _find_index_bound(node, info)
    g.eliminate_dead_code()
    g.lint()
    gm.recompile()
    return Capture(gm, params, buffers, mutated_names, inputs, device, dtype, fake_mode)


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


_INDEX_USES = {
    torch.ops.aten.embedding.default: (1, lambda n: n.args[0].meta["val"].shape[0], None),
    torch.ops.aten.nll_loss_forward.default: (1, lambda n: n.args[0].meta["val"].shape[-1], 4),
    torch.ops.aten.nll_loss2d_forward.default: (1, lambda n: n.args[0].meta["val"].shape[1], 4),
}


def _find_index_bound(node: fx.Node, info: InputInfo) -> None:
    """Integer inputs that index a table (embedding rows, loss classes) get a valid range checked per step."""
    if info.dtype.is_floating_point or info.dtype == torch.bool:
        return
    frontier, seen = [node], set()
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            use = _INDEX_USES.get(user.target)
            if use is not None and len(user.args) > use[0] and user.args[use[0]] is n:
                bound = int(use[1](user))
                info.index_bound = bound if info.index_bound is None else min(info.index_bound, bound)
                if use[2] is not None and len(user.args) > use[2]:
                    info.ignore_index = int(user.args[use[2]])
                continue
            val = user.meta.get("val")
            tensor_args = [a for a in user.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
            if (isinstance(val, torch.Tensor) and not val.is_floating_point() and tensor_args == [n]):
                frontier.append(user)   # a reshape/slice/cast of the same ids


def _explain_capture_failure(model: nn.Module, e: Exception) -> str:
    frame = _user_frame(e)
    op = getattr(e, "func", None) or _op_from_message(str(e))
    where = f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`" if frame else "(no source line found)"
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    hint = ""
    if "DataDependent" in type(e).__name__ or "data-dependent" in str(e).lower() or "_local_scalar_dense" in str(e):
        hint = (" The model's Python reads a tensor's value (if/while on a tensor, .item(), .tolist(), bool()),"
                " which one static graph cannot express; use torch.where or move the decision out of forward().")
    return (f"cannot capture {type(model).__name__} as one graph: op {op or '?'} at {where}. "
            f"{type(e).__name__}: {reason}.{hint}")


def _op_from_message(msg: str) -> str | None:
    for word in msg.replace(",", " ").split():
        if word.startswith("aten.") or word.startswith("aten::"):
            return word
    return None


_LIB_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, contextlib, fx))
_OWN_DIR = os.path.dirname(__file__) + os.sep


def _user_frame(e: BaseException):
    """The innermost traceback frame in the user's code (not torch, not the stdlib, not pstar_fx.capture)."""
    best = None
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for fr in traceback.extract_tb(e.__traceback__):
            fn = os.path.abspath(fr.filename)
            if fn.startswith(_LIB_DIRS) or fn.startswith(_OWN_DIR) or fn.startswith("<"):
                continue
            best = fr
        e = e.__cause__ or e.__context__
    return best
