"""demo_budget: the device budget the CPU demo picks when it is given none, so that chunks really move.

With the CPU as the device tier and no budget, every chunk would stay on the "device" and nothing would move:
the demo would show nothing of what pstar_fx does. So `pstar-fx train` and `explain` first plan the whole step
on the device to learn what it needs, then compile in less: room for the step's activations, about a quarter of
the chunks' fp32 state and 4 compute slots (most state on the host, chunks moving every step); failing that, half
the state and 8 slots; failing that, the whole step (the planner may need more room than the estimate, e.g. when
one op reads more chunks at once).

Cost: the step is captured and planned once for the whole-step plan and again by each compile tried (at least
twice in all): `compile` captures its own step and cannot be handed another's capture.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from ..config import Config
from ..engine import Engine, compile, plan
from ..planning import BudgetError, Plan


@dataclass(frozen=True)
class DemoBudget:
    engine: Engine            # compiled in the first budget that fit
    budget_bytes: int         # that budget
    whole_step_bytes: int     # the device peak of the whole step on the device, for comparison


def applies(config: Config) -> bool:
    """The CPU plays the device tier and neither a device budget nor a placement was asked for."""
    return config.device == "cpu" and config.device_memory is None and config.placement == "auto"


def budgets_to_try(whole: Plan, config: Config) -> list[int]:
    """Device budgets, smallest first, from the plan with every chunk on the device; the last is that plan's peak."""
    # frozen chunks' weights count as state here: a quarter of all chunks stays, whichever kind they are
    state_bytes = whole.device_breakdown["chunk state"] + whole.device_breakdown.get("frozen chunks", 0)
    slots_bytes = whole.device_breakdown["compute slots"]
    n_chunks = len(whole.placement)
    chunk_state_bytes = state_bytes // n_chunks
    slot_bytes = whole.profile.chunk_elems * config.torch_dtype.itemsize
    base_bytes = whole.device_peak_bytes - state_bytes - slots_bytes
    budgets = [base_bytes + keep * chunk_state_bytes + slots * slot_bytes
               for keep, slots in ((n_chunks // 4, 4), (n_chunks // 2, 8))]
    return [b for b in budgets if b < whole.device_peak_bytes] + [whole.device_peak_bytes]


def compile_in_demo_budget(model: nn.Module, config: Config, example_inputs) -> DemoBudget:
    """`compile` in the smallest of `budgets_to_try` that fits; raises the last BudgetError if none does."""
    whole = plan(model, dataclasses.replace(config, placement="device", device_memory=None), example_inputs)
    budgets = budgets_to_try(whole, config)
    for i, budget in enumerate(budgets):
        try:
            engine = compile(model, dataclasses.replace(config, device_memory=budget), example_inputs)
        except BudgetError:
            if i == len(budgets) - 1:
                raise
            continue
        return DemoBudget(engine, budget, whole.device_peak_bytes)
