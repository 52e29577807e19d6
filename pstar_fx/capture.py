"""capture: model + example inputs -> one joint FX graph of forward and backward, traced without real memory.

The model is copied structurally with every parameter and buffer replaced by a FakeTensor (parameters in
the compute dtype, on the target device). `make_fx` then traces one function — the model's forward through
`torch.func.functional_call`, then `torch.autograd.grad` of the loss — into one ATen graph: the same joint
graph AOTAutograd builds, without its functionalization pass (about 2.5x faster on big models; the
price is that in-place ops stay in place, which the runtime executes in graph order anyway). Nothing is
allocated, so a 10B model captures in seconds. A model with a stack of blocks alike is traced cut to a few of them
and the rest stamped (capture_blocks.py): the same graph, in a third of the time at 18B.

Graph contract (what later passes may rely on):
  placeholders, in order: one per unique parameter (`Capture.params`), one per buffer, one per tensor input
  (positional ones first, then keyword ones in the example's order: `Capture.signature`), then `tangent` (the loss gradient fed to backward: 1.0, or loss scale / micro-batches); each carries its
  role ("param", "buffer", "input", "tangent") and index in `node.meta` (`fxutil.role_nodes` finds them);
  output: a flat tuple (loss, one gradient or None per parameter in `Capture.params` order);
  a tied parameter is one placeholder, and its gradient is already the sum of its uses;
  buffers the model updates (BatchNorm statistics) are updated in place, by ops in the graph;
  constants the model's forward makes (`torch.tensor(...)`) are `get_attr` nodes of the graph module.

What forward may return: the loss (a 0-d float tensor), an object with a `.loss` (a Hugging Face
`ModelOutput`), or a tuple or list whose first element is the loss. Inference-only paths are switched off: a
forward that takes `use_cache` (or hands **kwargs on to a model whose config has it: peft) gets `use_cache=False`
unless the example inputs say otherwise.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

from . import capture_blocks
from .fxutil import role_nodes, tag

log = logging.getLogger("pstar_fx")

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
    name: str                        # "input 0" for a positional input, else the keyword
    shape: torch.Size
    dtype: torch.dtype
    index_bound: int | None = None   # integer input used as indices: valid values are [0, bound)
    ignore_index: int | None = None  # a value allowed besides [0, bound) (cross_entropy's ignore_index)


@dataclass(frozen=True)
class Signature:
    """How a batch maps to forward()'s arguments: `n_args` positional tensors, then keyword tensors by name,
    and keyword constants (not tensors: `use_cache=False`) fixed at capture."""
    n_args: int
    keywords: tuple[str, ...]
    constants: dict = field(default_factory=dict)

    @classmethod
    def of(cls, example_inputs, model: nn.Module) -> tuple[Signature, list[torch.Tensor]]:
        """The signature of `example_inputs` (a tensor, a tuple of tensors, or a dict of keyword arguments)
        and its tensors in placeholder order."""
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        if isinstance(example_inputs, Mapping):
            args, kwargs = (), dict(example_inputs)
        elif isinstance(example_inputs, (tuple, list)):
            args, kwargs = tuple(example_inputs), {}
        else:
            raise TypeError("example_inputs: expected a tuple of tensors (forward's positional arguments) or a dict "
                            f"(its keyword arguments), got {type(example_inputs).__name__}")
        for i, x in enumerate(args):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"example_inputs[{i}]: expected a tensor, got {type(x).__name__}; pass "
                                "non-tensor arguments by keyword in a dict")
        bad = [k for k in kwargs if not isinstance(k, str)]
        if bad:
            raise TypeError(f"example_inputs: dict keys must be forward()'s argument names, got {bad[:5]}")
        tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        for k, v in constants.items():
            if not (v is None or isinstance(v, (bool, int, float, str))):
                raise TypeError(f"example_inputs[{k!r}]: a {type(v).__name__}; keyword arguments must be tensors "
                                "or constants (None, bool, int, float, str)")
        if "use_cache" not in kwargs and _takes_use_cache(model):
            constants["use_cache"] = False       # training never reads a KV cache; building one adds constants
        return cls(len(args), tuple(tensors), constants), [*args, *tensors.values()]

    def names(self) -> list[str]:
        return [f"input {i}" for i in range(self.n_args)] + list(self.keywords)

    def call_args(self, tensors) -> tuple[tuple, dict]:
        """forward()'s (args, kwargs) for the tensors in placeholder order."""
        tensors = list(tensors)
        return tuple(tensors[:self.n_args]), {**dict(zip(self.keywords, tensors[self.n_args:])), **self.constants}

    def bind(self, args: tuple, kwargs: dict) -> list:
        """A batch given as step()'s arguments -> its tensors in placeholder order. A single dict argument is
        the keyword arguments (a batch dict). Names missing or not compiled, or a value that is not a tensor,
        are an error naming them."""
        if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
            args, kwargs = (), dict(args[0])
        if len(args) != self.n_args:
            raise TypeError(f"the step takes {self.n_args} input(s) by position, like the example_inputs it was "
                            f"compiled with; got {len(args)}")
        kwargs = {k: v for k, v in kwargs.items() if not (k in self.constants and _same(v, self.constants[k]))}
        missing = [k for k in self.keywords if k not in kwargs]
        extra = [k for k in kwargs if k not in self.keywords]
        if missing or extra:
            raise TypeError("the batch's keyword inputs differ from the compiled ones: "
                            + "; ".join(f"{what} {names}" for what, names in (("missing", missing), ("not compiled", extra))
                                        if names)
                            + f" (compiled with {list(self.keywords)}" + (f", constants {self.constants}" if self.constants
                                                                          else "") + ")")
        tensors = [*args, *(kwargs[k] for k in self.keywords)]
        for name, x in zip(self.names(), tensors):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
        return tensors


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def _takes_use_cache(model: nn.Module) -> bool:
    """forward() takes `use_cache`: by name, or (a wrapper such as peft's `PeftModel`, whose forward hands its
    keyword arguments on to a Hugging Face model) through **kwargs where the model's config has the field."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "use_cache" in params or (any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
                                     and hasattr(getattr(model, "config", None), "use_cache"))


def loss_of(out):
    """The loss in what forward returned: the tensor itself, `.loss` (a ModelOutput), or a sequence's first."""
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None) if not isinstance(out, (tuple, list)) else None
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, (tuple, list)) and out:
        loss = out[0]
    if loss is None:
        raise CaptureError(f"forward() returned a {type(out).__name__} without a loss: return the loss, an object "
                           "with .loss (a Hugging Face model given labels=...), or a tuple whose first element is it")
    return loss


@dataclass
class Capture:
    gm: fx.GraphModule
    params: list[ParamInfo]
    buffers: list[str]
    inputs: list[InputInfo]
    device: torch.device
    dtype: torch.dtype
    traced_on: torch.device          # differs from `device` when planning for CUDA on a machine without it
    signature: Signature

    def param_nodes(self) -> list[fx.Node]:
        return role_nodes(self.gm.graph, "param")


def capture(model: nn.Module, example_inputs, device: torch.device, dtype: torch.dtype,
            forward_only: bool = False, signature: Signature | None = None) -> Capture:
    """The joint graph of the training step, in the mode the model is in (its training mode);
    `forward_only`: the loss alone, in the model's eval mode (evaluation: no gradients, dropout off,
    BatchNorm on its running statistics). `example_inputs`: see `Signature.of`; with `signature` (another
    capture's), its tensors in placeholder order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if signature is None:
        signature, example_inputs = Signature.of(example_inputs, model)
    example_inputs = list(example_inputs)
    # A CPU-only torch cannot even fake a CUDA tensor (it aborts), so a plan for CUDA made on such a
    # machine traces on the CPU: same shapes, but CPU attention kernels and CPU autocast rules.
    traced_on = device if device.type != "cuda" or torch.cuda.is_available() else torch.device("cpu")
    fake_mode = FakeTensorMode()
    fake_model = _fake_copy(model, fake_mode, traced_on, dtype)
    _traceable_experts(fake_model, dtype)
    if forward_only:
        fake_model.eval()
    named_params = dict(model.named_parameters())                 # unique; tied names resolved below
    param_names = list(named_params)
    buffer_names = [n for n, _ in model.named_buffers()]
    with fake_mode:
        fake_inputs = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=traced_on)
                       for x in example_inputs]
        tangent = torch.ones((), device=traced_on)
    trainable = [i for i, p in enumerate(fake_model.parameters()) if p.requires_grad]
    if not trainable and not forward_only:
        raise CaptureError(f"every parameter of {type(model).__name__} is frozen (requires_grad=False): there is "
                           "nothing to train; set requires_grad=True on the parameters to train (a LoRA model: "
                           "peft's get_peft_model marks the adapters trainable)")

    def trace(module: nn.Module) -> fx.GraphModule:
        return _trace(module, fake_inputs, tangent, signature, forward_only, traced_on, dtype)

    try:
        gm = capture_blocks.by_blocks(fake_model, trace) if capture_blocks.wanted() and not forward_only else None
        if gm is None:
            gm = trace(fake_model)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the user's source line
        raise CaptureError(_explain_capture_failure(model, e)) from e
    return _normalize(gm, model, param_names, buffer_names, trainable, example_inputs, device, traced_on, dtype,
                      signature)


def _trace(fake_model: nn.Module, fake_inputs: list, tangent: torch.Tensor, signature: Signature, forward_only: bool,
           traced_on: torch.device, dtype: torch.dtype) -> fx.GraphModule:
    """make_fx of the step of `fake_model` (a fake copy: the whole model, or one cut to fewer blocks by
    capture_blocks), its placeholders its own parameters, buffers, then `fake_inputs` and `tangent`."""
    param_names = list(dict(fake_model.named_parameters()))
    buffer_names = [n for n, _ in fake_model.named_buffers()]
    fake_params = [p.detach().requires_grad_(p.requires_grad) for p in fake_model.parameters()]
    fake_buffers = list(fake_model.buffers())
    # frozen parameters (requires_grad=False) are inputs autograd does not differentiate: the traced backward has
    # no weight gradient for them (only what flows through them to the trainable ones)
    trainable = [i for i, p in enumerate(fake_params) if p.requires_grad]

    def step(params, buffers, inputs, tangent):
        state = {**dict(zip(param_names, params)), **dict(zip(buffer_names, buffers))}
        args, kwargs = signature.call_args(inputs)
        loss = loss_of(torch.func.functional_call(fake_model, state, args, kwargs))
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
    # a lazy GraphModule: its Python code is generated when first run or read, not after every pass that
    # changes the graph (~0.3 s a time at 18B)
    with autocast, (torch.no_grad() if forward_only else contextlib.nullcontext()), _quiet_fake_kernels(), \
            _use_lazy_graph_module(True):
        return make_fx(step, tracing_mode="fake")(fake_params, fake_buffers, fake_inputs, tangent)


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


def _traceable_experts(fake_model: nn.Module, dtype: torch.dtype) -> None:
    """Hugging Face MoE models (Mixtral, Qwen2-MoE, OLMoE, ...) run their experts with `torch._grouped_mm` by
    default (`config._experts_implementation == "grouped_mm"`), whose fake-tensor kernel accepts only bf16
    although eager runs it in fp32 too: capture in another dtype would fail at that op. The copy traced here
    switches to "batched_mm", the same per-token expert products as batched matmuls (the model's own
    config is untouched: `_fake_copy` copied it)."""
    if dtype == torch.bfloat16:
        return
    configs = {id(c): c for m in fake_model.modules() if (c := getattr(m, "config", None)) is not None}
    switched = [c for c in configs.values() if getattr(c, "_experts_implementation", None) == "grouped_mm"]
    for config in switched:
        config._experts_implementation_internal = "batched_mm"
    if switched:
        log.info("%s: experts traced with experts_implementation='batched_mm' (torch's grouped_mm is traced in "
                 "bf16 only; compute dtype %s)", type(fake_model).__name__, str(dtype).removeprefix("torch."))


@contextlib.contextmanager
def _quiet_fake_kernels():
    """FakeTensorMode logs the whole traceback of a failing fake kernel (about 60 lines) before raising; the
    CaptureError raised from it says which op and where, and chains the original error."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _normalize(gm, model, param_names, buffer_names, trainable, example_inputs, device, traced_on,
               dtype, signature: Signature) -> Capture:
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
    for k, (node, x, name) in enumerate(zip(placeholders[n_p + n_b: n_p + n_b + n_i], example_inputs,
                                            signature.names())):
        _rename(node, f"input_{k}" if k < signature.n_args else "in_" + _ident(name))
        tag(node, "input", k)
        inputs.append(InputInfo(name, x.shape, x.dtype))
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
    return Capture(gm, params, buffer_names, inputs, device, dtype, traced_on, signature)


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
    op = getattr(e, "func", None) or _op_from_message(str(e)) or _op_from_traceback(e)
    where = f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`" if frame else "(no source line found)"
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    hint = ""
    if "DataDependent" in type(e).__name__ or "data-dependent" in str(e).lower() or "_local_scalar_dense" in str(e):
        hint = (" The model's Python reads a tensor's value (if/while on a tensor, .item(), .tolist(), bool()),"
                " which one static graph cannot express; use torch.where or move the decision out of forward().")
    return (f"cannot capture {type(model).__name__} as one graph: op {op or '?'} at {where}. "
            f"{type(e).__name__}: {reason.rstrip('.')}.{hint}")


def _op_from_message(msg: str) -> str | None:
    for word in msg.replace(",", " ").split():
        if word.startswith("aten.") or word.startswith("aten::"):
            return word
    return None


def _op_from_traceback(e: BaseException) -> str | None:
    """The ATen op the failing dispatch was running: the innermost frame whose local `func` is an op overload
    (FakeTensorMode's dispatch holds it there when an op's fake kernel raises)."""
    found = None
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            func = tb.tb_frame.f_locals.get("func")
            if isinstance(func, torch._ops.OpOverload):
                found = func
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return str(found) if found is not None else None         # aten._grouped_mm.default


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


def check_has_data(x: torch.Tensor, name: str) -> None:
    """A batch's tensor has values: one on the meta device has none (torch would say only "Cannot copy out of
    meta tensor")."""
    if x.is_meta:
        raise ValueError(f"{name}: a tensor on the meta device holds no values to run on; pass one with data "
                         "(meta tensors serve as example_inputs of compile() and plan(), which read shapes only)")


def check_inputs(cap: Capture, args: tuple, kwargs: dict, grad_accum: int,
                 device: torch.device) -> list[list[torch.Tensor]]:
    """A step's batch, checked against the shapes `cap` was captured for, on `device`, split into `grad_accum`
    micro-batches."""
    specs = cap.inputs
    k = grad_accum
    inputs = cap.signature.bind(args, kwargs)
    out = []
    for x, spec in zip(inputs, specs):
        i = spec.name
        check_has_data(x, i)
        if x.dtype != spec.dtype:
            raise TypeError(f"{i}: dtype {x.dtype}, but the step was compiled for {spec.dtype}")
        want = spec.shape if k == 1 else torch.Size((spec.shape[0] * k, *spec.shape[1:])) if spec.shape else None
        if want is None:
            raise ValueError(f"{i}: a 0-d input cannot be split into grad_accum={k} micro-batches")
        if x.shape != want:
            raise ValueError(f"{i}: shape {tuple(x.shape)}, but the step was compiled for "
                             f"{tuple(want)}" + (f" (grad_accum={k} micro-batches of {tuple(spec.shape)})"
                                                 if k > 1 else "") + "; compile again for another shape")
        if spec.index_bound is not None and x.numel():
            ok = (x >= 0) & (x < spec.index_bound)
            if spec.ignore_index is not None:
                ok |= x == spec.ignore_index
            if not bool(ok.all()):
                bad = x[~ok].flatten()[0].item()
                raise ValueError(f"{i}: value {bad} is out of range; the model uses this input as ids "
                                 f"in [0, {spec.index_bound})")
        # contiguous: a graph of another shape is traced on contiguous inputs (pipeline/shapes.py), and every view
        # a graph takes of a strided input is valid on its contiguous copy (a no-op for a contiguous batch)
        x = x.to(device, non_blocking=True).contiguous()
        if any(x is y for y in out):   # one tensor passed twice (labels=input_ids): the compiled regions were
            x = x.view(x.shape)        # built for distinct inputs, and a repeated one would recompile them
        out.append(x)
    if k == 1:
        return [out]
    return [[x.chunk(k)[j] for x in out] for j in range(k)]
