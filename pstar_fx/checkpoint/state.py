"""What a checkpoint holds of a trained model, and how it goes back: the `Parts` its owner hands over (never the
engine itself), the entries a save writes for a rank (`_entries`), and the checked load of weights, buffers and
moments into chunk memory (`apply`, `_load_moment`). Everything is by parameter name, never by chunk id.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

import torch

from ..kernels import quant8
from .safetensors import CheckpointError, _Blocks

if TYPE_CHECKING:
    from .adapters import Adapter
    from ..capture import ParamInfo
    from ..runtime.dist import DataParallel
    from ..runtime.store import ChunkStore

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Parts:
    """The stateful parts a checkpoint saves and loads, handed over by their owner (`Engine._checkpoint_parts`),
    as torchtitan hands its checkpointer `states={...}`."""
    store: ChunkStore
    """The chunks' fp32 masters and Adam moments, on whichever tier (or rank) holds them."""
    params: tuple[ParamInfo, ...]
    """The captured parameters in slot order: name, aliases (tied weights), shape, whether trained."""
    param_chunks: tuple[int, ...]
    """The chunk that holds each parameter (the layout's slots)."""
    owner: Callable[[int], int]
    """The rank that owns chunk c's state under chunk-partitioned data parallelism (the plan's placement)."""
    dp: DataParallel | None
    """The data-parallel ranks; with `dp.chunked` each rank writes the shards of the chunks it owns."""
    buffers: Mapping[str, torch.Tensor]
    """The persistent buffers (BatchNorm statistics) by name: saved beside the weights, loaded in place."""
    optimizer: Mapping
    """The optimizer's hyperparameters (`Config.optimizer`), recorded; a load checks its type."""
    lr_schedule: object
    """`Config.lr_schedule`, recorded ("callable" for a function)."""
    hf_config: object | None
    """A Hugging Face model's config, written as config.json so `from_pretrained(path)` reads the weights."""
    loop_state: Callable[[], dict]
    """The loop state to save (step, loss scale, last clip coefficient); asked for once the updates have landed."""
    load_loop_state: Callable[[dict | None], None]
    """Puts a saved loop state back; None: a fresh start."""
    drain: Callable[[], None]
    """Waits until every update of the last step has landed (host Adam may still be running)."""
    adapter: Adapter | None = None
    """A `peft` model's adapter: a save writes the adapter as peft does (adapters.py), not the frozen base weights."""


def _entries(parts: Parts, rank: int | None, wdtype: torch.dtype) -> tuple[list, list]:
    """(weights, moments) entries of the parameters whose chunks `rank` owns (None: all), the buffers with
    rank 0's (or all) weights. Only the caller's own entries are ever produced."""
    store, params = parts.store, parts.params
    mine = [i for i in range(len(params)) if rank is None or parts.owner(parts.param_chunks[i]) == rank]
    weights = [(params[i].name, wdtype, tuple(params[i].shape), lambda i=i: store.param_fp32(i))
               for i in mine]
    if rank in (None, 0):
        weights += [(name, b.dtype, tuple(b.shape), lambda b=b: b) for name, b in parts.buffers.items()]
    moments = []
    for i in mine:
        p = params[i]
        if not p.has_grad:
            continue
        for key in MOMENTS:
            if store.quantized:     # the values dequantized, then the codes and scales themselves
                moments += [(f"{p.name}.{key}", torch.float32, tuple(p.shape),
                             lambda i=i, key=key: store.moment_fp32(i, key)),
                            (f"{p.name}.{key}.codes", torch.uint8, tuple(p.shape),
                             lambda i=i, key=key: store.moment(i, key)),
                            (f"{p.name}.{key}.absmax", torch.float32, (quant8.blocks(p.numel),),
                             lambda i=i, key=key: store.moment_absmax(i, key))]
            else:                   # a bf16 moment widens to fp32 as it is written
                moments.append((f"{p.name}.{key}", torch.float32, tuple(p.shape),
                                lambda i=i, key=key: store.moment(i, key)))
    return weights, moments


def apply(parts: Parts, weights: dict, moments: dict | None, *, strict: bool, where: str) -> None:
    """Check every name and shape, then write. `moments` None: leave the optimizer state; {}: zero it."""
    params, store = parts.params, parts.store
    held = [store.holds(c) for c in parts.param_chunks]   # chunk-partitioned: this rank's own
    buffers = parts.buffers
    todo, found, problems = [], [], []               # found: (name, shape) of every entry, held here or not
    for i, p in enumerate(params):
        name = next((a for a in p.aliases if a in weights), None)
        if name is None:
            problems.append(f"missing {p.name}")
            continue
        found.append((name, tuple(p.shape)))
        if held[i]:
            todo.append((store.param_fp32(i), weights[name]))
    for name, b in buffers.items():
        if name in weights:
            found.append((name, tuple(b.shape)))
            todo.append((b, weights[name]))
        else:
            problems.append(f"missing buffer {name}")
    known = {a for p in params for a in p.aliases} | set(buffers)
    problems += [f"unexpected {k}" for k in weights if k not in known]
    problems += [f"{name}: shape {weights[name].shape()} given, {shape} in the model" for name, shape in found
                 if weights[name].shape() != shape]
    if moments:
        for p in params:
            if p.has_grad:
                for key in (f"{p.name}.exp_avg", f"{p.name}.exp_avg_sq"):
                    if key not in moments:
                        problems.append(f"missing optimizer state {key}")
                    elif moments[key].shape() != tuple(p.shape):
                        problems.append(f"{key}: shape {moments[key].shape()}, {tuple(p.shape)} in the model")
                    for raw, shape in ((f"{key}.codes", tuple(p.shape)), (f"{key}.absmax", (quant8.blocks(p.numel),))):
                        if raw in moments and moments[raw].shape() != shape:
                            problems.append(f"{raw}: shape {moments[raw].shape()}, {shape} for this parameter")
    fatal = [p for p in problems if strict or not p.startswith(("missing", "unexpected"))]
    if fatal:
        raise CheckpointError(f"{where} does not match this model ({len(fatal)} problem(s)): "
                              + "; ".join(fatal[:20]) + ("; ..." if len(fatal) > 20 else ""))
    blocks = _Blocks()
    with torch.no_grad():
        for target, src in todo:
            src.read_into(target, blocks)
        if moments is not None:
            for i, p in enumerate(params):
                if held[i] and p.has_grad:          # a frozen parameter has no moments (its chunk holds none)
                    for key in MOMENTS:
                        _load_moment(store, i, key, moments, f"{p.name}.{key}", blocks)
        store.masters_changed()


def _load_moment(store, i: int, key: str, moments: dict, name: str, blocks: _Blocks) -> None:
    """Parameter i's moment `key` from the checkpoint's `name` (absent: zero). fp32 and bf16 chunks read the fp32
    values (bf16 rounds them); int8 chunks read the codes and scales when the checkpoint has them (bit for bit),
    else quantize the fp32 values."""
    if name not in moments:
        store.set_moment(i, key, None)
    elif not store.quantized:
        moments[name].read_into(store.moment(i, key), blocks)
    elif f"{name}.codes" in moments and f"{name}.absmax" in moments:
        moments[f"{name}.codes"].read_into(store.moment(i, key), blocks)
        moments[f"{name}.absmax"].read_into(store.moment_absmax(i, key), blocks)
    else:
        values = torch.empty(moments[name].shape(), dtype=torch.float32, device=store.moment(i, key).device)
        moments[name].read_into(values, blocks)
        store.set_moment(i, key, values)
