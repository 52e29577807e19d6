"""reserve_cache: the host buffers a compile zeroed and page-locked, remembered for the next compile of the same
model, inputs and config, so that its reserve (host_memory.HostReserve) starts making them before the capture
instead of after the plan.

On a warm second run of GPT3_18B (H200 box, bf16 moments), the capture, the cached plan, lowering and regions took
~9 s and only then did ~55 GB of host buffers begin to be zeroed and locked (8.9 s, the longest phase of that
compile). Those buffers are the plan's, and the plan is the same as last time: known before the capture, they are
ready by the time the store asks for them.

An entry is keyed by what can be read before the capture (`key`: the model's class, its parameters' and buffers'
names, shapes, dtypes and trainability, the inputs' shapes and dtypes, the config, the device and torch), and
holds the buffers' sizes (bytes, whether locked) and a digest of the plan they served (`plan_digest`: placement,
shipping and host bytes by kind). It is a guess, never trusted: the engine compares the digest with the plan it
made, and on a difference frees whatever the reserve made that nobody took, before the store allocates (the
host tier never holds a guess and the real buffers together). Files lie beside the plan cache
(`costs.cache_root()`), as reserve-v<FORMAT>-<key>.json; PSTAR_FX_PLAN_CACHE=0 switches this off with it, and
PSTAR_FX_RESERVE_CACHE=0 alone (an A/B of the head start against the host work it competes with).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os

import torch

from ..config import parse_flag
from ..planning.costs import cache_root, write_entry
from . import plan_cache

log = logging.getLogger("pstar_fx")

FORMAT = 1


def key(model: torch.nn.Module, example_inputs, config, device: torch.device) -> str:
    """sha256 over what the host buffers depend on that is known before the capture (the module docstring)."""
    h = hashlib.sha256()

    def put(*parts) -> None:
        for p in parts:
            h.update(str(p).encode())
            h.update(b"\x00")

    put("format", FORMAT, "torch", torch.__version__, "device", device, type(model).__module__,
        type(model).__qualname__)
    if device.type == "cuda" and torch.cuda.is_available():
        put(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)
    put("config", *(f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
                     if f.name not in plan_cache.NOT_PLANNED))     # (a schedule's repr may name its address)
    for name, p in model.named_parameters(remove_duplicate=False):
        put(name, tuple(p.shape), p.dtype, p.requires_grad)
    for name, b in model.named_buffers(remove_duplicate=False):
        put(name, tuple(b.shape), b.dtype)
    inputs = example_inputs.items() if isinstance(example_inputs, dict) else enumerate(
        example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,))
    for name, x in inputs:
        put(name, (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x))
    return h.hexdigest()[:40]


def plan_digest(plan) -> str:
    """What decides a plan's host buffers beyond the key: which chunks are on the host, how each crosses, and the
    host bytes the plan counts by kind (chunk state, shadows, staging, kept gradients)."""
    text = json.dumps([list(plan.placement), list(plan.ship), sorted(plan.host_breakdown.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class Remembered:
    plan: str                                   # plan_digest of the plan they served
    sizes: dict[tuple[int, bool], int]          # (bytes, page-locked) -> how many


def enabled() -> bool:
    return plan_cache.enabled() and parse_flag(os.environ.get("PSTAR_FX_RESERVE_CACHE", "1"),
                                               "PSTAR_FX_RESERVE_CACHE")


def _path(k: str) -> str:
    return os.path.join(cache_root(), f"reserve-v{FORMAT}-{k}.json")


def load(k: str) -> Remembered | None:
    """The buffers remembered under `k`, or None (none, off, or unreadable: a debug line, rewritten later)."""
    if not enabled():
        return None
    path = _path(k)
    try:
        with open(path) as f:
            entry = json.load(f)
        if entry.get("format") != FORMAT or entry.get("key") != k:
            return None
        sizes = {(int(n), bool(locked)): int(count) for n, locked, count in entry["buffers"]}
        if any(n <= 0 or count <= 0 for (n, _), count in sizes.items()):
            raise ValueError("a size or count that is not positive")
        return Remembered(str(entry["plan"]), sizes)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.debug("reserve cache: %s is unreadable (%s: %s); ignored", path, type(e).__name__, e)
        return None


def store(k: str, plan, sizes: dict[tuple[int, bool], int]) -> None:
    """Remember `sizes` for `k` (written aside, then renamed); a cache that cannot be written costs the next
    compile its head start, nothing more."""
    if not enabled() or not sizes:
        return
    path = _path(k)
    try:
        write_entry(path, {"format": FORMAT, "key": k, "plan": plan_digest(plan),
                           "buffers": [[n, locked, count] for (n, locked), count in sorted(sizes.items())]})
    except OSError as e:
        log.debug("reserve cache: could not write %s (%s)", path, e)
