"""transaction: how a step stays provisional until its verdict (see Config.transaction for the choices) — which
transaction the host budget allows, what it keeps (every gradient, and whether the device chunks' stay on the
device), and whether "two_pass" measures first.
"""
from __future__ import annotations

import os

from ..config import Config, parse_flag

KEEPS = ("kept_grads", "deferred")   # the transactions that keep every chunk's gradient until the verdict


def _choose_transaction(config: Config, kept_total: int, host_free: int | None,
                        random_ops: list[str]) -> tuple[str, int]:
    """(transaction, host bytes of kept gradients). See Config.transaction for the choices. A step with random
    ops the seed_random pass did not seed (`random_ops`; normally none) cannot be replayed faithfully.
    `kept_total`, `host_free`: bytes of every kept gradient, and of the host budget left for them."""
    if config.grad_accum > 1:
        return "accumulate", 0        # the accumulators keep the step's gradients; updates run after the verdict
    choice = config.transaction
    if choice == "replay" and random_ops:
        raise ValueError(f"transaction 'replay' runs a step again, but this step draws random numbers "
                         f"({', '.join(random_ops[:3])}{', ...' if len(random_ops) > 3 else ''}): a replay would "
                         "draw others; use 'kept_grads' or 'two_pass'")
    fits = host_free is None or kept_total <= host_free
    if choice == "auto" and not config.moments_undoable:
        # bf16 and int8 moments cannot be undone: keep the gradients and apply after the verdict, or measure first
        choice = "deferred" if fits else "two_pass"
    if choice == "auto":
        choice = "kept_grads" if fits else "two_pass" if random_ops else "replay"
    return choice, kept_total if choice in KEEPS else 0


def n_grad_slots_to_keep(transaction: str, n_grad_slots: int, *, cuda: bool, n_device: int) -> int:
    """Gradient slots once the transaction is known: a device chunk's kept gradient is copied to the host from its
    slot, and a second slot lets backward go on meanwhile (bench/RESULTS.md: the compute stream waited for those
    copies with one)."""
    if transaction in KEEPS and cuda and n_device and n_grad_slots < 2:
        return 2
    return n_grad_slots


def n_kept_on_device(n_updated_device: int, chunk_bytes: int, device_peak_bytes: int, budget_bytes: int | None) -> int:
    """How many device chunks keep their gradients on the device: as many as fit beside the peak (no copy out, and
    none back for a correction or an update after the verdict); the rest go to the host. Whole-or-nothing left a
    Llama-3-8B-shaped step copying every device chunk's gradient back before it could correct any (issue 24)."""
    if budget_bytes is None:
        return n_updated_device
    return max(0, min(n_updated_device, (budget_bytes - device_peak_bytes) // chunk_bytes))


def kept_here(updated_device: list[int], kept_on_device: int) -> list[int]:
    """The device chunks (of `updated_device`, the ones a rank updates) whose kept gradient stays on the device: the
    first `kept_on_device` in chunk order, the ones the next forward reads first (and backward completes last). The
    planner, `compile_regions` and the runtime's `KeptGradients` all pick them by this."""
    return sorted(updated_device)[:kept_on_device]


def kept_along(n_nodes: int, kept_at: list[int], chunk_bytes: int) -> list[int]:
    """Device bytes of kept gradients after each of `n_nodes` nodes, each kept from its update's node (`kept_at`) on
    (`KeptGradients.keep`: the gradient is copied out of its slot into a buffer allocated then)."""
    out, at, n = [], sorted(kept_at), 0
    for i in range(n_nodes):
        while n < len(at) and at[n] <= i:
            n += 1
        out.append(n * chunk_bytes)
    return out


def kept_in_activations_on() -> bool:
    """PSTAR_FX_KEPT_IN_ACTIVATIONS (default 0: device chunks' kept gradients beside the peak alone, the rest on the
    host; 1: as many more as fit in the memory backward frees, `Transaction.kept_in_activations`). Off by default
    until it is timed where it should pay: on the H200 at GPT3_10B's shape, where 37 device chunks' 14.9 GB would
    stop crossing to the host and back (`bench/closeout.sh H`, not yet run). On an H100 at Llama-3-8B's shape (8 of
    16 chunks on the GPU, 1 GB a kept gradient), each copied out of its slot (`KeptGradients.keep`), the untriggered
    step ran 1.0% faster than without, with 6 allocator retries in 19 steps against 0; the triggered step there is
    the host's correction of 8 host chunks either way (bench/RESULTS.md, sessions 38 and 39)."""
    return parse_flag(os.environ.get("PSTAR_FX_KEPT_IN_ACTIVATIONS", "0"), "PSTAR_FX_KEPT_IN_ACTIVATIONS")


def n_kept_in_activations(kept_at: list[int], activation_bytes: list[int], chunk_bytes: int,
                          device_peak_bytes: int, activation_peak_bytes: int, budget_bytes: int | None) -> int:
    """How many device chunks may keep their gradients on the device when each is allocated as backward completes it
    and released at the step's end (`Transaction.kept_in_activations`), counted node by node beside the graph's live
    values: the first `k` of `kept_at` (each chunk's update node, in the order the next forward reads the chunks,
    which backward completes last, where backward has freed the most). `device_peak_bytes`: the peak with none
    kept. At GPT3_10B's shape every one of the 37 device chunks' (14.9 GB) fits in what backward frees, where none
    fit beside the peak (bench/RESULTS.md, session 38, planned at the H200's rates; a gradient's margin kept free of
    the budget where one is kept changed nothing on an H100)."""
    if budget_bytes is None:
        return len(kept_at)

    def fits(k: int) -> bool:
        return device_peak_bytes + kept_in_activations_bytes(kept_at[:k], activation_bytes, chunk_bytes,
                                                             activation_peak_bytes) <= budget_bytes

    if not fits(0):                   # the step itself over the budget: none kept
        return 0
    lo, hi = 0, len(kept_at)          # fits(lo); more kept never lowers the peak
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def kept_in_activations_bytes(kept_at: list[int], activation_bytes: list[int], chunk_bytes: int,
                              activation_peak_bytes: int) -> int:
    """What kept gradients allocated in backward (each from its update's node, `kept_at`, to the step's end) add to
    the plan's activation peak: live values plus kept gradients node by node, over `activation_peak_bytes` (0 where
    they fit under it). The one form of that peak: the planner's memory breakdown and `n_kept_in_activations`."""
    kept = kept_along(len(activation_bytes), kept_at, chunk_bytes)
    return max(0, max((a + b for a, b in zip(activation_bytes, kept)), default=0) - activation_peak_bytes)


def defer_above(speculated: float, triggered: float, deferred: float) -> float | None:
    """The expected trigger rate above which a kept_grads (replay) step is cheaper deferred (measuring first), on
    the same buffers: at
    rate r speculating costs `speculated` + r * (`triggered` - `speculated`), deferring costs `deferred` whatever
    the norm. None: speculating never costs more (a correction is as cheap as deferring)."""
    if deferred >= triggered:
        return None
    if deferred <= speculated:
        return 0.0
    return (deferred - speculated) / (triggered - speculated)


def two_passes(transaction: str, config: Config, random_ops: list[str]) -> bool:
    """Whether a "two_pass" step measures first. With nothing to measure it runs one pass that rolls back as a
    replay; a step that cannot be replayed (unseeded random ops) measures first all the same, so a skipped step
    still changes nothing."""
    return transaction == "two_pass" and (config.verdict_changes_updates or bool(random_ops))
