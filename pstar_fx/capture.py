"""capture: model + example inputs -> one joint FX graph of forward and backward, traced without real memory.

The model is copied structurally with every parameter and buffer replaced by a FakeTensor (parameters in
the compute dtype, on the target device). `make_fx` then traces one function — the model's forward through
`torch.func.functional_call`, then `torch.autograd.grad` of the loss — into one ATen graph: the same joint
graph AOTAutograd builds, without its functionalization pass (about 2.5x faster on big models; the
price is that in-place ops stay in place, which the runtime executes in graph order anyway). Nothing is
allocated, so a 10B model captures in seconds.

Graph contract (what later passes may rely on):
  placeholders, in order: one per unique parameter (`Capture.params`), one per buffer, one per user input,
  then `tangent` (the loss gradient fed to backward: 1.0, or loss scale / micro-batches); each carries its
  role ("param", "buffer", "input", "tangent") and index in `node.meta` (`fxutil.role_nodes` finds them);
  output: a flat tuple (loss, one gradient or None per parameter in `Capture.params` order);
  a tied parameter is one placeholder, and its gradient is already the sum of its uses;
  buffers the model updates (BatchNorm statistics) are updated in place, by ops in the graph.
"""
from __future__ import annotations

import contextlib
import copy
import os
import traceback
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from .fxutil import role_nodes, tag


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
    inputs: list[InputInfo]
    device: torch.device
    dtype: torch.dtype
    traced_on: torch.device          # differs from `device` when planning for CUDA on a machine without it

    def param_nodes(self) -> list[fx.Node]:
        return role_nodes(self.gm.graph, "param")


def capture(model: nn.Module, example_inputs: tuple, device: torch.device, dtype: torch.dtype,
            forward_only: bool = False) -> Capture:
    """The joint graph of the training step; `forward_only`: the loss alone, in the model's eval mode
    (evaluation: no gradients, dropout off, BatchNorm on its running statistics)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, (tuple, list)) or not all(isinstance(x, torch.Tensor) for x in example_inputs):
        raise TypeError("example_inputs: expected a tuple of tensors, one per positional argument of forward()")
    # A CPU-only torch cannot even fake a CUDA tensor (it aborts), so a plan for CUDA made on such a
    # machine traces on the CPU: same shapes, but CPU attention kernels and CPU autocast rules.
    traced_on = device if device.type != "cuda" or torch.cuda.is_available() else torch.device("cpu")
    fake_mode = FakeTensorMode()
    fake_model = _fake_copy(model, fake_mode, traced_on, dtype)
    if forward_only:
        fake_model.eval()
    named_params = dict(model.named_parameters())                 # unique; tied names resolved below
    param_names = list(named_params)
    buffer_names = [n for n, _ in model.named_buffers()]
    with fake_mode:
        fake_inputs = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=traced_on)
                       for x in example_inputs]
        fake_params = [p.detach().requires_grad_(p.requires_grad) for p in fake_model.parameters()]
        fake_buffers = list(fake_model.buffers())
        tangent = torch.ones((), device=traced_on)
    trainable = [i for i, p in enumerate(fake_params) if p.requires_grad]

    def step(params, buffers, inputs, tangent):
        state = {**dict(zip(param_names, params)), **dict(zip(buffer_names, buffers))}
        loss = torch.func.functional_call(fake_model, state, tuple(inputs))
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            raise CaptureError("forward() must return a scalar (0-d) floating-point loss tensor, got "
                               + (f"shape {tuple(loss.shape)} {loss.dtype}" if isinstance(loss, torch.Tensor)
                                  else type(loss).__name__))
        if forward_only:
            return loss, [None] * len(trainable)
        if not loss.requires_grad:
            raise CaptureError("the loss does not require grad: no trainable parameter contributes to it")
        grads = torch.autograd.grad(loss, [params[i] for i in trainable], grad_outputs=tangent.to(loss.dtype),
                                    allow_unused=True)
        return loss, list(grads)

    autocast = (torch.autocast(traced_on.type, dtype=dtype) if dtype != torch.float32
                else contextlib.nullcontext())
    try:
        with autocast, (torch.no_grad() if forward_only else contextlib.nullcontext()):
            gm = make_fx(step, tracing_mode="fake")(fake_params, fake_buffers, fake_inputs, tangent)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the user's source line
        raise CaptureError(_explain_capture_failure(model, e)) from e
    return _normalize(gm, model, param_names, buffer_names, trainable, example_inputs, device, traced_on, dtype)


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


def _normalize(gm, model, param_names, buffer_names, trainable, example_inputs, device, traced_on,
               dtype) -> Capture:
    g = gm.graph
    g._codegen = fx.graph.CodeGen()  # plain positional signature instead of pytree flattening
    placeholders = list(g.find_nodes(op="placeholder"))
    n_p, n_b, n_i = len(param_names), len(buffer_names), len(example_inputs)
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    named = dict(model.named_parameters())
    params = [ParamInfo(n, aliases[id(named[n])], named[n].shape, named[n].requires_grad) for n in param_names]
    for k, (node, info) in enumerate(zip(placeholders[:n_p], params)):
        _rename(node, "p_" + _ident(info.name))
        tag(node, "param", k)
    for k, (node, name) in enumerate(zip(placeholders[n_p: n_p + n_b], buffer_names)):
        _rename(node, "b_" + _ident(name))
        tag(node, "buffer", k)
    inputs = []
    for k, (node, x) in enumerate(zip(placeholders[n_p + n_b: n_p + n_b + n_i], example_inputs)):
        _rename(node, f"input_{k}")
        tag(node, "input", k)
        inputs.append(InputInfo(x.shape, x.dtype))
        _find_index_bound(node, inputs[-1])
    _rename(placeholders[-1], "tangent")
    tag(placeholders[-1], "tangent", 0)

    output = g.output_node()
    loss, *grads = output.args[0]
    by_param: list[fx.Node | None] = [None] * n_p
    for i, grad in zip(trainable, grads):
        by_param[i] = grad
        params[i].has_grad = grad is not None
    output.args = ((loss, *by_param),)
    g.eliminate_dead_code(is_impure_node=_keeps_mutations)
    g.lint()
    gm.recompile()
    return Capture(gm, params, buffer_names, inputs, device, dtype, traced_on)


def _keeps_mutations(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.is_impure() or (schema is not None and schema.is_mutable)


def _rename(node: fx.Node, name: str) -> None:
    node._rename(name)
    node.target = node.name


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
