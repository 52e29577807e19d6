"""step_log: the kinds of pass a step runs, the record of what a step did, and StepRolledBack.

A transaction (transactions.py) runs its step as one or more passes; each pass is opened with one of the
`StepPass` records below, which tell the updater what to do with each chunk's gradient as backward completes
it.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from ..optim import Hyper


class StepRolledBack(RuntimeError):
    """An update of an earlier step failed after that step returned; that step was rolled back."""


@dataclass(frozen=True)
class StepPass:
    """What the updater does with each chunk's complete gradient during one pass of a step. A pass that neither
    accumulates nor replays adds each gradient's squared norm to the verdict as it arrives."""
    name: str
    updates: bool = False       # the chunk is updated now, with the pass's Hyper
    keeps: bool = False         # the gradient waits for the verdict in the chunk's kept buffer
    accumulates: bool = False   # it is summed into the chunk's fp32 accumulator; the last micro-batch measures the sum
    replays: bool = False       # it restores the moments of a replayed step (and, correcting, applies the update)
    undoable: bool = False      # what the step applies, now or after the verdict, can be undone from what it keeps

    @property
    def only_measures(self) -> bool:
        """It changes no chunk: its gradients only join the verdict (or the accumulators)."""
        return not (self.updates or self.keeps or self.replays)


SPECULATE_KEEPING = StepPass("speculate, keeping gradients", updates=True, keeps=True, undoable=True)
SPECULATE = StepPass("speculate", updates=True)     # nothing kept: a replay corrects or rolls it back (for the updater
                                                    # as APPLY; the replay's rollback looks for this pass)
APPLY = StepPass("apply", updates=True)             # the verdict is known, or nothing can undo it
MEASURE = StepPass("measure")                       # a two-pass step's first pass
DEFER = StepPass("defer", keeps=True)               # updates wait for the verdict, from the kept gradients
ACCUMULATE = StepPass("accumulate", accumulates=True, undoable=True)   # a micro-batch of an accumulating step
REPLAY = StepPass("replay", replays=True)           # the step again, after restore_masters
AFTER_VERDICT = StepPass("apply after the verdict", updates=True)   # from kept gradients or accumulators


@dataclass
class StepLog:
    """What one step did, as far as undoing it needs to know."""
    hyper: Hyper
    kind: StepPass                                         # the pass running now (or last)
    device: list[int] = field(default_factory=list)        # device chunks whose update was launched
    host: dict[int, Future | bool] = field(default_factory=dict)   # host chunk -> applied (or its future)
    host_sq: dict[int, float] = field(default_factory=dict)   # parameter -> its squared norm, measured on the host
    undoable: bool = False
    why_not_undoable: str = "with nothing kept ('replay')"   # what a failed settling step's error says
    redo: bool = False                                     # a replay that applies the corrected update
    hyper_of: dict[int, Hyper | None] = field(default_factory=dict)   # a chunk corrected (or undone) since: its Hyper
    # the verdict's update, once a correction is decided (undo.py `correct`): a host update of this step that starts
    # on the worker after that applies it instead of the guess, and its correction is then nothing
    verdict_hyper: Hyper | None = None
    copies_first: list[Future] = field(default_factory=list)   # its corrections' 16-bit copies made first

    def pending_host(self) -> bool:
        return any(isinstance(f, Future) for f in self.host.values())
