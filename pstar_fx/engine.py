"""engine: `pstar_fx.compile(model, config, example_inputs) -> Engine`, and `pstar_fx.plan(...)`.

The pipeline, in order: capture -> layout -> passes (`pstar_fx.passes.PIPELINE`, run by `pipeline/lower.py`)
-> runtime (chunk memory allocated once the plan is made, then the weights written and the regions built while
its host part is page-locked: `startup.py`). `Engine.graph` is the lowered step;
`Engine.explain()` says what the plan decided; `Engine.memory_stats()` says what the runtime measured.
"""
from __future__ import annotations

import logging
import os
import warnings
import weakref
from collections import Counter

import torch
import torch.fx as fx
from torch import nn

from . import checkpoint
from .capture import check_has_data, check_inputs
from .checkpoint.adapters import adapter_of
from .config import Config
from .fxutil import role_nodes
from .pipeline.lower import Lowered
from .pipeline.shapes import ShapeSteps, check_compiled_length
from .planning import BudgetError, Plan
from .runtime import ChunkRuntime, StepRolledBack, run_graph
from .runtime.dist import DataParallel, launch
from .runtime.host_rate import HostRateCheck
from .runtime.step import StepReport, Stepper
from .runtime.weights import masters_by_chunk, masters_from_rank0, skeleton
from .startup import Startup, build_regions_now

log = logging.getLogger("pstar_fx")


def _runner(graph: fx.GraphModule, rt: ChunkRuntime, buffers: list, device: torch.device, tangent_dtype):
    """One forward + backward of the lowered graph on one micro-batch. A closure, not an Engine method: the
    Stepper holds it, and a reference back to the Engine would keep its memory alive until a GC cycle."""
    def run(inputs: list[torch.Tensor], tangent: torch.Tensor) -> torch.Tensor:
        args = [rt, *buffers, *inputs, tangent.to(device, tangent_dtype)]
        with rt.rng:
            if device.type == "cpu":
                outs = run_graph(graph, args, rt, skip_args=1 + len(buffers))
            else:
                outs = graph(*args)
        return outs[0].detach()
    return run


def _shape_runner(rt: ChunkRuntime, buffers: list, device: torch.device, tangent_dtype):
    """A step lowered for other input shapes -> its runner on the engine's runtime (pipeline/shapes.py): its
    regions built, then `_runner`. A closure for the same reason as `_runner`."""
    def prepare(lowered: Lowered):
        build_regions_now(lowered.graph, device, lowered.phases)
        return _runner(lowered.graph, rt, buffers, device, tangent_dtype)
    return prepare


class Engine:
    """A compiled training step: `step(*inputs) -> loss` runs forward, backward and the optimizer."""

    def __init__(self, model: nn.Module, config: Config | dict | str | None = None, example_inputs=None,
                 resume: str | os.PathLike | None = None):
        config = Config.coerce(config)
        if example_inputs is None:
            raise TypeError("compile() needs example_inputs: a tuple of tensors shaped like one batch (forward's "
                            "positional arguments), or a dict of them (its keyword arguments)")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device: {config.device!r} requested but CUDA is not available here; "
                             "use device='cpu' (the CPU then plays the device tier)")
        check_compiled_length(example_inputs, config)
        config, rank, world = launch(config)          # one GPU per launched rank; the device's free memory
        self.config = config
        if not model.training:
            warnings.warn(f"{type(model).__name__} is in eval mode: the step is captured in the mode the model is in, "
                          "so it trains with dropout off and BatchNorm on its running statistics; call model.train() "
                          "before compile() for training behaviour (engine.evaluate runs eval mode either way)",
                          UserWarning, stacklevel=3)
        # the chunk memory, the initial weights and the region builds, side by side from the plan on (startup.py)
        with Startup(model, config, example_inputs) as startup:
            self.lowered = Lowered(model, config, example_inputs, phases=startup.phases, host_hint=startup.hint,
                                   on_planned=startup.allocate if world == 1 else None)
            self.phases = startup.phases
            if not self.lowered.plan.fits:
                raise BudgetError(self.lowered.plan.why)
            self.device = self.lowered.device
            self.dp = DataParallel(rank, world, chunked=self.lowered.chunked) if world > 1 else None
            self.rt = startup.finish(self.lowered, self.dp)
        # where a cold compile's region builds went, worker by worker (empty when no worker built: a warm cache)
        self.region_build_times: list[dict] = startup.build_times
        named, meta = startup.named, startup.meta
        cap, plan = self.lowered.capture, self.lowered.plan
        self._buffers = [self.rt.store.adopt(model.get_buffer(b).detach().to(self.device, copy=True))
                         for b in cap.buffers]
        if self.dp is not None:
            with torch.no_grad():                 # every rank starts from rank 0's weights and buffers
                if not self.dp.chunked:
                    for t in self.rt.store.master:
                        self.dp.broadcast_(t)
                elif not meta:
                    masters_from_rank0(named, self.rt.store, self.lowered.layout, cap, self.dp)
                for t in self._buffers:
                    self.dp.broadcast_(t)
            self.rt.store.masters_changed()
        persistent = set(model.state_dict(keep_vars=True))
        self._persistent = [b in persistent for b in cap.buffers]
        self._skeleton = skeleton(model)     # its structure, for capturing evaluation on first use
        self._adapter = adapter_of(model)    # a peft model: its checkpoint is the adapter, as peft writes it
        self._model = weakref.ref(model)     # only to say so when its mode changes after compile
        self._mode = model.training
        self._evaluator = None
        self._tangent_dtype = role_nodes(cap.gm.graph, "tangent")[0].meta["val"].dtype
        compiled_run = _runner(self.lowered.graph, self.rt, self._buffers, self.device, self._tangent_dtype)
        self.stepper = Stepper(self.rt, config, plan.transaction, compiled_run, self._buffers)
        # the host Adam's rate in training against the plan's (one rank measures: the ranks share one host)
        self.host_rate = HostRateCheck(plan.estimate, config.optimizer_state, self.device, self.lowered.dtype,
                                       self.rt.telemetry, learns=self.dp is None or self.dp.rank == 0)
        # steps at other input shapes: their graphs on this chunk memory, run by the same runtime and Stepper
        self.shapes = ShapeSteps(self.lowered, compiled_run, self._skeleton, _shape_runner(
            self.rt, self._buffers, self.device, self._tangent_dtype))
        if config.seq_buckets is not None:   # each bucket shown to fit now, not found wanting mid-run
            self.shapes.lower_buckets()
        self.last_step: StepReport | None = None
        if resume is not None:
            self.load(resume)

    # ---- the step ----------------------------------------------------------------------------------
    def step(self, *inputs, **kw_inputs) -> torch.Tensor:
        """One optimizer step on a batch: forward, backward and the update, as one transaction (a step that
        fails or must be skipped changes no weight). The batch is given as the example inputs were: tensors
        positionally, or by keyword (`step(input_ids=x, labels=y)`, or a batch dict `step(batch)`). With
        `grad_accum` k the batch's leading dimension is k times the compiled one: k micro-batches, one update.
        A batch of other shapes (another sequence length) runs on a graph of its own, captured and planned on this
        chunk memory at its first step and cached (`engine.shapes`, pipeline/shapes.py).
        Returns the loss (the micro-batches' mean); `engine.last_step` says what the step did."""
        bound = self.lowered.capture.signature.bind(inputs, kw_inputs)
        for x, spec in zip(bound, self.lowered.capture.inputs):
            check_has_data(x, spec.name)                         # (before a new shape would be captured)
        lowered, run = self.shapes.get(bound)
        micro = check_inputs(lowered.capture, inputs, kw_inputs, self.config.grad_accum, self.device)
        model = self._model()
        if model is not None and model.training != self._mode:
            self._mode = model.training                          # said once per change
            warnings.warn(f"the model was switched to {'train' if model.training else 'eval'} mode after compile(); "
                          f"that changes nothing: the step runs in the mode it was captured in "
                          f"({'eval' if model.training else 'train'}); engine.evaluate() is the eval-mode loss",
                          UserWarning, stacklevel=2)
        report = self.stepper.step(micro, run)
        self.last_step = report
        self.host_rate.after_step(lowered is self.lowered)
        if report.skipped:
            what = "the step was skipped" + (f"; loss scale {report.loss_scale:g} -> {self.stepper.scaler.scale:g}"
                                              if self.stepper.scaler.dynamic else "")
            warnings.warn(f"step {self.steps + 1}: non-finite gradients; {what} (no weight changed)",
                          RuntimeWarning, stacklevel=2)
        return torch.tensor(report.loss)

    def evaluate(self, *inputs, **kw_inputs) -> torch.Tensor:
        """The loss of a batch, forward only, in the model's eval mode: no gradient, no update, no state change.
        The batch is given as to step(), of any shape. Captured and planned on first use for these input shapes,
        on the training step's chunk memory."""
        inputs = self.lowered.capture.signature.bind(inputs, kw_inputs)
        for x, spec in zip(inputs, self.lowered.capture.inputs):
            check_has_data(x, spec.name)
        shapes = [(tuple(x.shape), x.dtype) for x in inputs]
        if self._evaluator is None or self._evaluator[0] != shapes:
            graph = self.lowered.lower_evaluation(self._skeleton, inputs, self.rt.stats.device_bytes)
            self._evaluator = (shapes, _runner(graph, self.rt, self._buffers, self.device, self._tangent_dtype))
        self.rt.copies.start_step()
        loss = self._evaluator[1]([x.to(self.device) for x in inputs], torch.ones(()))
        self.rt.mover.check_idle()
        return loss.float().cpu()

    @property
    def steps(self) -> int:
        """Optimizer updates applied (skipped steps do not count): Adam's step count and the schedule's."""
        return self.stepper.applied

    @property
    def lr(self) -> float:
        """The learning rate the next update will use."""
        return self.stepper.lr

    def drain(self) -> None:
        """Wait until every update of the last step has landed (host Adam may still be running)."""
        try:
            self.rt.drain()
        except StepRolledBack:
            self.stepper.rolled_back()
            raise

    # ---- what the user reads -----------------------------------------------------------------------
    @property
    def graph(self) -> fx.GraphModule:
        return self.lowered.graph

    @property
    def plan(self) -> Plan:
        return self.lowered.plan

    @property
    def dtype(self) -> torch.dtype:
        return self.lowered.dtype

    def graph_before(self, pass_name: str) -> str:
        """The step's code as the named pass received it (see pstar_fx.passes for the list)."""
        graphs = self.lowered.graphs_before
        if pass_name not in graphs:
            raise ValueError(f"unknown pass {pass_name!r}; passes: {list(graphs)}")
        return graphs[pass_name]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights under the model's own parameter names (tied weights under each name) and the
        persistent buffers, as the model's own state_dict has them, on the CPU. With chunks partitioned over
        data-parallel ranks it is collective: every rank calls it, and every rank gets the whole model."""
        self.drain()                     # host Adam of the last step may still be running
        out = {}
        params = self.lowered.capture.params
        # chunk-partitioned: collective, every rank gets all
        for ch, master in masters_by_chunk(self.rt.store, self.lowered.layout, self.dp):
            for s in ch.slots:
                # (a frozen chunk holds 16-bit weights in a 16-bit run: widened, as every weight here is fp32)
                w = master[s.offset: s.offset + s.numel].view(s.param.shape).detach().to("cpu", torch.float32,
                                                                                         copy=True)
                for name in params[s.index].aliases:
                    out[name] = w
        out.update({k: b.detach().to("cpu", copy=True) for k, b in self.persistent_buffers().items()})
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Weights and buffers by name into chunk memory (the optimizer state is left as it is). Names or shapes
        that differ are an error listing them, raised before anything changes; `strict=False` allows
        missing and unexpected names, as in torch."""
        checkpoint.load_state_dict(self._checkpoint_parts(), state_dict, strict=strict)

    def export(self, model: nn.Module) -> nn.Module:
        """Write the trained fp32 weights and buffers into `model` (on any device, not meta), for inference or
        other tools. Returns `model`. Streamed chunk by chunk (never a whole fp32 copy of the model on the host:
        at 8B that was 32 GB more at the end of a run); a parameter that already is a view of its master (a model
        built on meta, whose weights were made in chunk memory) is left as it is: it holds the weights."""
        self.drain()                     # host Adam of the last step may still be running
        params = self.lowered.capture.params
        buffers = self.persistent_buffers()
        targets = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
        missing = [k for k in [a for p in params for a in p.aliases] + list(buffers) if k not in targets]
        if missing:
            raise ValueError(f"export: the model has no {missing[:10]}: not the model this engine trains")
        if any(targets[a].is_meta for p in params for a in p.aliases) or any(targets[k].is_meta for k in buffers):
            raise ValueError("export: the model is on the meta device; give it memory first "
                             "(model.to_empty(device=...))")
        with torch.no_grad():
            for ch, master in masters_by_chunk(self.rt.store, self.lowered.layout, self.dp):
                for s in ch.slots:
                    w = master[s.offset: s.offset + s.numel].view(s.param.shape)
                    for name in params[s.index].aliases:
                        t = targets[name]
                        if not _same_memory(t, w):
                            t.copy_(w)
            for k, b in buffers.items():
                if not _same_memory(targets[k], b):
                    targets[k].copy_(b)
        return model

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The model's buffers that its state_dict holds (BatchNorm statistics; not non-persistent ones)."""
        return {name: b for name, b, keep in zip(self.lowered.capture.buffers, self._buffers, self._persistent)
                if keep}

    def save(self, path: str | os.PathLike, *, dtype: str = "fp32", full: bool = False) -> None:
        """Write a checkpoint directory (safetensors weights `transformers` reads, optimizer state, loop state),
        streamed tensor by tensor and renamed into place when whole; see pstar_fx.checkpoint. A `peft` model
        writes its adapter as peft does (what `PeftModel.from_pretrained(base, path)` reads) in place of the
        weights: the frozen base weights only with `full=True`."""
        replicated = self.dp is not None and not self.dp.chunked   # every rank holds the same state
        if not replicated or self.dp.rank == 0:       # partitioned: every rank writes the chunks it owns
            checkpoint.save(self._checkpoint_parts(), path, dtype=dtype, full=full)
        if replicated:
            self.dp.barrier()

    def load(self, path: str | os.PathLike, *, strict: bool = True) -> None:
        """Resume from a checkpoint `save` wrote, at any budget, chunk size or placement; or load a folder of
        safetensors weights (zeroed moments, step 0). Names or shapes that differ are an error listing them,
        raised before anything changes."""
        checkpoint.load(self._checkpoint_parts(), path, strict=strict)

    def _checkpoint_parts(self) -> checkpoint.Parts:
        """What a checkpoint saves and loads, handed over: the checkpoint never reads this engine's attributes."""
        lowered = self.lowered
        return checkpoint.Parts(
            store=self.rt.store, params=tuple(lowered.capture.params),
            param_chunks=tuple(s.chunk for s in lowered.layout.slots), owner=lowered.plan.owner, dp=self.dp,
            buffers=self.persistent_buffers(), optimizer=self.config.optimizer,
            lr_schedule=self.config.lr_schedule, hf_config=getattr(self._skeleton, "config", None),
            loop_state=self.stepper.state_dict, load_loop_state=self.stepper.load_state_dict, drain=self.drain,
            adapter=self._adapter)

    def memory_stats(self) -> dict[str, int]:
        s = self.rt.stats
        peak = s.device_peak_bytes
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        return {
            "device_peak_bytes": peak,
            "host_peak_bytes": s.host_peak_bytes,
            "h2d_bytes": s.h2d_bytes,
            "d2h_bytes": s.d2h_bytes,
            "device_chunk_bytes": s.device_bytes,
            "host_chunk_bytes": s.host_bytes,
            "predicted_device_peak_bytes": self.plan.device_peak_bytes,
            "device_budget_bytes": self.config.device_memory or 0,
            "steps": self.steps,
        }

    def plot_memory(self, path: str | os.PathLike, *, title: str | None = None):
        """Draw the plan along the step to an image (.png/.svg/.pdf): device and host bytes per node against
        the budgets, the measured peaks once a step ran, chunk moves and each chunk's tier (pstar_fx.plot).
        Needs matplotlib: pip install pstar_fx[plot]. Returns the path."""
        from .plot import plot_memory
        return plot_memory(self, path, title=title or type(self._skeleton).__name__)

    def explain(self) -> str:
        lo = self.lowered
        layout, plan = lo.layout, lo.plan
        lines = [f"pstar_fx engine: {sum(s.numel for s in layout.slots):,} parameters in {len(layout.chunks)} "
                 f"chunk(s) of {layout.chunk_size:,} elements ({layout.waste_elems:,} padding"
                 + (f"; trainable chunks' state: {layout.state_elems:,} elements each"
                    if layout.state_elems < layout.chunk_size else "")
                 + f"); compute dtype {lo.config.dtype}; device {self.device}"]
        lines.append("chunks:")
        for c in layout.chunks:
            names = [s.param.name for s in c.slots]
            shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            lines.append(f"  c{c.id}: {plan.placement[c.id]:6s} {c.used_elems:>12,} elems, {len(names)} "
                         + ("frozen " if c.frozen else "") + f"param(s): {shown}")
        lines.append(plan.summary())
        if len(plan.tried) > 1:
            lines.append(f"recompute search, {len(plan.tried)} tries in the order made:")
            lines += [f"  {t}" for t in plan.tried]
        lines.append(f"compile: {self.phases.summary()}")
        builds = getattr(self, "region_build_times", None)
        if builds:                          # a cold cache: where the workers' time went (seconds from their start)
            longest = max(builds, key=lambda t: t["ended"] - t["began"])
            lines.append(f"region builds: {len(builds)} regions on {len({t['worker'] for t in builds})} worker(s), "
                         f"ready at {min(t['ready'] for t in builds):.1f}-{max(t['ready'] for t in builds):.1f} s, "
                         f"done at {max(t['ended'] for t in builds):.1f} s; the longest {longest['ops']} ops, "
                         f"{longest['ended'] - longest['began']:.1f} s")
        if len(self.shapes) > 1:
            lines.append(f"input shapes on this chunk memory: {len(self.shapes)} (micro-batch shapes "
                         + "; ".join(str([s for s, _ in key]) for key in self.shapes.shapes) + ", the compiled first)")
        ops = Counter(n.target for n in self.graph.graph.nodes if n.op == "call_method")
        lines.append("schedule (nodes in engine.graph): "
                     + ", ".join(f"{k} {ops[k]}" for k in ("prefetch", "fetch", "release", "offload", "reduce",
                                                            "all_reduce", "adam", "grad", "grad_mm", "param")
                                 if ops[k]))
        calls = Counter(n.target for n in self.graph.graph.nodes if n.op == "call_function")
        for r in self.graph.meta.get("regions", []):
            if r.eager_because:             # compiled, it would not have fitted (or Dynamo refused it)
                lines.append(f"region {r.__name__} ({calls[r]} call(s)) runs op by op: {r.eager_because}")
        return "\n".join(lines)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` are the same elements of the same memory (a parameter that is a view of its master)."""
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


def compile(model: nn.Module, config: Config | dict | str | os.PathLike | None = None, example_inputs=None,
            resume: str | os.PathLike | None = None) -> Engine:
    """Capture `model`'s training step as one graph, chunk and plan it, and return an Engine that trains it.
    `resume`: a checkpoint directory to load (see Engine.load)."""
    return Engine(model, config, example_inputs, resume=resume)


def plan(model: nn.Module, config: Config | dict | str | None = None, example_inputs=None, *,
         world: int | None = None, rank: int = 0) -> Plan:
    """Everything `compile` does short of allocating: the model may live on the meta device. `world`: plan for
    that many data-parallel ranks (default: as launched), as rank `rank` (rank 0 owns the most chunks);
    `example_inputs` are then one rank's batch."""
    config = Config.coerce(config)
    check_compiled_length(example_inputs, config)
    return Lowered(model, config, example_inputs, world=world, rank=rank).plan
