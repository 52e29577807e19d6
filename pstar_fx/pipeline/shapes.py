"""shapes: training steps at input shapes other than the compiled ones, on the compiled step's chunk memory.

A batch whose (micro-batch) shapes differ from the compiled ones gets its own graph of the same model: captured at
its shapes and lowered by the same pass list, its plan step planning on the compiled plan (`Lowered(on=...)`:
`make_plan(on=...)` keeps the placement, shipping, compute and gradient slots, host gradient buffers, transaction and
device-kept gradients the runtime was built from, and schedules this graph's moves and recompute inside them). So
no chunk memory is allocated for it; a shape whose activations do not fit beside that memory is a `BudgetError`
naming its sequence length. Graphs are cached by shape. The step state (Adam's step count, the loss scale, the
schedule, clipping's trigger history) is the one Stepper's, whichever graph runs a step.

With `Config.seq_buckets` the compiled step is at the largest bucket, every other bucket is lowered at compile()
(at the compiled batch size: a bucket that cannot fit fails there), and only the buckets' lengths are stepped:
padding a batch up to its bucket is the caller's (`pad_to_bucket`), which knows which input is the labels.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Callable, Sequence

import torch
from torch import nn

from ..config import Config
from ..planning import BudgetError, Plan
from .lower import Lowered

log = logging.getLogger("pstar_fx")

Key = tuple[tuple[tuple[int, ...], torch.dtype], ...]     # each input's micro-batch shape and dtype
Runner = Callable[[list, torch.Tensor], torch.Tensor]


def sequence_length(shapes: Sequence[Sequence[int]]) -> int | None:
    """The batch's sequence length: dimension 1 of its inputs with two or more dimensions (the longest, if they
    differ); None when no input has one."""
    lengths = [s[1] for s in shapes if len(s) >= 2]
    return max(lengths) if lengths else None


def check_compiled_length(example_inputs, config: Config) -> None:
    """With seq_buckets, the compiled step must be at the largest bucket: the chunk memory is sized for it.
    Checked on `example_inputs` as compile() takes them, before minutes of capture and planning."""
    if config.seq_buckets is None:
        return
    tensors = ([example_inputs] if isinstance(example_inputs, torch.Tensor) else
               list(example_inputs.values()) if isinstance(example_inputs, Mapping) else list(example_inputs))
    length = sequence_length([x.shape for x in tensors if isinstance(x, torch.Tensor)])
    if length != config.seq_buckets[-1]:
        raise ValueError(f"seq_buckets {list(config.seq_buckets)}: example_inputs have sequence length {length}, "
                         f"but the step is compiled (and its chunk memory sized) for the largest bucket: give "
                         f"example_inputs of sequence length {config.seq_buckets[-1]}")


def pad_to_bucket(x: torch.Tensor, buckets: Sequence[int], value: int | float) -> torch.Tensor:
    """`x` (batch, length, ...) padded at the end of dimension 1 up to the smallest bucket >= its length, with
    `value`: the pad token for ids, -100 for labels (cross_entropy's ignore_index: padded positions add nothing to
    a mean-reduced loss, so a causal model's loss and gradients are the unpadded batch's), 0 for attention masks."""
    length = x.shape[1]
    fit = [b for b in sorted(buckets) if b >= length]
    if not fit:
        raise ValueError(f"sequence length {length} is longer than the largest of seq_buckets {sorted(buckets)}")
    pad = torch.full((x.shape[0], fit[0] - length, *x.shape[2:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


class ShapeSteps:
    """The compiled step and the steps lowered for other input shapes, by micro-batch shape."""

    def __init__(self, compiled: Lowered, compiled_run: Runner, skeleton: nn.Module,
                 prepare: Callable[[Lowered], Runner]):
        """`skeleton`: the model's structure (meta weights) to capture other shapes from; `prepare`: a lowered
        step -> its runner on the engine's runtime (regions built, buffers bound)."""
        self.compiled = compiled
        self.config = compiled.config
        self._skeleton = skeleton
        self._prepare = prepare
        self._steps: dict[Key, tuple[Lowered, Runner]] = {
            tuple((tuple(i.shape), i.dtype) for i in compiled.capture.inputs): (compiled, compiled_run)}

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def shapes(self) -> list[Key]:
        """The micro-batch shapes lowered so far, the compiled one first."""
        return list(self._steps)

    @property
    def plans(self) -> dict[Key, Plan]:
        """Each lowered shape's plan (the compiled one first): its moves, activations and recompute on the compiled
        chunk memory."""
        return {key: lowered.plan for key, (lowered, _) in self._steps.items()}

    def get(self, inputs: list[torch.Tensor]) -> tuple[Lowered, Runner]:
        """The lowered step and runner for a batch (its tensors in placeholder order, grad_accum micro-batches
        along dimension 0); lowered now if its shape is new."""
        key = self._key(inputs)
        if key not in self._steps:
            self._steps[key] = self._lower(key)
        return self._steps[key]

    def lower_buckets(self) -> None:
        """Config.seq_buckets: every shorter bucket lowered now, at the compiled batch's other dimensions (dimension
        1 of each input that has the compiled length set to the bucket's), so that a bucket the chunk memory cannot
        serve fails at compile() rather than mid-run, and no step of those shapes waits for a capture."""
        compiled = [(tuple(i.shape), i.dtype) for i in self.compiled.capture.inputs]
        top = sequence_length([s for s, _ in compiled])
        for length in self.config.seq_buckets[:-1]:
            key = tuple(((s[0], length, *s[2:]) if len(s) >= 2 and s[1] == top else s, dtype) for s, dtype in compiled)
            if key not in self._steps:
                self._steps[key] = self._lower(key)

    def _key(self, inputs: list[torch.Tensor]) -> Key:
        k = self.config.grad_accum
        names = self.compiled.capture.signature.names()
        for name, x, spec in zip(names, inputs, self.compiled.capture.inputs):
            if x.dtype != spec.dtype:          # another shape is another graph; another dtype is a mistake
                raise TypeError(f"{name}: dtype {x.dtype}, but the step was compiled for {spec.dtype}")
            if k > 1 and x.dim() and x.shape[0] % k:      # (a 0-d input: check_inputs says it cannot be split)
                raise ValueError(f"{name}: shape {tuple(x.shape)}: its leading dimension must be a multiple of "
                                 f"grad_accum={k} (the batch is split into {k} micro-batches along it)")
        return tuple(((x.shape[0] // k, *x.shape[1:]) if k > 1 and x.dim() else tuple(x.shape), x.dtype)
                     for x in inputs)

    def _lower(self, key: Key) -> tuple[Lowered, Runner]:
        shapes = [s for s, _ in key]
        length = sequence_length(shapes)
        buckets = self.config.seq_buckets
        if buckets is not None and length not in buckets:
            fit = [b for b in buckets if length is not None and b >= length]
            raise ValueError(f"sequence length {length} is not one of seq_buckets {list(buckets)}"
                             + (f": pad the batch up to {fit[0]} (pstar_fx.pad_to_bucket; labels -100)" if fit else
                                ": it is longer than the largest, which the chunk memory was sized for"))
        compiled_shapes = [tuple(i.shape) for i in self.compiled.capture.inputs]
        log.info("a new input shape %s (sequence length %s): capturing and planning its step on the compiled chunk "
                 "memory (%d shape(s) so far; compiled for %s)", shapes, length, len(self._steps), compiled_shapes)
        examples = [torch.empty(s, dtype=dtype, device="meta") for s, dtype in key]
        lowered = Lowered(self._skeleton, self.config, examples, on=self.compiled)
        if not lowered.plan.fits:
            raise BudgetError(f"sequence length {length} (input shapes {shapes}) cannot run on the chunk memory "
                              f"compiled for {compiled_shapes}: {lowered.plan.why}. Train it at a shorter length, "
                              f"or compile for this one (its chunk memory is then sized for it)")
        return lowered, self._prepare(lowered)
