"""lower: the one runner of the pass list, and `Lowered` — capture -> layout -> `passes.PIPELINE` -> the lowered
step and its plan. Evaluation is lowered by the same list, up to insert_chunk_ops, on a forward-only capture.

The runner checks the pipeline's contracts before any pass runs, drops the optional passes named in
`Config.disable_passes` (and those whose `only_if` is false), records the code each pass receives
(`engine.graph_before`), logs each pass and its seconds, and folds what a pass hands back for the plan: the
plan step's Plan (`gm.meta["plan"]`) and compile_regions' PlanDelta (`gm.meta["plan_delta"]`, `planning.fold`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Mapping
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from .. import passes
from ..capture import Capture, capture
from ..config import Config, format_bytes
from ..fxutil import code_later, tag
from ..layout import Layout, build_layout
from ..passes.contract import PLANNED, Pass, PassContext, check_pipeline
from ..phases import Phases
from ..planning import BudgetError, Plan, PlanDelta, calibrate, fold, make_plan, usable_budget
from ..planning.costs import start_calibration
from ..runtime.dist import measure_bus_bandwidth, world_from_env
from .recompute_search import plan_with_recompute

log = logging.getLogger("pstar_fx")

# the compile phase each pass runs in (pstar_fx.phases: what a progress display shows); the others run in none
PHASE_OF = {"seed_random_ops": "plan", "localize_param_views": "plan", "lean_cross_entropy": "plan",
            "plan": "plan", "insert_chunk_ops": "lower", "compile_regions": "regions"}
PHASE_WHAT = {"plan": "placement, recompute and schedule against the budgets", "lower": "chunk ops into the graph",
              "regions": "the compute between chunk nodes, for Inductor (compiled at the first step)"}


class GraphRecords(Mapping):
    """Pass name -> the step's code as that pass received it. Each record is a function making the code, called
    once, when first read: at 18B the code of one graph takes ~0.4 s to generate, and most records are never read."""

    def __init__(self):
        self._code: dict[str, str | Callable[[], str]] = {}

    def put(self, name: str, graph: fx.GraphModule | Callable[[], str]) -> None:
        self._code[name] = code_later(graph.graph) if isinstance(graph, fx.GraphModule) else graph

    def __getitem__(self, name: str) -> str:
        code = self._code[name]
        if callable(code):
            code = self._code[name] = code()
        return code

    def __iter__(self):
        return iter(self._code)

    def __len__(self) -> int:
        return len(self._code)


def run_pipeline(pipeline: list[Pass], gm: fx.GraphModule, ctx: PassContext,
                 phases: Phases | None = None) -> tuple[fx.GraphModule, PassContext]:
    """Apply `pipeline` to `gm`; returns the last pass's graph and the context holding the plan."""
    todo = enabled(pipeline, ctx.config)
    check_pipeline(todo)
    log.debug("applying %d graph passes: %s", len(todo), ", ".join(f"{i}. {p.name}" for i, p in enumerate(todo, 1)))
    with contextlib.ExitStack() as in_phase, _collector_skips_what_exists():
        current = None
        for p in todo:
            phase = PHASE_OF.get(p.name) if phases is not None else None
            if phase != current:
                in_phase.close()
                if phase is not None:
                    in_phase.enter_context(phases(phase, PHASE_WHAT[phase]))
                current = phase
            if not p.runs:                      # a step running passes inside records each of them itself
                ctx.record(p.name, gm)
            t0 = time.perf_counter()
            gm = p.run(gm, ctx)
            assert isinstance(gm, fx.GraphModule), f"pass {p.name} returned {type(gm).__name__}, not a GraphModule"
            if "plan" in gm.meta:
                ctx = dataclasses.replace(ctx, plan=gm.meta.pop("plan"))
            if "plan_delta" in gm.meta:
                ctx = dataclasses.replace(ctx, plan=fold(ctx.plan, gm.meta.pop("plan_delta")))
            log.debug("pass %s: %.3f s", p.name, time.perf_counter() - t0)
            if PLANNED in p.provides and ctx.on_planned is not None and ctx.plan.fits:
                in_phase.close()                # (the plan phase ends here, not after what the hook does)
                current = None
                ctx.on_planned(ctx.plan)
    return gm, ctx


def enabled(pipeline: list[Pass], config: Config) -> list[Pass]:
    """The passes of `pipeline` that run under `config`: not switched off, and asked for."""
    return [p for p in pipeline if not (p.optional and p.name in config.disable_passes)
            and (p.only_if is None or getattr(config, p.only_if))]


def evaluation_passes(pipeline: list[Pass]) -> list[Pass]:
    """The passes a forward-only step runs: the training list up to insert_chunk_ops."""
    return pipeline[: [p.name for p in pipeline].index("insert_chunk_ops") + 1]


class Lowered:
    """Everything short of memory: the captured step, its chunk layout, the plan and the lowered graph."""

    def __init__(self, model: nn.Module, config: Config, example_inputs, phases: Phases | None = None,
                 world: int | None = None, rank: int = 0, on: Lowered | None = None,
                 host_hint: Callable[[Plan, Layout], None] | None = None,
                 on_planned: Callable[[Plan, Lowered], None] | None = None):
        """`world`: the data-parallel ranks to plan for (default: as launched); `rank`: whose plan (default: this
        process's). Chunk partitioning applies when world > 1 and `config.data_parallel` is not "replicated".
        `on`: the same model's step lowered for other input shapes (`example_inputs` in `on`'s placeholder order),
        on `on`'s layout and planned on its chunk memory (`make_plan(on=...)`): its runtime runs this graph too.
        `host_hint(plan, layout)`: told, while the plan is searched, a plan with no more host chunks than the final
        one (`PassContext.host_hint`). `on_planned(plan, self)`: told the plan once it is made and fits, before
        lowering and regions (`PassContext.on_planned`; `self.layout`, `.capture`, `.device`, `.dtype` are set)."""
        self.config = config
        self.on = on
        if on is not None:
            self.world, self.rank, self.chunked = on.world, on.rank, on.chunked
        else:
            launched_rank, launched_world, _ = world_from_env()
            self.world = launched_world if world is None else world
            self.rank = launched_rank if world is None else rank
            self.chunked = self.world > 1 and config.data_parallel != "replicated"
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.phases = phases = phases or Phases()
        check_pipeline(enabled(passes.PIPELINE, config))     # a broken list fails before minutes of capture
        if on is None:
            start_calibration(self.device, self.dtype)          # a GPU not measured yet: measured beside the capture
        with phases("capture", "forward + backward traced with fake tensors"):
            if on is None:
                self.capture: Capture = capture(model, example_inputs, self.device, self.dtype)
                self.layout: Layout = build_layout(self.capture, config.chunk_size)
            else:
                self.capture = capture(model, example_inputs, self.device, self.dtype,
                                       signature=on.capture.signature)
                self.layout = on.layout
                names = lambda cap: [p.name for p in cap.params]  # noqa: E731
                if names(self.capture) != names(on.capture) or self.capture.buffers != on.capture.buffers:
                    raise RuntimeError("the step captured at new input shapes has other parameters or buffers (or "
                                       "another order) than the compiled one: it cannot run on its chunk memory")
        if on is None:
            log.info("%s parameters in %d chunks of %s elements", f"{self.layout.param_elems:,}",
                     len(self.layout.chunks), f"{self.layout.chunk_size:,}")
        add_rt(self.capture.gm.graph)
        self.graphs_before = GraphRecords()
        self._buffer_bytes = (on._buffer_bytes if on is not None
                              else sum(_buffer_nbytes(model, b) for b in self.capture.buffers))
        hint = None if host_hint is None or on is not None else (lambda plan: host_hint(plan, self.layout))
        # (held here only while the pipeline runs: the search's records keep its context, and the engine's hook
        # kept there would hold the engine in a reference cycle, its chunk memory freed only by the collector)
        hook = [on_planned] if on_planned is not None and on is None else []
        planned = (lambda plan: hook[0](plan, self)) if hook else None
        try:
            self.graph, ctx = run_pipeline(passes.PIPELINE, self.capture.gm,
                                           self.context(plan_step=self._plan, record=self.graphs_before.put,
                                                        host_hint=hint, on_planned=planned), phases)
        finally:
            hook.clear()
        self.plan: Plan = ctx.plan

    def context(self, **kw) -> PassContext:
        return PassContext(self.layout, self.config, self.device, self.dtype,
                           dp="chunked" if self.chunked else "replicated" if self.world > 1 else None, **kw)

    def _plan(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        """The training plan step: the cost model's rates, then the least recompute that fits."""
        self.rates = self._rates() if self.on is None else self.on.rates   # (ranks agreed on them once)
        graph, plan = plan_with_recompute(gm, ctx, self.rates, self._buffer_bytes, self.partition,
                                          on=None if self.on is None else self.on.plan)
        if self.capture.traced_on != self.device:
            plan = fold(plan, PlanDelta(notes=(f"traced on {self.capture.traced_on} for a {self.device.type} target "
                                               "(this torch has no CUDA): CPU attention kernels and autocast rules, "
                                               "so activation bytes are an estimate",)))
        graph.meta["plan"] = plan
        return graph

    def lower_evaluation(self, skeleton: nn.Module, inputs, held_bytes: int) -> fx.GraphModule:
        """capture (forward only, eval mode) -> the pipeline up to insert_chunk_ops, its plan step a schedule on
        the training plan's placement and compute slots that must fit beside the `held_bytes` the runtime holds."""
        with self.phases("evaluation", "forward-only step captured and planned"):
            gm = capture(skeleton, inputs, self.device, self.dtype, forward_only=True,
                         signature=self.capture.signature).gm
            g = gm.graph
            add_rt(g)
            out = g.output_node()
            out.args = ((out.args[0][0],),)          # the loss alone: no gradient leaves the graph
            g.eliminate_dead_code()
            gm.recompile()

            def plan_on_training(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
                plan = make_plan(gm, self.layout, self.config, compute_itemsize=self.dtype.itemsize,
                                 buffer_bytes=self._buffer_bytes, on=self.plan, rates=self.rates, **self.partition)
                # what the runtime already holds (chunk state, pools, kept gradients) plus this graph's values
                need = held_bytes + plan.activation_peak_bytes + plan.device_breakdown.get("workspace margin", 0)
                budget = usable_budget(self.config.device_memory, self.device.type == "cuda")
                if budget is not None and need > budget:
                    raise BudgetError(f"evaluation at input shapes {[tuple(x.shape) for x in inputs]} needs "
                                      f"{format_bytes(need)} of device memory "
                                      f"({format_bytes(plan.activation_peak_bytes)} of activations on "
                                      f"{format_bytes(held_bytes)} the engine holds) but device_memory is "
                                      f"{format_bytes(budget)}; evaluate a smaller batch")
                gm.meta["plan"] = plan
                return gm

            gm, _ = run_pipeline(evaluation_passes(passes.PIPELINE), gm, self.context(plan_step=plan_on_training))
        return gm

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


@contextlib.contextmanager
def _collector_skips_what_exists():
    """Python's cyclic garbage collector leaves the objects alive now (the captured graph and all it holds: nodes,
    their metadata, fake tensors) out of its collections until the block ends: each full collection walked all of
    them, ~1 s of the passes' time at 18B on the development VM. What the passes drop meanwhile is collected as
    usual. (Where something else has frozen objects already, nothing changes: unfreezing would undo its freeze.)"""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def add_rt(g: fx.Graph) -> None:
    """The chunk runtime becomes the step's first argument: the chunk ops the passes insert call it."""
    with g.inserting_before(next(iter(g.nodes))):
        tag(g.placeholder("rt"), "rt", 0)


def _buffer_nbytes(model: nn.Module, name: str) -> int:
    b = model.get_buffer(name)
    return b.numel() * b.element_size()
