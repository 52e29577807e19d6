"""Config: every knob of a pstar_fx engine, typed, with one docstring per field.

Unknown keys and bad values raise at construction, naming the key and the valid choices, so a typo in a
JSON file fails before any tracing starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union, get_args

import torch

from .kernels import quant8
from .optim.loss_scale import DYNAMIC_DEFAULTS
from .optim.lr import check_schedule

Bytes = Union[int, str, None]
# the passes Config.disable_passes may name (the optional ones of pstar_fx.passes.PIPELINE)
OptionalPass = Literal["lean_cross_entropy", "grads_in_place", "compile_regions"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Config.optimizer_state -> the moments' chunk dtype (int8: uint8 codes into kernels/quant8.py's maps)
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
OPTIMIZERS = ("adamw", "adam")
_OPTIMIZER_DEFAULTS = {"type": "adamw", "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def parse_bytes(value: Bytes, key: str) -> int | None:
    """`64MiB`, `"141GB"`, `1048576` -> bytes. None stays None (= no limit / automatic)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{key}: expected bytes as an int or a string like '64MiB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{key}: must be positive, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if n > 0:
                return n
        raise ValueError(f"{key}: cannot read {value!r} as a size; use an int or e.g. '64MiB', '141GB' "
                         f"(units: {', '.join(u for u in _UNITS if u)})")
    raise TypeError(f"{key}: expected bytes as an int or a string like '64MiB', got {type(value).__name__}")


def parse_count(value: str, key: str, unit: str, least: int | None = None) -> int:
    """An environment variable's whole number of `unit` (threads, processes); not a number, or below `least`: a
    ValueError naming `key`."""
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{key}: expected a number of {unit}, got {value!r}") from None
    if least is not None and n < least:
        raise ValueError(f"{key}: expected at least {least} {unit}, got {n}")
    return n


def parse_flag(value: str, key: str) -> bool:
    """An environment variable that switches something on ("1") or off ("0"); anything else: a ValueError naming
    `key` (a "false" must not turn it on)."""
    if value not in ("0", "1"):
        raise ValueError(f"{key}: expected 0 or 1, got {value!r}")
    return value == "1"


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class Config:
    """How to compile and run a training step. Build with keywords, `Config.from_dict`, or `Config.from_file`."""

    device: str = "auto"
    """Device tier: "cuda", "cuda:N", "cpu" (the CPU plays the device tier, with `device_memory` enforced),
    or "auto" (cuda when available, else cpu)."""

    device_memory: Bytes = None
    """Budget of the device tier in bytes or a string ("64MiB", "141GB"). None: `compile()` takes the device's
    free memory (cuda) or no limit (cpu); `pstar_fx.plan()` plans with no limit. Everything the step holds on
    the device counts: chunks, buffers, activations."""

    host_memory: Bytes = None
    """Budget of the host tier: chunks, staging buffers, kept gradients and, on CUDA, 4 GiB of the process's
    own host memory (context, libraries, Python), which the planner charges to it. None: unlimited."""

    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute dtype: the 16-bit (or fp32) copies the model's ops run on. Master weights and Adam moments
    are always fp32. bf16/fp16 also trace the model under autocast, as PyTorch AMP would run it."""

    chunk_size: Union[int, Literal["auto"]] = "auto"
    """Elements per chunk. Every parameter lies whole inside one chunk, so a chunk holds at least the
    largest parameter. "auto" picks a size from the model (at least the largest parameter)."""

    optimizer: dict = field(default_factory=dict)
    """Optimizer: {"type": "adamw" | "adam", "lr", "betas", "eps", "weight_decay"}. Missing keys take
    torch.optim.AdamW's defaults (weight_decay 0.01 for adamw, 0 for adam)."""

    placement: Literal["auto", "device", "host"] = "auto"
    """Where chunks' fp32 state (master weight, exp_avg, exp_avg_sq) lives: "auto" keeps as many chunks on
    the device as the budget allows; "device" requires all of them there; "host" keeps all on the host."""

    seed: int = 0
    """Seed of the weights the engine initializes itself (a model built on the meta device), and of every
    random op in the step (dropout): each draws from a seed made of (seed, step, micro-batch, op), so two runs
    with one seed are identical and recompute or a replayed step redraws the same masks."""

    grad_clip: float | None = None
    """Max global L2 norm of the gradient over all trainable parameters: exactly
    `torch.nn.utils.clip_grad_norm_(params, grad_clip)` before the update. None: no clipping. Costs nothing
    when it does not trigger (the norm is summed on the device as gradients are produced). When it triggers,
    the cost depends on the `transaction`: kept_grads corrects each chunk's update in one pass, replay runs the step
    again; deferred, two_pass and accumulate apply updates only after the norm is known, so nothing is undone."""

    grad_accum: int = 1
    """Micro-batches per optimizer step. `example_inputs` is one micro-batch; `engine.step(*inputs)` takes
    the whole batch (leading dimension grad_accum x the compiled one) and updates once, as one step on
    the whole batch of a mean-reduced loss. Costs an fp32 accumulator per parameter (4 B) on its tier;
    the updates then run after the last micro-batch, from the accumulators."""

    lr_schedule: Union[None, dict, Callable[[int], float]] = None
    """None (constant), {"type": "cosine" | "linear" | "constant", "warmup_steps", "total_steps",
    "min_lr"} (Hugging Face's formulas; min_lr absolute, default 0; past total_steps the rate stays at
    min_lr), or a callable step -> multiplier (as LambdaLR). `step` counts applied updates from 0."""

    loss_scale: Union[Literal["auto", "dynamic"], float, dict, None] = "auto"
    """"dynamic" (torch.amp.GradScaler's rules: 2**16, x2 after 2000 clean steps, x0.5 on overflow; a dict
    of "init_scale", "growth_factor", "backoff_factor", "growth_interval" changes them), a float (static),
    or None. "auto": dynamic for fp16, None for bf16/fp32. Whatever the scale, a step with a non-finite
    gradient is skipped whole: no chunk changes, the step count and schedule do not advance."""

    data_parallel: Literal["auto", "replicated", "chunked"] = "auto"
    """With several ranks (torchrun): "chunked" (PatrickStar's: chunk c's fp32 master and moments live only on
    rank c % N, on its device or host tier; its compute copy is broadcast from there when needed and its
    gradient reduced there, where it is updated: each rank holds 1/N of the model's state), or "replicated"
    (every rank holds the whole state; each chunk's gradient is summed over the ranks right before its
    update). "auto": chunked. Ignored in one process."""

    dist_timeout: float = 300.0
    """Seconds a collective may wait for the other ranks before the step fails (a dead or hung rank)."""

    transaction: Literal["auto", "kept_grads", "deferred", "replay", "two_pass", "none"] = "auto"
    """How a step's updates stay provisional until it commits (exact clipping, skips, rollback on an exception).
    "kept_grads": speculative updates inside backward, each chunk's gradient kept (compute-dtype bytes per param);
    a correction makes each again with the clip coefficient, in one pass. "replay": the same with nothing kept; a
    correction runs the step again.
    "deferred": gradients kept, every update applied after the verdict (1x compute, no undo). "two_pass": a first
    pass measures, the second applies (2x compute when there is something to measure; no memory). "none": no
    protection (not allowed with grad_clip). "auto": the planner picks by memory and cost (kept_grads, else replay;
    with bf16/int8 moments deferred, else two_pass). README "The step as a transaction" has the details."""

    expected_trigger_rate: float | None = None
    """The share of steps whose clipping is expected to trigger, for a kept_grads or replay plan chosen by "auto"
    with grad_clip: the plan prices a step speculated (untriggered, and corrected or replayed when clipping
    triggers) and deferred (kept_grads: updates after the verdict, from the same kept gradients; replay: measuring
    first, as two_pass), and a step defers while this rate is above the break-even (`plan.defer_above`), else
    speculates; each is exact. None: measured, the share of the last 8 steps
    whose clipping triggered, counting the steps not yet run as triggering (a run's first steps clip: norms start
    far above 1.0). On the CUDA runtime of one process the costs compared at this rate are the run's own timed
    steps once it has timed some (runtime/timed_switch.py; PSTAR_FX_TIMED_SWITCH=0: the plan's alone).
    A number in [0, 1] fixes it (0: speculate, unless this run timed deferred steps cheaper; 1: defer whenever
    deferring can pay), and
    the plan is made for it: the recompute search minimizes the step expected at that rate
    (`plan.estimate.expected_step_seconds`), so a run that clips on most steps (a fine-tune's) may recompute more
    to hold more chunks on the device, whose updates need no host correction."""

    optimizer_state: Literal["fp32", "bf16", "int8"] = "fp32"
    """How the Adam moments exp_avg and exp_avg_sq are stored in the chunks (the masters stay fp32): "fp32" 12
    B/param of chunk state; "bf16" 8 B/param (round to nearest even after each fp32 step); "int8" 6.03 B/param
    (bitsandbytes-style blockwise 8-bit codes with an fp32 absmax per 256 elements; kernels/quant8.py). Rounded or
    quantized moments cannot be undone: "kept_grads" and "replay" are refused and "auto" picks "deferred" (or
    "two_pass" when the host cannot hold the kept gradients). Checkpoints hold fp32 moments in every mode, so a run
    moves between modes; README "Compact optimizer state" has the accuracy and the loss curves."""

    compute: Literal["auto", "eager", "inductor"] = "auto"
    """How the step's compute between chunk nodes runs. "inductor": each run of ATen ops between two chunk
    nodes is compiled by torch.compile's Inductor (norms, activations, residual adds, bias gradients and casts
    fuse; matmuls and attention stay library kernels); regions with the same ops share one compiled function,
    built at the first step. Chunk nodes stay where the plan put them and the plan counts what the regions
    hold (passes/compile_regions.py). "eager": op by op, as traced. "auto": inductor on CUDA, eager on CPU."""

    disable_passes: tuple[OptionalPass, ...] = ()
    """Optional graph passes to switch off, by name (pstar_fx.passes.PIPELINE lists them): "lean_cross_entropy"
    (the loss then allocates its log-probabilities' gradients as ATen does: up to two more tensors of the
    logits' fp32 size), "grads_in_place" (each matmul's weight gradient is then a tensor copied into its slot),
    "compile_regions" (the compute then runs op by op, as compute="eager"). Results stay within rounding; the
    passes the others need cannot be switched off."""

    seq_buckets: tuple[int, ...] | None = None
    """The sequence lengths the step will see (dimension 1 of every input with two or more dimensions), e.g.
    (512, 1024, 2048). `example_inputs` must be at the largest: `compile()` sizes the chunk memory for it and lowers
    each other length's graph on that memory at the same batch size (pipeline/shapes.py), so a length that cannot
    fit is a BudgetError there; each bucket adds a capture and a plan to the compile. A batch of another length is
    an error (pad it up to its bucket: `pstar_fx.pad_to_bucket`, labels -100). None: every new input shape gets
    its own graph on the compiled chunk memory when its first batch comes, if it fits there."""

    def __post_init__(self):
        self.device = self._check_device(self.device)
        self.device_memory = parse_bytes(self.device_memory, "device_memory")
        self.host_memory = parse_bytes(self.host_memory, "host_memory")
        _choice("dtype", self.dtype, tuple(DTYPES))
        _choice("placement", self.placement, ("auto", "device", "host"))
        _choice("compute", self.compute, ("auto", "eager", "inductor"))
        if isinstance(self.disable_passes, str) or not isinstance(self.disable_passes, (list, tuple)):
            raise TypeError(f"disable_passes: expected a list of pass names, got {self.disable_passes!r}")
        for name in self.disable_passes:
            _choice("disable_passes", name, get_args(OptionalPass))
        self.disable_passes = tuple(self.disable_passes)
        if self.chunk_size != "auto":
            if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int):
                raise TypeError(f"chunk_size: expected an int (elements) or 'auto', got {self.chunk_size!r}")
            if self.chunk_size <= 0:
                raise ValueError(f"chunk_size: must be positive, got {self.chunk_size}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed: expected an int, got {self.seed!r}")
        self.optimizer = self._check_optimizer(self.optimizer)
        if self.grad_clip is not None:
            if isinstance(self.grad_clip, bool) or not isinstance(self.grad_clip, (int, float)):
                raise TypeError(f"grad_clip: expected a number or None, got {self.grad_clip!r}")
            if not self.grad_clip > 0 or self.grad_clip == float("inf"):
                raise ValueError(f"grad_clip: must be a positive finite norm, got {self.grad_clip}")
            self.grad_clip = float(self.grad_clip)
        if isinstance(self.grad_accum, bool) or not isinstance(self.grad_accum, int):
            raise TypeError(f"grad_accum: expected an int, got {self.grad_accum!r}")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum: must be >= 1, got {self.grad_accum}")
        self.lr_schedule = check_schedule(self.lr_schedule)
        self.loss_scale = self._check_loss_scale(self.loss_scale)
        _choice("transaction", self.transaction, ("auto", "kept_grads", "deferred", "replay", "two_pass", "none"))
        rate = self.expected_trigger_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1):
            raise ValueError(f"expected_trigger_rate: expected None (measured) or a number in [0, 1], got {rate!r}")
        _choice("optimizer_state", self.optimizer_state, tuple(MOMENT_DTYPES))
        if not self.moments_undoable and self.transaction in ("kept_grads", "replay"):
            raise ValueError(f"transaction: {self.transaction!r} undoes updates, and {self.optimizer_state} moments "
                             f"(optimizer_state={self.optimizer_state!r}) cannot be undone exactly; use 'auto', "
                             "'deferred', 'two_pass' or 'none'")
        _choice("data_parallel", self.data_parallel, ("auto", "replicated", "chunked"))
        if isinstance(self.dist_timeout, bool) or not isinstance(self.dist_timeout, (int, float)) \
                or self.dist_timeout <= 0:
            raise ValueError(f"dist_timeout: expected a positive number of seconds, got {self.dist_timeout!r}")
        self.seq_buckets = self._check_seq_buckets(self.seq_buckets)
        if self.transaction == "none" and self.grad_clip is not None:
            raise ValueError("transaction: 'none' cannot clip (the norm is known only after the updates); "
                             "use 'auto', 'kept_grads' or 'two_pass' with grad_clip")

    @staticmethod
    def _check_seq_buckets(buckets) -> tuple[int, ...] | None:
        if buckets is None:
            return None
        if isinstance(buckets, (str, bytes)) or not isinstance(buckets, (list, tuple)) or not buckets or any(
                isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in buckets):
            raise ValueError(f"seq_buckets: expected None or a list of positive sequence lengths like "
                             f"[512, 1024, 2048], got {buckets!r}")
        if len(set(buckets)) != len(buckets):
            raise ValueError(f"seq_buckets: a length appears twice in {list(buckets)}")
        return tuple(sorted(buckets))

    @staticmethod
    def _check_loss_scale(spec):
        if spec is None or spec in ("auto", "dynamic"):
            return spec
        if isinstance(spec, dict):
            unknown = set(spec) - set(DYNAMIC_DEFAULTS)
            if unknown:
                raise ValueError(f"loss_scale: unknown key(s) {sorted(unknown)}; "
                                 f"valid keys: {sorted(DYNAMIC_DEFAULTS)}")
            for k, v in spec.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                    raise ValueError(f"loss_scale.{k}: expected a positive number, got {v!r}")
            if "growth_interval" in spec and not isinstance(spec["growth_interval"], int):
                raise ValueError(f"loss_scale.growth_interval: expected an int, got {spec['growth_interval']!r}")
            if spec.get("backoff_factor", 0.5) >= 1 or spec.get("growth_factor", 2.0) <= 1:
                raise ValueError("loss_scale: backoff_factor must be < 1 and growth_factor > 1")
            return dict(spec)
        if isinstance(spec, bool) or not isinstance(spec, (int, float)):
            raise TypeError(f"loss_scale: expected 'dynamic', 'auto', a number, a dict or None, got {spec!r}")
        if not spec > 0 or spec == float("inf"):
            raise ValueError(f"loss_scale: a static scale must be positive and finite, got {spec}")
        return float(spec)

    @property
    def loss_scaler_spec(self):
        """The loss scale this config resolves to: a dict of dynamic rules, a float, or None."""
        spec = self.loss_scale
        if spec == "auto":
            spec = "dynamic" if self.dtype == "fp16" else None
        return dict(DYNAMIC_DEFAULTS) if spec == "dynamic" else spec

    @staticmethod
    def _check_device(device) -> str:
        if not isinstance(device, str):
            raise TypeError(f"device: expected a string ('auto', 'cpu', 'cuda', 'cuda:N'), got {device!r}")
        if device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
            raise ValueError(f"device: {device!r} is not one of auto, cpu, cuda, cuda:N (N: a GPU's index)")
        return device

    @staticmethod
    def _check_optimizer(opt) -> dict:
        if not isinstance(opt, dict):
            raise TypeError(f"optimizer: expected a dict with keys {sorted(_OPTIMIZER_DEFAULTS)}, got {opt!r}")
        unknown = set(opt) - set(_OPTIMIZER_DEFAULTS)
        if unknown:
            raise ValueError(f"optimizer: unknown key(s) {sorted(unknown)}; valid keys: {sorted(_OPTIMIZER_DEFAULTS)}")
        kind = opt.get("type", "adamw")
        _choice("optimizer.type", kind, OPTIMIZERS)
        out = dict(_OPTIMIZER_DEFAULTS, weight_decay=0.01 if kind == "adamw" else 0.0)
        out.update(opt)
        for key in ("lr", "eps", "weight_decay"):
            v = out[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"optimizer.{key}: expected a number, got {v!r}")
            if v < 0 or (key == "eps" and v == 0):
                raise ValueError(f"optimizer.{key}: must be {'> 0' if key == 'eps' else '>= 0'}, got {v}")
            out[key] = float(v)
        betas = out["betas"]
        if (not isinstance(betas, (list, tuple)) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)):
            raise TypeError(f"optimizer.betas: expected two numbers, got {betas!r}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"optimizer.betas: each must be in [0, 1), got {betas!r}")
        out["betas"] = (float(betas[0]), float(betas[1]))
        return out

    @property
    def moment_dtype(self) -> torch.dtype:
        """The dtype of the moments' chunk tensors (int8: their codes, uint8)."""
        return MOMENT_DTYPES[self.optimizer_state]

    @property
    def moments_undoable(self) -> bool:
        """An update of these moments can be undone (fp32); bf16 rounds them and int8 quantizes them."""
        return self.optimizer_state == "fp32"

    @property
    def verdict_changes_updates(self) -> bool:
        """Whether a step's verdict can change its updates, not only forbid them: clipping, loss scaling, or
        moments that cannot be undone. Without any, "two_pass" has nothing to measure and runs one pass."""
        return self.grad_clip is not None or self.loss_scaler_spec is not None or not self.moments_undoable

    @property
    def state_bytes_per_param(self) -> float:
        """Chunk state per parameter: the fp32 master + the two moments (int8: + their two fp32 scales per
        block of quant8.BLOCK_ELEMS elements: 6.03). An average: `chunk_state_bytes` counts a chunk exactly."""
        if self.optimizer_state == "int8":
            return 4 + 2 + 8 / quant8.BLOCK_ELEMS
        return 4 + 2 * self.moment_dtype.itemsize

    def chunk_state_bytes(self, chunk_elems: int, scale_blocks: int = 0) -> int:
        """One chunk's state: master and moments of `chunk_elems` elements, and (int8) the scales of
        `scale_blocks` quantization blocks per moment (each parameter's own blocks, the last one short)."""
        scales = 2 * 4 * scale_blocks if self.optimizer_state == "int8" else 0
        return chunk_elems * (4 + 2 * self.moment_dtype.itemsize) + scales

    @property
    def compiles_compute(self) -> bool:
        """The compute between chunk nodes is compiled by Inductor (`compute`, "auto" resolved)."""
        return self.compute == "inductor" or (self.compute == "auto" and self.device.startswith("cuda"))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        if not isinstance(d, dict):
            raise TypeError(f"Config.from_dict: expected a dict, got {type(d).__name__}")
        message = unknown_keys_message(d)
        if message:
            raise ValueError(message)
        return cls(**d)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Config":
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"Config file {path}: not valid JSON ({e})") from None
        return cls.from_dict(d)

    @classmethod
    def coerce(cls, config: "Config | dict | str | os.PathLike | None") -> "Config":
        """Accept a Config, a dict, a JSON file path, or None (all defaults)."""
        if config is None:
            return cls()
        if isinstance(config, Config):
            return config
        if isinstance(config, dict):
            return cls.from_dict(config)
        if isinstance(config, (str, os.PathLike)):
            return cls.from_file(config)
        raise TypeError(f"config: expected a pstar_fx.Config, a dict or a JSON file path, got {type(config).__name__}")


def unknown_keys_message(keys) -> str | None:
    """What is wrong with `keys` that are not Config fields: each with the nearest valid key where one is close
    (a typo), and the valid keys; None when all are valid."""
    valid = [f.name for f in dataclasses.fields(Config)]
    unknown = [k for k in keys if k not in valid]
    if not unknown:
        return None
    near = {k: difflib.get_close_matches(str(k), valid, n=1) for k in unknown}
    hints = "; ".join(f"{k!r}: did you mean {m[0]}?" for k, m in near.items() if m)
    return f"Config: unknown key(s) {unknown}" + (f" ({hints})" if hints else "") + f"; valid keys: {valid}"


_dataclass_init = Config.__init__


@functools.wraps(_dataclass_init)
def _init_naming_unknown_keys(self, *args, **kwargs):
    # the dataclass's own __init__ says only "unexpected keyword argument": name the nearest field, as a
    # JSON config with the same typo does
    message = unknown_keys_message(kwargs)
    if message:
        raise TypeError(message)
    _dataclass_init(self, *args, **kwargs)


Config.__init__ = _init_naming_unknown_keys


def _choice(key: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{key}: {value!r} is not one of {list(choices)}")
