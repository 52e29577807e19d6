"""contract: what a pass is (a name, one function `run(gm, ctx) -> gm`, what it requires and provides), what it
is handed (`PassContext`), and the check that runs before any pass touches a graph (DeepCompile's
`validate_schedule`): a pipeline whose order breaks a contract fails at once, naming the pass and what it lacks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from ..config import Config
from ..layout import Layout
from ..planning import Plan

# capabilities: what a graph has once a pass ran (CAPTURED: capture's joint graph, roles tagged, the `rt` input)
CAPTURED, RANDOM_SEEDED, VIEWS_LOCAL, LEAN_LOSS = "captured", "random_ops_seeded", "param_views_local", "lean_loss"
RECOMPUTED, FUSED, PLANNED, CHUNK_OPS = "recompute_chosen", "optimizer_fused", "planned", "chunk_ops"
GRADS_IN_SLOTS, REGIONS = "grads_written_in_slots", "compiled_regions"


class PassContractError(ValueError):
    """A pipeline runs a pass before the passes that provide what it requires."""


@dataclass(frozen=True)
class PassContext:
    """What passes are handed besides the graph. `plan` is None until the plan step made it; `plan_step` is the
    driver's (pipeline/: it runs passes and the planner, so passes cannot hold it); `record` keeps a graph, or
    a function making its code, as a pass received it (`engine.graph_before`)."""
    layout: Layout
    config: Config
    device: torch.device
    dtype: torch.dtype                                  # the compute dtype
    dp: str | None = None                               # "replicated", "chunked" (partitioned) or None (one rank)
    plan: Plan | None = None
    segments: tuple = ()                                # recompute's: the forward segments the plan step tries
    plan_step: Callable[[fx.GraphModule, "PassContext"], fx.GraphModule] | None = None
    record: Callable[[str, "fx.GraphModule | Callable[[], str]"], None] = lambda name, graph: None
    # the plan step's early word on host memory: a plan with no more host chunks than the final one will have (the
    # engine page-locks their buffers meanwhile: runtime/host_memory.py HostReserve)
    host_hint: Callable[[Plan], None] | None = None
    # told the plan as soon as the plan step has made it (a plan that fits), before the passes after it: the engine
    # allocates the chunk memory and starts writing the initial weights while lowering and regions go on. Only the
    # memory model's peaks and remarks may still change after it (a PlanDelta), never what is allocated
    on_planned: Callable[[Plan], None] | None = None
    # lint the graph a pass returns (the recompute search's tries do not: the try it keeps is linted by every pass
    # after it, and the discarded dozen cost seconds at 70B)
    lint: bool = True


@dataclass(frozen=True, repr=False)
class Pass:
    name: str
    run: Callable[[fx.GraphModule, PassContext], fx.GraphModule]
    requires: frozenset[str] = frozenset()
    provides: frozenset[str] = frozenset()
    optional: bool = False                              # Config.disable_passes may name it
    why: str = ""                                       # one line
    only_if: str | None = None                          # a Config property that must be true for it to run
    runs: tuple[str, ...] = ()                          # passes it runs inside (each recorded under its own name)

    def __str__(self) -> str:
        flags = [f for f, on in (("optional", self.optional), (f"only if Config.{self.only_if}", self.only_if),
                                 (f"runs {' + '.join(self.runs)}", self.runs)) if on]
        return (f"{self.name}{' [' + ', '.join(flags) + ']' if flags else ''}: requires "
                f"{', '.join(sorted(self.requires)) or '-'}; provides {', '.join(sorted(self.provides)) or '-'}")

    def __repr__(self) -> str:                          # print(PIPELINE) reads as the compiler
        return f"<{self}>"


def check_pipeline(passes: list[Pass], have: frozenset[str] = frozenset({CAPTURED})) -> None:
    """Raise PassContractError at the first pass that requires what neither `have` nor an earlier pass provides."""
    provided = set(have)
    for i, p in enumerate(passes):
        missing = sorted(p.requires - provided)
        if missing:
            raise PassContractError(f"pass {p.name!r} (step {i}) requires {missing}, which no earlier pass provides; "
                                    f"passes so far: {[q.name for q in passes[:i]]}")
        provided |= p.provides


def describe(passes: list[Pass]) -> str:
    """The pipeline, one numbered pass a line, with its contract and why."""
    return "\n".join(f"{i}. {p}\n     {p.why}" for i, p in enumerate(passes, 1))
