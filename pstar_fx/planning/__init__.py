"""planning: what the step needs and where everything lives — the planner and the records it returns.

It reads a fused graph (chunk reads, gradient writes and updates are nodes), the Layout and the Config, and
imports nothing from `passes/`: a pass that knows something the planner must count writes it into `node.meta`.

planner.py (`make_plan`) runs the stages in order: blocks.py (the model's blocks as spans of nodes, for a plan by
block, which `fuse_optimizer` marks), liveness.py (what the graph's values hold), memory.py (bytes),
placement.py (chunks on the device, slots), transaction.py, host_adam.py, shipping.py, schedule.py (chunk moves),
costs.py (seconds), correction.py (the step when clipping triggers), report.py (words); plan.py holds the frozen
records they make, timeline.py what plot draws.
"""
from .costs import NOMINAL_COLL_BW, Rates, assumed, calibrate, node_seconds
from .liveness import LiveSet, activation_profile, last_uses, op_scratch_bytes
from .memory import CUDA_BLOCK_BYTES, usable_budget
from .plan import BudgetError, NodeProfile, Plan, PlanDelta, fold
from .planner import make_plan
from .schedule import Schedule, belady, place_prefetches
from .shipping import keeps_compute_copies
from .timeline import TIER_NAMES, Timeline

__all__ = ["make_plan", "fold", "Plan", "PlanDelta", "NodeProfile", "Timeline", "TIER_NAMES", "BudgetError",
           "CUDA_BLOCK_BYTES", "usable_budget", "keeps_compute_copies", "Rates", "calibrate", "assumed",
           "node_seconds", "NOMINAL_COLL_BW", "LiveSet", "last_uses", "activation_profile", "op_scratch_bytes",
           "Schedule", "belady", "place_prefetches"]
