"""engine: `pstar_fx.compile(model, config, example_inputs) -> Engine`, and `pstar_fx.plan(...)`.

The pipeline, in order: capture -> layout -> passes (seed_random_ops, localize_param_views, lean_cross_entropy,
then recompute + fuse_optimizer + plan: the cheap values first, then the fewest recomputed segments that fit)
-> insert_chunk_ops -> grads_in_place -> compile_regions (Config.compute) -> runtime (regions built before the
chunk memory is allocated). `Engine.graph` is the lowered step; `Engine.explain()` says what the plan decided;
`Engine.memory_stats()` says what the runtime measured.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import warnings
import weakref
from collections import Counter

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from . import checkpoint
from .capture import Capture, capture
from .config import Config, format_bytes
from .fxutil import role_nodes, tag
from .layout import Layout, build_layout
from .phases import Phases
from .passes import (build_regions, compile_regions, find_segments, fuse_optimizer, grads_in_place,
                     insert_chunk_ops, lean_cross_entropy, localize_param_views, recompute, seed_random_ops)
from .passes.recompute import Segment, group_segments
from .passes.recompute_ops import find_cheap_recomputes, op_segments
from .planning import CUDA_BLOCK_BYTES, BudgetError, Plan, PlanDelta, calibrate, fold, make_plan, usable_budget
from .runtime import ChunkRuntime, StepRolledBack, run_graph
from .runtime.dist import DataParallel, init as init_dist, measure_bus_bandwidth, world_from_env
from .runtime.step import StepReport, Stepper


log = logging.getLogger("pstar_fx")


class Lowered:
    """Everything short of memory: the captured step, its chunk layout, the plan and the lowered graph."""

    def __init__(self, model: nn.Module, config: Config, example_inputs, phases: Phases | None = None,
                 world: int | None = None, rank: int = 0):
        """`world`: the data-parallel ranks to plan for (default: as launched); `rank`: whose plan (default: this
        process's). Chunk partitioning applies when world > 1 and `config.data_parallel` is not "replicated"."""
        self.config = config
        launched_rank, launched_world, _ = world_from_env()
        self.world = launched_world if world is None else world
        self.rank = launched_rank if world is None else rank
        self.chunked = self.world > 1 and config.data_parallel != "replicated"
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.phases = phases = phases or Phases()
        with phases("capture", "forward + backward traced with fake tensors"):
            self.capture: Capture = capture(model, example_inputs, self.device, self.dtype)
            self.layout: Layout = build_layout(self.capture, config.chunk_size)
        log.info("%s parameters in %d chunks of %s elements", f"{self.layout.param_elems:,}",
                 len(self.layout.chunks), f"{self.layout.chunk_size:,}")
        gm = self.capture.gm
        _add_rt(gm.graph)
        self.graphs_before: dict[str, str] = {}
        self._buffer_bytes = sum(_buffer_nbytes(model, b) for b in self.capture.buffers)
        with phases("plan", "placement, recompute and schedule against the budgets"):
            self.rates = self._rates()
            self._run_pass("seed_random_ops", seed_random_ops, gm)
            self._run_pass("localize_param_views", localize_param_views, gm)
            self._run_pass("lean_cross_entropy", lean_cross_entropy, gm)
            self.graph, self.plan = self._plan_with_recompute(gm)
        if self.capture.traced_on != self.device:
            self.plan = fold(self.plan, PlanDelta(notes=(f"traced on {self.capture.traced_on} for a {self.device.type} target (this torch "
                                   "has no CUDA): CPU attention kernels and autocast rules, so activation bytes "
                                   "are an estimate",)))
        with phases("lower", "chunk ops into the graph"):
            self._run_pass("insert_chunk_ops", insert_chunk_ops, self.graph, self.layout, self.plan,
                           "chunked" if self.chunked else "replicated" if self.world > 1 else None)
        self._run_pass("grads_in_place", grads_in_place, self.graph, self.layout, self.dtype)
        if config.compiles_compute:
            with phases("regions", "the compute between chunk nodes, for Inductor (compiled at the first step)"):
                self._run_pass("compile_regions", compile_regions, self.graph, self.plan,
                               cuda=self.device.type == "cuda")
                self.plan = fold(self.plan, self.graph.meta.pop("plan_delta"))

    def _plan_with_recompute(self, gm: fx.GraphModule) -> tuple[fx.GraphModule, Plan]:
        """The least recompute that fits: first the values cheap to remake op by op (norms, activations,
        attention's output; `find_cheap_recomputes`), all of them, then on top of those whole forward segments,
        the fewest that fit, earliest first (their activations live longest).

        Segments are tried one at a time first, then joined in runs of 2 and 4 (`group_segments`): a run
        keeps one boundary activation instead of 2 or 4, at no extra compute. A segment recomputed whole
        remakes its cheap values with it. Among plans that fit, more recompute or larger runs win when the
        cost model says the device memory they free (for chunk state and compute slots) saves more time than
        the extra forward work costs.
        """
        segments = find_segments(gm)
        singles = [s for s in segments if s.recomputable]
        runs = {m: group_segments(singles, m) for m in (1, 2, 4)}     # runs of 1: the segments themselves
        runs = {m: r for m, r in runs.items() if m == 1 or len(r) < len(runs[1])}
        cheap = find_cheap_recomputes(gm, self.rates, CUDA_BLOCK_BYTES if self.device.type == "cuda" else 1,
                                      segments)
        every = len(cheap)
        # (cheap values dropped, segments per run, runs recomputed) -> the graph and its plan
        tried: dict[tuple[int, int, int], tuple[fx.GraphModule, Plan]] = {}

        def recomputed(j: int, m: int, k: int) -> fx.GraphModule:
            g_k, nodes = _copy_graph(gm)
            whole = runs[m][:k]        # a segment recomputed whole remakes its cheap values its own way
            ops = op_segments(cheap[:j], {n for s in whole for n in s.nodes})
            if whole or ops:
                recompute(g_k, [Segment(s.start, [nodes[n] for n in s.nodes]) for s in whole + ops])
            return g_k

        def attempt(j: int, m: int, k: int) -> Plan:
            if (j, m, k) not in tried:
                g_k = recomputed(j, m, k)
                fuse_optimizer(g_k, self.layout)
                tried[j, m, k] = (g_k, make_plan(g_k, self.layout, self.config,
                                                 compute_itemsize=self.dtype.itemsize,
                                                 buffer_bytes=self._buffer_bytes, rates=self.rates,
                                                 **self.partition))
                p = tried[j, m, k][1]
                log.info("  tried recomputing %d of %d cheap values and %d of %d %s: device peak %s, %s", j, every,
                         k, len(runs[m]), "segments" if m == 1 else f"runs of {m} segments",
                         format_bytes(p.device_peak_bytes),
                         f"fits, estimated {p.estimated_step_seconds:.2f} s/step" if p.fits else "does not fit")
            return tried[j, m, k][1]

        best = (0, 1, 0)
        if not attempt(*best).fits and (cheap or singles):
            # every cheap value at once: each costs less per byte than whole segments do, the lot a few per cent
            if cheap and attempt(every, 1, 0).fits:
                best = (every, 1, 0)
            elif singles:
                fitting = [m for m in runs if attempt(every, m, len(runs[m])).fits]
                if fitting:
                    m = fitting[0]
                    lo, hi = 1, len(runs[m])       # attempt(every, m, hi) fits, attempt(every, m, lo - 1) does not
                    while lo < hi:
                        mid = (lo + hi) // 2
                        lo, hi = (lo, mid) if attempt(every, m, mid).fits else (mid + 1, hi)
                    best = (every, m, lo)
                else:                               # does not fit even so: report the smallest try
                    best = min(((every, m, len(r)) for m, r in runs.items()),
                               key=lambda jmk: attempt(*jmk).device_peak_bytes)
            else:
                best = (every, 1, 0)
        if attempt(*best).fits and "host" in attempt(*best).placement:
            # Recomputing more frees device memory for chunk state and compute slots, which saves copies
            # and host Adam; the cost model says whether that pays for the extra forward work.
            _, m, k = best
            n = len(runs[m])
            more = [(every, m, k2) for k2 in sorted({k, k + (n - k) // 4, k + (n - k) // 2, n})]
            more += [(every, m2, len(runs[m2])) for m2 in runs if m2 > m]
            for jmk in more:
                if jmk != best and attempt(*jmk).fits and \
                        attempt(*jmk).estimated_step_seconds < attempt(*best).estimated_step_seconds:
                    best = jmk
        j, m, k = best

        def summary() -> str:
            """What the plan recomputes, in the plan summary's words: the cheap values first, then segments."""
            a0 = attempt(0, 1, 0).activation_peak_bytes
            final = attempt(*best).activation_peak_bytes
            n_segments = len(runs[1])
            if not j and not k:
                return (f"none needed ({len(cheap)} cheap values and {n_segments} forward segments could be)"
                        if cheap or n_segments else "")
            parts = []
            if j:
                kinds = Counter(p.kind for p in cheap[:j])
                ms = sum(p.seconds for p in cheap[:j]) * 1e3
                ops_only = attempt(j, 1, 0).activation_peak_bytes
                parts.append(f"{j} cheap values ({', '.join(f'{kind} {c}' for kind, c in kinds.most_common())}), "
                             f"+{ms:.3g} ms: activation peak {format_bytes(a0)} -> {format_bytes(ops_only)}")
                a0 = ops_only
            if k:
                unit = "forward segments" if m == 1 else f"runs of {m} forward segments"
                whole_nodes = {n for s in runs[m][:k] for n in s.nodes}
                inside = sum(1 for p in cheap[:j] if not whole_nodes.isdisjoint(p.nodes))
                parts.append(("then " if j else "") + f"{k} of {len(runs[m])} {unit}, earliest first"
                             + (f" ({inside} of the cheap values recomputed with them)" if inside else "")
                             + f": activation peak {format_bytes(a0)} -> {format_bytes(final)}")
            return "; ".join(parts)

        g_k, plan = tried[best]
        tried_all = ([f"every forward segment ({len(singles)}, also in runs of "
                      f"{', '.join(str(m) for m in runs if m > 1) or '-'})"] if singles else []) \
            + ([f"every cheap value ({every})"] if every else [])
        plan = fold(plan, PlanDelta(recompute=summary(), why=f"recomputing {' and '.join(tried_all)} was already "
                                    "tried" if k or j else ""))
        self.graphs_before["recompute"] = gm.code
        self.graphs_before["fuse_optimizer"] = recomputed(j, m, k).code
        return g_k, plan

    @property
    def partition(self) -> dict:
        """make_plan's data-parallel arguments: chunks partitioned over the ranks, or every rank holding all."""
        return {"world": self.world, "rank": self.rank} if self.chunked else {}

    def _rates(self):
        """The cost model's rates. Partitioned ranks plan one collective schedule, so they plan with one set of
        rates: rank 0's, with the bus bandwidth of a broadcast between them measured now."""
        rates = calibrate(self.device, self.dtype)
        if self.chunked and dist.is_available() and dist.is_initialized():
            box = [rates]
            dist.broadcast_object_list(box, 0)
            rates = dataclasses.replace(box[0], coll_bw=measure_bus_bandwidth(self.device, self.dtype))
        return rates

    def _run_pass(self, name, fn, gm, *args, **kwargs):
        self.graphs_before[name] = gm.code
        fn(gm, *args, **kwargs)


def _add_rt(g: fx.Graph) -> None:
    """The chunk runtime becomes the step's first argument: the chunk ops the passes insert call it."""
    with g.inserting_before(next(iter(g.nodes))):
        tag(g.placeholder("rt"), "rt", 0)


def _skeleton(model: nn.Module) -> nn.Module:
    """The model's structure with meta tensors for its parameters and buffers (ties kept): enough to capture
    another graph of it later, without keeping its weights alive beside the chunks."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return copy.deepcopy(model, memo)


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


def _copy_graph(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A copy to try a plan on. Lazy: its Python code is generated only if this copy is the one kept
    (code generation was two thirds of planning time for an 18B model, over a dozen discarded tries)."""
    g = fx.Graph()
    g._codegen = gm.graph._codegen
    nodes: dict[fx.Node, fx.Node] = {}
    g.output(g.graph_copy(gm.graph, nodes))
    return _LazyGraphModule(gm, g), nodes


def _buffer_nbytes(model: nn.Module, name: str) -> int:
    b = model.get_buffer(name)
    return b.numel() * b.element_size()


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
        _, launched, local_rank = world_from_env()
        if launched > 1:
            if config.device in ("cuda", "auto") and torch.cuda.is_available():
                config = dataclasses.replace(config, device=f"cuda:{local_rank}")   # one GPU per rank
            if config.device.startswith("cuda"):
                torch.cuda.set_device(torch.device(config.device))
        rank, world = init_dist(config.device, config.dist_timeout)
        if config.device.startswith("cuda") and config.device_memory is None:
            free, _ = torch.cuda.mem_get_info(torch.device(config.device))
            config = dataclasses.replace(config, device_memory=free)
        self.config = config
        self.phases = phases = Phases()
        if not model.training:
            warnings.warn(f"{type(model).__name__} is in eval mode: the step is captured in the mode the model is in, "
                          "so it trains with dropout off and BatchNorm on its running statistics; call model.train() "
                          "before compile() for training behaviour (engine.evaluate runs eval mode either way)",
                          UserWarning, stacklevel=3)
        self.lowered = Lowered(model, config, example_inputs, phases)
        if not self.lowered.plan.fits:
            raise BudgetError(self.lowered.plan.why)
        self.device = self.lowered.device
        cap = self.lowered.capture
        plan = self.lowered.plan
        regions = self.lowered.graph.meta.get("regions", [])
        if regions:
            with phases("build regions", f"{len(regions)} compiled functions for the compute (Inductor), before "
                                         "chunk memory is allocated"):
                built = build_regions(self.lowered.graph, self.device)
                if built < len(regions):
                    log.info("%d of %d regions compile at their first call (an input's layout is unknown)",
                             len(regions) - built, len(regions))
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()    # what autotuning allocated goes back before the chunks are
        self.dp = DataParallel(rank, world, chunked=self.lowered.chunked) if world > 1 else None
        with phases("allocate", f"chunk memory: {format_bytes(plan.device_peak_bytes - plan.activation_peak_bytes)} "
                                f"on {self.lowered.device.type}, {format_bytes(plan.host_peak_bytes)} on the host"):
            self.rt = ChunkRuntime(self.lowered.layout, plan, config, self.device, self.lowered.dtype, self.dp)
        with phases("initialize", "weights written into the fp32 masters"):
            meta = any(p.is_meta for p in model.parameters())
            if meta:
                self._materialize(model)
            else:
                named = dict(model.named_parameters(remove_duplicate=False))
                self.rt.store.load_params([named[p.name] for p in cap.params])
        self._buffers = [self.rt.store.adopt(model.get_buffer(b).detach().to(self.device, copy=True))
                         for b in cap.buffers]
        if self.dp is not None:
            with torch.no_grad():                 # every rank starts from rank 0's weights and buffers
                if not self.dp.chunked:
                    for t in self.rt.store.master:
                        self.dp.broadcast_(t)
                elif not meta:
                    self._masters_from_rank0(named)
                for t in self._buffers:
                    self.dp.broadcast_(t)
            self.rt.store.masters_changed()
        persistent = set(model.state_dict(keep_vars=True))
        self._persistent = [b in persistent for b in cap.buffers]
        self._skeleton = _skeleton(model)    # its structure, for capturing evaluation on first use
        self._model = weakref.ref(model)     # only to say so when its mode changes after compile
        self._mode = model.training
        self._evaluator = None
        self._tangent_dtype = role_nodes(cap.gm.graph, "tangent")[0].meta["val"].dtype
        self.stepper = Stepper(self.rt, config, plan.transaction,
                               _runner(self.lowered.graph, self.rt, self._buffers, self.device, self._tangent_dtype),
                               self._buffers)
        self.last_step: StepReport | None = None
        if resume is not None:
            self.load(resume)

    def _masters_from_rank0(self, named: dict) -> None:
        """Chunk-partitioned: each chunk's master gets rank 0's weights of it (packed there from its model)."""
        layout, store = self.lowered.layout, self.rt.store
        cap = self.lowered.capture
        where = self.dp.scratch_device()
        for ch in layout.chunks:
            tmp = torch.zeros(ch.used_elems, dtype=torch.float32, device=where)
            if self.dp.rank == 0:
                for s in ch.slots:
                    tmp[s.offset: s.offset + s.numel].copy_(named[cap.params[s.index].name].detach().reshape(-1))
            self.dp.broadcast_(tmp, 0)
            if store.holds(ch.id):
                store.master[ch.id][: ch.used_elems].copy_(tmp)

    def _masters_by_chunk(self):
        """(chunk, its fp32 master) for every chunk, on every rank: a chunk another rank holds is broadcast from
        there into a temporary (a collective: every rank iterates to the end)."""
        store = self.rt.store
        for ch in self.lowered.layout.chunks:
            if self.dp is None or not self.dp.chunked:
                yield ch, store.master[ch.id][: ch.used_elems]
                continue
            tmp = torch.empty(ch.used_elems, dtype=torch.float32, device=self.dp.scratch_device())
            if store.holds(ch.id):
                tmp.copy_(store.master[ch.id][: ch.used_elems])
            self.dp.broadcast_(tmp, self.dp.owner(ch.id))
            yield ch, tmp

    def _materialize(self, model: nn.Module) -> None:
        """A model built on the meta device gets its weights made directly in chunk memory: its parameters
        become views of the fp32 masters (on their tier), then its own init runs on them. The model is
        never whole in memory anywhere else, which is what lets a model larger than either tier start."""
        cap = self.lowered.capture
        owner = {alias: i for i, p in enumerate(cap.params) for alias in p.aliases}
        # a parameter whose chunk another rank holds (chunk-partitioned) is initialized in a temporary on the
        # host and dropped: every rank runs the model's whole init alike, so the owners' values agree with it
        store = self.rt.store
        shared = [nn.Parameter(store.param_fp32(i) if store.holds(self.lowered.layout.slots[i].chunk)
                               else torch.empty(p.shape), requires_grad=p.requires_grad)
                  for i, p in enumerate(cap.params)]
        for mod_name, mod in model.named_modules(remove_duplicate=False):
            for name, p in list(mod._parameters.items()):
                full = f"{mod_name}.{name}" if mod_name else name
                if p is not None and full in owner:
                    mod._parameters[name] = shared[owner[full]]
            for name, b in list(mod._buffers.items()):
                if b is not None and b.is_meta:
                    mod._buffers[name] = torch.empty_like(b, device=self.device)
        torch.manual_seed(self.config.seed)
        with torch.no_grad():
            if hasattr(model, "init_weights"):
                model.init_weights()
            else:
                for m in model.modules():
                    if hasattr(m, "reset_parameters"):
                        m.reset_parameters()
        self.rt.store.masters_changed()

    # ---- the step ----------------------------------------------------------------------------------
    def step(self, *inputs, **kw_inputs) -> torch.Tensor:
        """One optimizer step on a batch: forward, backward and the update, as one transaction (a step that
        fails or must be skipped changes no weight). The batch is given as the example inputs were: tensors
        positionally, or by keyword (`step(input_ids=x, labels=y)`, or a batch dict `step(batch)`). With
        `grad_accum` k the batch's leading dimension is k times the compiled one: k micro-batches, one update.
        Returns the loss (the micro-batches' mean); `engine.last_step` says what the step did."""
        micro = self._check_inputs(inputs, kw_inputs)
        model = self._model()
        if model is not None and model.training != self._mode:
            self._mode = model.training                          # said once per change
            warnings.warn(f"the model was switched to {'train' if model.training else 'eval'} mode after compile(); "
                          f"that changes nothing: the step runs in the mode it was captured in "
                          f"({'eval' if model.training else 'train'}); engine.evaluate() is the eval-mode loss",
                          UserWarning, stacklevel=2)
        report = self.stepper.step(micro)
        self.last_step = report
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
        shapes = [(tuple(x.shape), x.dtype) for x in inputs]
        if self._evaluator is None or self._evaluator[0] != shapes:
            self._evaluator = (shapes, _runner(self._lower_evaluation(inputs), self.rt, self._buffers, self.device,
                                               self._tangent_dtype))
        self.rt.copies.start_step()
        loss = self._evaluator[1]([x.to(self.device) for x in inputs], torch.ones(()))
        self.rt.mover.check_idle()
        return loss.float().cpu()

    def _lower_evaluation(self, inputs):
        """capture (forward only, eval mode) -> localize views -> the loss's in-place forward -> a schedule on
        the training plan's placement and compute slots -> chunk ops."""
        lo = self.lowered
        with self.phases("evaluation", "forward-only step captured and planned"):
            cap = capture(self._skeleton, inputs, self.device, self.dtype, forward_only=True,
                          signature=lo.capture.signature)
            gm = cap.gm
            g = gm.graph
            _add_rt(g)
            out = g.output_node()
            out.args = ((out.args[0][0],),)          # the loss alone: no gradient leaves the graph
            g.eliminate_dead_code()
            gm.recompile()
            seed_random_ops(gm)
            localize_param_views(gm)
            lean_cross_entropy(gm)
            plan = make_plan(gm, lo.layout, self.config, compute_itemsize=self.dtype.itemsize,
                             buffer_bytes=lo._buffer_bytes, on=lo.plan, rates=lo.rates, **lo.partition)
            # what the runtime already holds (chunk state, pools, kept gradients) plus this graph's values
            need = self.rt.stats.device_bytes + plan.activation_peak_bytes + plan.device_breakdown.get(
                "workspace margin", 0)
            budget = usable_budget(self.config.device_memory, self.device.type == "cuda")
            if budget is not None and need > budget:
                raise BudgetError(f"evaluation at input shapes {[tuple(x.shape) for x in inputs]} needs "
                                  f"{format_bytes(need)} of device memory ({format_bytes(plan.activation_peak_bytes)} "
                                  f"of activations on {format_bytes(self.rt.stats.device_bytes)} the engine holds) "
                                  f"but device_memory is {format_bytes(budget)}; evaluate a smaller batch")
            insert_chunk_ops(gm, lo.layout, plan, "chunked" if lo.chunked else None)
        return gm

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

    def _check_inputs(self, args: tuple, kwargs: dict) -> list[list[torch.Tensor]]:
        """The batch, checked against the compiled shapes, split into `grad_accum` micro-batches."""
        specs = self.lowered.capture.inputs
        k = self.config.grad_accum
        inputs = self.lowered.capture.signature.bind(args, kwargs)
        out = []
        for x, spec in zip(inputs, specs):
            i = spec.name
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
            x = x.to(self.device, non_blocking=True)
            if any(x is y for y in out):   # one tensor passed twice (labels=input_ids): the compiled regions were
                x = x.view(x.shape)        # built for distinct inputs, and a repeated one would recompile them
            out.append(x)
        if k == 1:
            return [out]
        return [[x.chunk(k)[j] for x in out] for j in range(k)]

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
        for ch, master in self._masters_by_chunk():   # chunk-partitioned: collective, every rank gets all
            for s in ch.slots:
                w = master[s.offset: s.offset + s.numel].view(s.param.shape).detach().to("cpu", copy=True)
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
        other tools. Returns `model`."""
        sd = self.state_dict()
        targets = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
        missing = [k for k in sd if k not in targets]
        if missing:
            raise ValueError(f"export: the model has no {missing[:10]}: not the model this engine trains")
        if any(targets[k].is_meta for k in sd):
            raise ValueError("export: the model is on the meta device; give it memory first "
                             "(model.to_empty(device=...))")
        with torch.no_grad():
            for k, t in sd.items():
                targets[k].copy_(t)
        return model

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The model's buffers that its state_dict holds (BatchNorm statistics; not non-persistent ones)."""
        return {name: b for name, b, keep in zip(self.lowered.capture.buffers, self._buffers, self._persistent)
                if keep}

    def save(self, path: str | os.PathLike, *, dtype: str = "fp32") -> None:
        """Write a checkpoint directory (safetensors weights `transformers` reads, optimizer state, loop state),
        streamed tensor by tensor and renamed into place when whole; see pstar_fx.checkpoint."""
        replicated = self.dp is not None and not self.dp.chunked   # every rank holds the same state
        if not replicated or self.dp.rank == 0:       # partitioned: every rank writes the chunks it owns
            checkpoint.save(self._checkpoint_parts(), path, dtype=dtype)
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
            loop_state=self.stepper.state_dict, load_loop_state=self.stepper.load_state_dict, drain=self.drain)

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
                 f"chunk(s) of {layout.chunk_size:,} elements ({layout.waste_elems:,} padding); "
                 f"compute dtype {lo.config.dtype}; device {self.device}"]
        lines.append("chunks:")
        for c in layout.chunks:
            names = [s.param.name for s in c.slots]
            shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            lines.append(f"  c{c.id}: {plan.placement[c.id]:6s} {c.used_elems:>12,} elems, {len(names)} param(s): {shown}")
        lines.append(plan.summary())
        lines.append(f"compile: {self.phases.summary()}")
        ops = Counter(n.target for n in self.graph.graph.nodes if n.op == "call_method")
        lines.append("schedule (nodes in engine.graph): "
                     + ", ".join(f"{k} {ops[k]}" for k in ("prefetch", "fetch", "release", "offload", "reduce",
                                                            "all_reduce", "adam", "grad", "grad_mm", "param")
                                 if ops[k]))
        return "\n".join(lines)


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
    return Lowered(model, Config.coerce(config), example_inputs, world=world, rank=rank).plan
