"""plan: the records the planner returns — a frozen `Plan` made of one frozen record per decision.

`make_plan` (planner.py) writes a Plan once; nothing edits it afterwards. A stage after the planner that learns
something the plan must count hands a `PlanDelta` to `fold`, which returns a new Plan. Readers use the flat
properties (`plan.placement`, `plan.slots`, `plan.device_peak_bytes`, `plan.transaction`, ...); each sub-record
says which stage decided it:

  chunks            Placement: each chunk's tier ("device" | "host" | "remote"), data-parallel ranks (placement.py)
  buffers           Slots: compute slots, gradient slots, pinned host gradient buffers (placement.py, host_adam.py)
  moves             Moves: per node, chunk moves before and after it (schedule.py)
  shipping          Shipping: how each host chunk's compute copy crosses; 16-bit copies kept on the device
                    (shipping.py)
  step_transaction  Transaction: how a step stays provisional until its verdict, and what that keeps
                    (transaction.py)
  memory            Memory: predicted device and host bytes, by kind, against the budgets (memory.py)
  estimate          Estimate: the step's seconds from the cost model, and the rates it used (costs.py)
  remarks           Remarks: notes, why it does not fit, what backward recomputes (report.py)
  profile           NodeProfile: what the planner knew node by node (what `timeline()` draws)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .costs import Rates
from .report import summary
from .timeline import Timeline, timeline_of


class BudgetError(MemoryError):
    """The step cannot fit the memory budget; raised at compile/plan time, before any step runs."""


@dataclass(frozen=True)
class Placement:
    placement: list[str]      # chunk -> "device" | "host" (its fp32 master and moments) | "remote" (another rank's)
    n_device: int = 0         # chunks on the device among those a rank owns (all chunks on one rank)
    world: int = 1            # data-parallel ranks the chunks are partitioned over (1: none)
    rank: int = 0             # whose plan this is: chunks another rank owns are "remote"
    host_order: str = "last"  # how the host chunks lie among a rank's (placement.py HOST_ORDERS)


@dataclass(frozen=True)
class Slots:
    n_compute: int            # compute buffers on the device (one chunk each) for chunks not computing on their master
    n_grad: int               # gradient buffers on the device, enough for the chunks whose backward overlaps
    n_host_grad: int          # pinned host buffers where host chunks' gradients wait for the host Adam


@dataclass(frozen=True)
class Moves:
    before: dict[str, list[tuple[str, int]]]    # node name -> (prefetch | fetch, chunk) before it
    after: dict[str, list[tuple[str, int]]]     # node name -> (release, chunk) after it
    n_fetches: int = 0
    # chunk -> the node its update goes after, where not right after its last use: the end of its block's span
    # (blocks.py; insert_chunk_ops moves it there)
    updates_after: dict[int, str] = field(default_factory=dict)
    by_block: bool = False      # planned by block (blocks.py): the compiled regions are cut where a block begins


@dataclass(frozen=True)
class Shipping:
    ship: list[str] = field(default_factory=list)   # per chunk, how its compute copy reaches the device:
    # "-" (state on the device), "shadow" (a 16-bit copy kept on the host, written by the host Adam in the
    # same pass), "cast" (cast on the host at fetch), "fp32" (the master crosses, cast on the device);
    # "remote" (another rank's). Bytes per parameter that cross: shipping.ship_bytes_per_elem
    keeps_compute_copies: bool = False   # each device chunk's 16-bit compute copy stays from step to step


@dataclass(frozen=True)
class Transaction:
    name: str = "none"               # how a step stays provisional until it commits (runtime/step.py)
    replayable: bool = True          # no unseeded random op: a step run again computes the same gradients
    two_passes: bool = False         # "two_pass" that measures first: something to measure, or no replay
    kept_on_device: int = 0          # kept_grads/deferred: how many device chunks keep their gradients on the
    # device (the first ones a rank owns, which the next forward reads first); the others' go to the host
    defer_above: float | None = None  # kept_grads or replay chosen by "auto" with clipping: a step lets its updates
    # wait for the verdict (as "deferred" / "two_pass", on the same buffers) while the expected trigger rate is above
    # this (runtime/transactions.py MayDefer)
    kept_in_shadow: bool = False     # deferred: a host chunk's gradient is kept in its 16-bit shadow
    cost: str = ""                   # what it costs, and how much smaller it makes the largest model
    kept_in_activations: bool = False  # the `kept_on_device` gradients are allocated as backward completes each, in
    # the memory it frees, and released at the step's end (planned node by node beside the graph's live values);
    # False: allocated once, beside the peak


@dataclass(frozen=True)
class Memory:
    device_peak_bytes: int
    host_peak_bytes: int
    device_breakdown: dict[str, int]       # what the device peak is made of (sums to it)
    host_breakdown: dict[str, int]
    activation_peak_bytes: int             # live graph values at their peak (part of the device peak)
    optimizer_state: str                   # the moments' dtype (Config.optimizer_state)
    state_bytes_per_param: float           # chunk state per element: master + moments (+ int8 scales)
    budget_bytes: int | None = None        # Config.device_memory
    host_budget_bytes: int | None = None   # Config.host_memory
    grad_chunk_bytes: int = 0              # a gradient slot's bytes: a kept gradient's too


@dataclass(frozen=True)
class Estimate:
    step_seconds: float = 0.0        # from the cost model (costs.py); compares plans, not a promise
    rates: Rates | None = None       # the copy/compute/host-Adam rates it used
    # the step when clipping triggers (the global norm above grad_clip): a kept_grads step's correction pass, a
    # replay's second pass; the other transactions apply after the verdict, or measure first: step_seconds
    # (correction.py `_triggered_seconds` says what each costs)
    triggered_step_seconds: float = 0.0
    clips: bool = False              # Config.grad_clip is set: the summary prints the triggered step
    deferred_step_seconds: float | None = None   # with Transaction.defer_above: the step deferred (kept_grads) or
    # measuring first (replay), on the same buffers
    # the untriggered step's parts, to read a measured step against (bench/gpt.py records them beside the runtime's
    # per-phase seconds): the graph's compute (recompute included; a step measuring first counts it twice), the copies
    # it cannot hide, the host Adam it cannot hide, and the host Adam's parameters/s beside the step's copies
    compute_seconds: float = 0.0
    copies_exposed_seconds: float = 0.0
    grad_slot_waits_seconds: float = 0.0   # of those, backward's waits for gradients copied out of a slot
    host_adam_exposed_seconds: float = 0.0
    host_adam_rate: float = 0.0

    def expected_step_seconds(self, trigger_rate: float | None) -> float:
        """The step expected when clipping triggers on `trigger_rate` of the steps, as the runtime runs them: each
        speculated (untriggered, or triggered and corrected), or, where the plan may defer (`deferred_step_seconds`),
        deferred when that costs less at this rate (the runtime defers above `defer_above`, the break-even). None,
        or no clipping: the untriggered step."""
        if trigger_rate is None or not self.clips:
            return self.step_seconds
        speculated = (1.0 - trigger_rate) * self.step_seconds + trigger_rate * self.triggered_step_seconds
        return speculated if self.deferred_step_seconds is None else min(speculated, self.deferred_step_seconds)


@dataclass(frozen=True)
class Remarks:
    notes: list[str] = field(default_factory=list)
    why: str = ""                    # empty when it fits; else what is missing and what was tried
    recompute: str = ""              # which forward segments backward recomputes, and why
    tried: tuple[str, ...] = ()      # the recompute search's tries, a line each, in the order it made them


@dataclass(frozen=True)
class NodeProfile:
    """What make_plan knew node by node (one list of ints and the graph's names: cheap at 10k nodes)."""
    node_names: list[str]           # the planned graph in order (engine.graph without its chunk moves)
    activation_bytes: list[int]     # live graph values while each node runs (activation_profile)
    backward_start: int             # first node reading the tangent; len(node_names) for a forward-only step
    update_at: dict[int, int]       # chunk -> index of its rt.adam(c) node
    chunk_elems: int
    param_elems: int


@dataclass(frozen=True)
class Plan:
    chunks: Placement
    buffers: Slots
    moves: Moves
    memory: Memory
    shipping: Shipping = field(default_factory=Shipping)
    step_transaction: Transaction = field(default_factory=Transaction)
    estimate: Estimate = field(default_factory=Estimate)
    remarks: Remarks = field(default_factory=Remarks)
    profile: NodeProfile | None = field(default=None, repr=False)

    placement = property(lambda self: self.chunks.placement)
    n_device = property(lambda self: self.chunks.n_device)
    world = property(lambda self: self.chunks.world)
    rank = property(lambda self: self.chunks.rank)
    slots = property(lambda self: self.buffers.n_compute)
    grad_slots = property(lambda self: self.buffers.n_grad)
    host_grad_buffers = property(lambda self: self.buffers.n_host_grad)
    schedule_before = property(lambda self: self.moves.before)
    schedule_after = property(lambda self: self.moves.after)
    fetches = property(lambda self: self.moves.n_fetches)
    ship = property(lambda self: self.shipping.ship)
    keeps_compute_copies = property(lambda self: self.shipping.keeps_compute_copies)
    transaction = property(lambda self: self.step_transaction.name)
    replayable = property(lambda self: self.step_transaction.replayable)
    two_passes = property(lambda self: self.step_transaction.two_passes)
    kept_on_device = property(lambda self: self.step_transaction.kept_on_device)
    kept_in_activations = property(lambda self: self.step_transaction.kept_in_activations)
    kept_in_shadow = property(lambda self: self.step_transaction.kept_in_shadow)
    defer_above = property(lambda self: self.step_transaction.defer_above)
    transaction_cost = property(lambda self: self.step_transaction.cost)
    device_peak_bytes = property(lambda self: self.memory.device_peak_bytes)
    host_peak_bytes = property(lambda self: self.memory.host_peak_bytes)
    device_breakdown = property(lambda self: self.memory.device_breakdown)
    host_breakdown = property(lambda self: self.memory.host_breakdown)
    activation_peak_bytes = property(lambda self: self.memory.activation_peak_bytes)
    budget_bytes = property(lambda self: self.memory.budget_bytes)
    host_budget_bytes = property(lambda self: self.memory.host_budget_bytes)
    optimizer_state = property(lambda self: self.memory.optimizer_state)
    state_bytes_per_param = property(lambda self: self.memory.state_bytes_per_param)
    estimated_step_seconds = property(lambda self: self.estimate.step_seconds)
    estimated_triggered_step_seconds = property(lambda self: self.estimate.triggered_step_seconds)
    rates = property(lambda self: self.estimate.rates)
    notes = property(lambda self: self.remarks.notes)
    why = property(lambda self: self.remarks.why)
    recompute = property(lambda self: self.remarks.recompute)
    tried = property(lambda self: self.remarks.tried)

    def owner(self, c: int) -> int:
        """The rank that holds chunk c's state and updates it."""
        return c % self.world

    @property
    def fits(self) -> bool:
        return not self.why

    def summary(self) -> str:
        return summary(self)

    def timeline(self) -> Timeline:
        """The plan along the step: bytes per tier, chunk moves and each chunk's tier, node by node."""
        return timeline_of(self)


@dataclass(frozen=True)
class PlanDelta:
    """What a stage after the planner learned that the plan must count: a pass that holds more graph values
    than the planned graph did (compile_regions), or the recompute search's account of what it chose. The planner
    folds it in (`fold`); nobody else writes a Plan."""
    activation_bytes: int = 0          # more live bytes at the activation peak (device)
    notes: tuple[str, ...] = ()        # appended to the plan's notes
    recompute: str | None = None       # replaces the plan's recompute text
    why: str = ""                      # appended to why the plan does not fit (only when it does not)
    tried: tuple[str, ...] | None = None  # replaces the plan's record of the recompute search's tries


def fold(plan: Plan, delta: PlanDelta) -> Plan:
    """The plan with `delta` counted: its activation peak, its device peak and breakdown move together, so the
    summary still adds up. Returns a new Plan; `plan` is unchanged."""
    device = dict(plan.device_breakdown)
    if delta.activation_bytes:
        device["activations"] = device.get("activations", 0) + delta.activation_bytes
    memory = replace(plan.memory, device_breakdown=device,
                     activation_peak_bytes=plan.activation_peak_bytes + delta.activation_bytes,
                     device_peak_bytes=plan.device_peak_bytes + delta.activation_bytes)
    remarks = replace(plan.remarks, notes=[*plan.notes, *delta.notes],
                      recompute=plan.recompute if delta.recompute is None else delta.recompute,
                      tried=plan.remarks.tried if delta.tried is None else delta.tried,
                      why=plan.why + (f"; {delta.why}" if delta.why and plan.why else ""))
    return replace(plan, memory=memory, remarks=remarks)
