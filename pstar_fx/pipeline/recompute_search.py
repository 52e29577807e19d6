"""recompute_search: the least recompute that fits — the plan step of the training pipeline.

Each try copies the graph, runs the `recompute` pass on it with the values it tries, then `fuse_optimizer`, then
the planner (`make_plan`); the search keeps the try whose plan fits with the least recompute, or the cheapest
estimated step among those that fit when recomputing more frees device memory worth more than its compute.
It lives above `passes/` and `planning/` because it runs both.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter
from typing import TYPE_CHECKING, NamedTuple

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from ..config import format_bytes
from ..fxutil import copy_graph
from ..passes import fuse_optimizer, recompute
from ..passes.contract import PassContext
from ..passes.recompute import Segment, _unsafe, find_segments, group_segments
from ..passes.recompute_ops import find_cheap_recomputes, op_segments
from ..planning import CUDA_BLOCK_BYTES, Plan, PlanDelta, fold, make_plan, usable_budget
from ..planning import placement
from . import plan_cache
from .plan_ahead import PlanAhead, workers_for

if TYPE_CHECKING:
    from ..planning import Rates

log = logging.getLogger("pstar_fx")

# what recomputing more must save to be chosen, of the step the cost model estimates: the model is not that exact
# (bench/RESULTS.md: within 2-17% of the H200's steps), and a choice made on a smaller difference flips with the
# rates a machine measures (a tiny GPT's plan placed 1 chunk on the device or 9 by 113.06 against 113.18 us)
MORE_GAIN = 0.01


class Try(NamedTuple):
    """One try of the search: the first `cheap` cheap values, then the first `runs` runs of `run_len` forward
    segments, recomputed; and of those runs, in the first `nested` pairs (runs 0 and 1, 2 and 3, ...) the boundary
    between the two too (`_Search.pairs`)."""
    cheap: int
    run_len: int
    runs: int
    nested: int = 0


def plan_with_recompute(gm: fx.GraphModule, ctx: PassContext, rates: Rates, buffer_bytes: int,
                        partition: dict, on: Plan | None = None) -> tuple[fx.GraphModule, Plan]:
    """The least recompute that fits: first the values cheap to remake op by op (norms, activations,
    attention's output; `find_cheap_recomputes`), all of them, then on top of those whole forward segments,
    the fewest that fit, earliest first (their activations live longest).

    Segments are tried one at a time first, then joined in runs of 2 and 4 (`group_segments`): a run
    keeps one boundary activation instead of 2 or 4, at no extra compute. A segment recomputed whole
    remakes its cheap values with it. Among plans that fit, more recompute or larger runs win when the
    cost model says the device memory they free (for chunk state and compute slots) saves more time than
    the extra forward work costs.

    Past every run, pairs of them (`Try.nested`), of the run length whose runs alone keep the least activation
    memory: the boundary between a pair's two runs is not kept either, but remade from the pair's first boundary
    right before backward remakes the second run (a second `recompute` pass over the rewritten graph), so the
    pair's first run's forward runs twice in backward and the burst stays one run long — two-level checkpointing.
    Half the boundaries kept, for one more forward of half the recomputed runs: the fewest pairs that fit when
    nothing else does, or some when the memory they free pays (30.0B with int8 moments on one H200's budgets: the
    device room for one more chunk, which leaves the host room to keep the gradients, so the step is `deferred` at
    1x compute instead of `two_pass`).

    `on`: every try is planned on that plan's chunk memory (`make_plan(on=...)`: a step of another input shape).

    The decision is cached on disk (pipeline/plan_cache.py): a second compile of the same step, shapes, config,
    rates and world applies the winning try and plans it once, instead of searching.

    `gm` is left as it was (each try is a copy). Records the graphs `recompute` and `fuse_optimizer` received
    (`ctx.record`); the latter as a function that remakes the chosen try's copy only if it is read.
    """
    search = _Search(gm, ctx, rates, buffer_bytes, partition, on)
    # tries the search will likely ask for, planned meanwhile in forked children (plan_ahead.py); a try's graph
    # is made again here only if the search keeps it (not for a plan on an engine's chunk memory, `on`: a fork of
    # a process holding page-locked memory is avoided)
    workers = workers_for(len(gm.graph.nodes)) if on is None else 0
    with PlanAhead(lambda t: search.planned(t)[1], workers) as search.ahead:
        key = plan_cache.fingerprint(gm, ctx, rates, buffer_bytes, partition) \
            if on is None and plan_cache.enabled() else None
        cached = plan_cache.load(key) if key is not None else None
        if cached is not None:
            decision, file = cached
            t = Try(decision.cheap, decision.run_len, decision.runs, decision.nested)
            search.host_order = decision.host_order if decision.host_order in placement.HOST_ORDERS else None
            if search.holds(t) and plan_cache.matches(decision, search.attempt(t)):
                log.info("plan: from cache (%s)", file)
                if ctx.host_hint is not None:
                    ctx.host_hint(search.attempt(t))
                return search.chosen(t, decision.recompute, decision.why, decision.tried)
            log.debug("plan cache: %s does not reproduce its plan on this graph; searching", file)
            search.host_order, search.tried = None, {}
        best = search.least_that_fits()
        best = search.more_if_it_pays(best)
        said, why, tried = search.summary(best), search.why(best), tuple(search.said(t) for t in search.tried)
        if key is not None:
            p = search.attempt(best)
            plan_cache.store(key, plan_cache.Decision(*best[:3], nested=best.nested, recompute=said, why=why,
                                                      device_peak_bytes=p.device_peak_bytes, fits=p.fits,
                                                      estimated_step_seconds=p.estimated_step_seconds,
                                                      host_order=p.chunks.host_order, tried=tried))
        return search.chosen(best, said, why, tried)


class _Search:
    """One search's tries (`Try`), each planned once: here (`attempt`), or ahead in a child (`ahead`)."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext, rates: Rates, buffer_bytes: int, partition: dict,
                 on: Plan | None):
        self.gm, self.ctx, self.rates, self.buffer_bytes, self.partition, self.on = \
            gm, ctx, rates, buffer_bytes, partition, on
        segments = find_segments(gm)
        self.singles = [s for s in segments if s.recomputable]
        runs = {m: group_segments(self.singles, m) for m in (1, 2, 4)}     # runs of 1: the segments themselves
        self.runs = {m: r for m, r in runs.items() if m == 1 or len(r) < len(runs[1])}
        self.cheap = find_cheap_recomputes(gm, rates, CUDA_BLOCK_BYTES if ctx.device.type == "cuda" else 1,
                                           segments)
        self.every = len(self.cheap)
        self.tried: dict[Try, tuple[fx.GraphModule | None, Plan]] = {}
        # what the tries' passes read; without the driver's hooks, which the record made on demand would keep alive
        self.bare = dataclasses.replace(ctx, plan_step=None, record=lambda name, graph: None, lint=False)
        self.ahead: PlanAhead | None = None
        # the host chunks' order to plan with (a cached decision's); None: the planner compares them (make_plan)
        self.host_order: str | None = None

    def holds(self, t: Try) -> bool:
        """Whether `t` names values and runs this graph has (a cached decision may be another graph's)."""
        return (t.cheap <= self.every and t.run_len in self.runs and t.runs <= len(self.runs[t.run_len])
                and t.nested <= len(self.pairs(t.run_len, t.runs)))

    def pairs(self, run_len: int, runs: int) -> list[tuple[Segment, Segment]]:
        """Of the first `runs` runs of `run_len` segments, the pairs (runs 0 and 1, 2 and 3, ...) whose boundary
        between them can be remade from the first's: adjacent, and the boundary's op safe to run again."""
        whole = self.runs[run_len][:runs]
        return [(a, b) for a, b in zip(whole[0::2], whole[1::2])
                if a.end == b.start and b.boundary is not None and not _unsafe(b.boundary, {*a.nodes, b.boundary})]

    def recomputed(self, t: Try) -> fx.GraphModule:
        g_k, nodes = _copy_graph(self.gm)
        whole = self.runs[t.run_len][:t.runs]  # a segment recomputed whole remakes its cheap values its own way
        ops = op_segments(self.cheap[:t.cheap], {n for s in whole for n in s.nodes})
        chosen = tuple(Segment(s.start, [nodes[n] for n in s.nodes]) for s in whole + ops)
        g_k = recompute.run(g_k, dataclasses.replace(self.bare, segments=chosen))
        if not t.nested:
            return g_k
        # the second level: each nested pair's first run and the boundary after it, copied again right before
        # backward's first read of that boundary (the second run's copy): backward's other reads of the first
        # run's values already read its own copy, made where its backward begins
        outer = tuple(Segment(a.start, [nodes[n] for n in a.nodes] + [nodes[b.boundary]])
                      for a, b in self.pairs(t.run_len, t.runs)[:t.nested])
        return recompute.run(g_k, dataclasses.replace(self.bare, segments=outer))

    def planned(self, t: Try) -> tuple[fx.GraphModule, Plan]:
        g_k = fuse_optimizer.run(self.recomputed(t), self.bare)
        return g_k, make_plan(g_k, self.ctx.layout, self.ctx.config, compute_itemsize=self.ctx.dtype.itemsize,
                              buffer_bytes=self.buffer_bytes, rates=self.rates, on=self.on,
                              host_order=self.host_order, **self.partition)

    def attempt(self, t: Try) -> Plan:
        if t not in self.tried:
            p = self.ahead.take(t) if self.ahead is not None and t in self.ahead else None
            if p is None:
                t0 = time.perf_counter()
                self.tried[t] = self.planned(t)
                if self.ahead is not None:
                    self.ahead.planned_here(time.perf_counter() - t0)
            else:
                self.tried[t] = (None, p)
            log.info("  tried %s", self.said(t))
        return self.tried[t][1]

    def said(self, t: Try) -> str:
        """Try `t` and its plan in a line (the log's and the plan's `tried`)."""
        p = self.tried[t][1]
        unit = "segments" if t.run_len == 1 else f"runs of {t.run_len} segments"
        nested = (f" (the boundary inside {t.nested} of {len(self.pairs(t.run_len, t.runs))} pairs of them too)"
                  if t.nested else "")
        return (f"recomputing {t.cheap} of {self.every} cheap values and {t.runs} of {len(self.runs[t.run_len])} "
                f"{unit}{nested}: device peak {format_bytes(p.device_peak_bytes)}, "
                + (f"fits, estimated {p.estimated_step_seconds:.2f} s/step ({p.placement.count('device')} of "
                   f"{len(p.placement)} chunks on the device, {p.transaction})" if p.fits
                   else f"does not fit ({p.why.split(':')[0]})" if p.why else "does not fit"))

    def _plan_ahead(self, tries: list[Try]) -> None:
        if self.ahead is not None:
            self.ahead.start(tries, skip=self.tried)

    def least_that_fits(self) -> Try:
        """Nothing recomputed if that fits; else every cheap value; else on top of them the fewest runs that fit,
        of the shortest run length where all of them do; else (nothing fits) the try with the smallest peak."""
        every, runs, cheap, singles = self.every, self.runs, self.cheap, self.singles
        most = [Try(every, m, len(r)) for m, r in runs.items()] if singles else [Try(every, 1, 0)] if cheap else []
        self._plan_ahead([Try(every, 1, 0)] + most if most else [])   # needed whether or not nothing-recomputed fits
        best = Try(0, 1, 0)
        self.attempt(best)
        if self.ctx.host_hint is not None:
            # the tries that recompute the most hold the most chunk state on the device, so the fewest chunks on the
            # host: no plan the search can pick has fewer (only those already planned ahead are asked: a hint
            # never costs the search a try)
            bounds = [p for p in (self.attempt(t) for t in most if t in self.ahead or t in self.tried) if p.fits]
            if bounds:
                self.ctx.host_hint(min(bounds, key=lambda p: p.placement.count("host")))
        if self.attempt(best).fits or not (cheap or singles):
            return best
        # every cheap value at once: each costs less per byte than whole segments do, the lot a few per cent
        if cheap and self.attempt(Try(every, 1, 0)).fits or not singles:
            return Try(every, 1, 0)
        m = next((m for m in runs if self.attempt(Try(every, m, len(runs[m]))).fits), None)
        if m is None:
            # the leanest runs, their pairs' inner boundaries remade too: the fewest pairs that fit
            nest = self.nestable()
            if nest is not None and self.attempt(nest).fits:
                at = lambda q: nest._replace(nested=q)          # noqa: E731
                return at(_fewest_runs_that_fit(lambda q: self.attempt(at(q)), nest.nested,
                                                self.ctx.device.type == "cuda",
                                                ahead=lambda qs: self._plan_ahead([at(q) for q in qs])))
            # does not fit even so: report the smallest try
            tries = [Try(every, m, len(r)) for m, r in runs.items()] + ([nest] if nest is not None else [])
            return min(tries, key=lambda t: self.attempt(t).device_peak_bytes)
        at = lambda k: Try(every, m if k else 1, k)     # noqa: E731  (no run recomputed: every cheap value alone)
        return Try(every, m, _fewest_runs_that_fit(lambda k: self.attempt(at(k)), len(runs[m]),
                                                   self.ctx.device.type == "cuda",
                                                   ahead=lambda ks: self._plan_ahead([at(k) for k in ks])))

    def cost(self, t: Try) -> float:
        """What the search minimizes: the step estimated for try `t`, at `Config.expected_trigger_rate` where that
        is set with clipping (`Estimate.expected_step_seconds`: a run that clips on most steps is planned for its
        triggered or deferred step, which fewer host chunks make cheaper), else the untriggered step."""
        return self.attempt(t).estimate.expected_step_seconds(self.ctx.config.expected_trigger_rate)

    def more_if_it_pays(self, best: Try) -> Try:
        """Recomputing more frees device memory for chunk state and compute slots, which saves copies and host
        Adam (and, when clipping is expected to trigger, host corrections); the cost model says whether that pays
        for the extra forward work (`cost`). (On another plan's chunk memory, `on`, the placement is fixed:
        never.)"""
        p = self.attempt(best)
        if self.on is not None or not p.fits or "host" not in p.placement:
            return best
        every, runs = self.every, self.runs
        n = len(runs[best.run_len])
        k = best.runs                   # every cheap value, with as many or more runs as the best so far
        more = [] if best.nested else [Try(every, best.run_len, k2)
                                       for k2 in sorted({k, k + (n - k) // 4, k + (n - k) // 2, n})]
        more += [Try(every, m2, len(runs[m2])) for m2 in runs if m2 > best.run_len]
        self._plan_ahead(more)
        for t in more:
            if t != best and self.attempt(t).fits and self.cost(t) < (1 - MORE_GAIN) * self.cost(best):
                best = t
        # then the leanest runs with some of their pairs' inner boundaries remade too (more forward work for the
        # device room of half their boundaries)
        nest = self.nestable()
        if nest is not None:
            q = best.nested if best[:3] == nest[:3] else 0
            pairs = nest.nested
            more = [nest._replace(nested=q2) for q2 in sorted({q + (pairs - q) // 4, q + (pairs - q) // 2, pairs})
                    if q2 > q]
            self._plan_ahead(more)
            # every pair nested first: where that neither costs less nor changes the transaction (measuring first
            # or replaying -> keeping: 30.0B int8), fewer pairs only trade its room back for its compute
            full, now = self.attempt(nest), self.attempt(best)
            if not full.fits or (self.cost(nest) >= self.cost(best) and full.transaction == now.transaction):
                more = [nest] if nest in more else []
            for t in more:
                if self.attempt(t).fits and self.cost(t) < (1 - MORE_GAIN) * self.cost(best):
                    best = t
        return best

    def nestable(self) -> Try | None:
        """Every cheap value and every run of the length whose runs alone keep the least activation memory, with
        all their pairs nested (`Try.nested`); None when no run length has a pair."""
        every, runs = self.every, self.runs
        lengths = [m for m in runs if self.pairs(m, len(runs[m]))] if self.singles else []
        if not lengths:
            return None
        m = min(lengths, key=lambda m: (self.attempt(Try(every, m, len(runs[m]))).activation_peak_bytes, m))
        return Try(every, m, len(runs[m]), len(self.pairs(m, len(runs[m]))))

    def summary(self, best: Try) -> str:
        """What the plan recomputes, in the plan summary's words: the cheap values first, then segments."""
        cheap, runs = self.cheap, self.runs
        a0 = self.attempt(Try(0, 1, 0)).activation_peak_bytes
        final = self.attempt(best).activation_peak_bytes
        j, m, k, q = best
        n_segments = len(runs[1])
        if not j and not k:
            return (f"none needed ({len(cheap)} cheap values and {n_segments} forward segments could be)"
                    if cheap or n_segments else "")
        parts = []
        if j:
            kinds = Counter(p.kind for p in cheap[:j])
            ms = sum(p.seconds for p in cheap[:j]) * 1e3
            ops_only = self.attempt(Try(j, 1, 0)).activation_peak_bytes
            parts.append(f"{j} cheap values ({', '.join(f'{kind} {c}' for kind, c in kinds.most_common())}), "
                         f"+{ms:.3g} ms: activation peak {format_bytes(a0)} -> {format_bytes(ops_only)}")
            a0 = ops_only
        if k:
            unit = "forward segments" if m == 1 else f"runs of {m} forward segments"
            whole_nodes = {n for s in runs[m][:k] for n in s.nodes}
            inside = sum(1 for p in cheap[:j] if not whole_nodes.isdisjoint(p.nodes))
            nested = (f", the boundary inside each of the first {q} of their {len(self.pairs(m, k))} pairs too "
                      "(remade from the pair's first boundary: its first run's forward runs twice)" if q else "")
            parts.append(("then " if j else "") + f"{k} of {len(runs[m])} {unit}, earliest first"
                         + (f" ({inside} of the cheap values recomputed with them)" if inside else "") + nested
                         + f": activation peak {format_bytes(a0)} -> {format_bytes(final)}")
        rate, estimate = self.ctx.config.expected_trigger_rate, self.attempt(best).estimate
        if rate is not None and estimate.clips:
            parts.append(f"chosen for the step expected with clipping triggering on {rate:.0%} of the steps "
                         f"({estimate.expected_step_seconds(rate):.3g} s)")
        return "; ".join(parts)

    def why(self, best: Try) -> str:
        """What was tried, for a plan that does not fit."""
        tried_all = ([f"every forward segment ({len(self.singles)}, also in runs of "
                      f"{', '.join(str(m) for m in self.runs if m > 1) or '-'}, and in pairs)"]
                     if self.singles else []) \
            + ([f"every cheap value ({self.every})"] if self.every else [])
        return f"recomputing {' and '.join(tried_all)} was already tried" if best.runs or best.cheap else ""

    def chosen(self, best: Try, summary: str, why: str, tried: tuple[str, ...]) -> tuple[fx.GraphModule, Plan]:
        """The search's result: the chosen try's graph and plan, with what it recomputes, why, and the search's
        tries (`tried`: a cached decision's are the search's that made it) said in the plan."""
        g_k, plan = self.tried[best]
        if g_k is None:         # planned ahead in a child: its graph made here (the same, name for name)
            g_k = fuse_optimizer.run(self.recomputed(best), self.bare)
            if plan.profile is not None and plan.profile.node_names != [n.name for n in g_k.graph.nodes]:
                raise AssertionError("a try planned ahead was planned on another graph than the one remade here")
        plan = fold(plan, PlanDelta(recompute=summary, why=why, tried=tried))
        self.ctx.record(recompute.NAME, self.gm)
        self.ctx.record(fuse_optimizer.NAME, lambda: self.recomputed(best).code)
        return g_k, plan


def _fewest_runs_that_fit(attempt, n: int, cuda: bool, ahead=None) -> int:
    """The least k in 1..n whose plan fits (`attempt(k)`: the plan recomputing k runs; k = n fits, k = 0 does not),
    as bisection finds it, in fewer tries. Each run recomputed frees about as much activation memory as the last,
    and a plan that does not fit has its chunks placed as full as the host allows, so its device peak falls with
    its activation peak: the next k tried is where the activation peak, taken as linear between the bracket's
    ends, has fallen by the lower end's excess over the usable budget (clamped inside the bracket: a guess that
    fit is followed by the one below it, usually the answer). Two such guesses, then one bisection step, and so
    on: never more than three times the tries of bisection, usually two.

    `ahead(ks)`: told, before each try, the tries that may follow it either way (the same rule applied to peaks
    taken as linear across the bracket), to plan them meanwhile; what is tried is the same with or without it."""
    lo, hi = 0, n                                     # attempt(lo) does not fit, attempt(hi) fits
    guesses = 0
    while hi - lo > 1:
        low, high = attempt(lo), attempt(hi)
        usable = usable_budget(low.budget_bytes, cuda)
        ends = (low.activation_peak_bytes, low.device_peak_bytes), (high.activation_peak_bytes, high.device_peak_bytes)
        k, guesses = _next_try(lo, hi, *ends, guesses, usable)
        if ahead is not None:
            ahead(_likely_after(k, lo, hi, *ends, guesses, usable))
        lo, hi = (lo, k) if attempt(k).fits else (k, hi)
    return hi


def _next_try(lo: int, hi: int, low: tuple[int, int], high: tuple[int, int], guesses: int,
              usable: int | None) -> tuple[int, int]:
    """The bisection's next k and guess count from the bracket's ends' (activation peak, device peak)."""
    if guesses < 2 and usable is not None and low[0] > high[0]:
        per_run = (low[0] - high[0]) / (hi - lo)
        return min(max(lo + math.ceil((low[1] - usable) / per_run), lo + 1), hi - 1), guesses + 1
    return (lo + hi) // 2, 0


def _likely_after(k: int, lo: int, hi: int, low, high, guesses: int, usable: int | None, depth: int = 3) -> list[int]:
    """The tries that follow k whether it fits or not, and theirs, `depth` deep, nearest first; k's peaks are
    taken on the line between the bracket's ends (what the guesses assume too)."""
    out, level = [], [(k, lo, hi, low, high, guesses)]
    for _ in range(depth):
        nxt = []
        for k, lo, hi, low, high, g in level:
            f = (k - lo) / (hi - lo)
            at_k = tuple(round(a + (b - a) * f) for a, b in zip(low, high))
            for b_lo, b_hi, b_low, b_high in ((lo, k, low, at_k), (k, hi, at_k, high)):
                if b_hi - b_lo > 1:
                    k2, g2 = _next_try(b_lo, b_hi, b_low, b_high, g, usable)
                    out.append(k2)
                    nxt.append((k2, b_lo, b_hi, b_low, b_high, g2))
        level = nxt
    return list(dict.fromkeys(out))

def _copy_graph(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A copy to try a plan on. Lazy: its Python code is generated only if this copy is the one kept
    (code generation was two thirds of planning time for an 18B model, over a dozen discarded tries)."""
    g, nodes = copy_graph(gm.graph)
    return _LazyGraphModule(gm, g), nodes
