"""weights: the model's weights into chunk memory and out of it — initialized on the meta device, broadcast from
rank 0, or gathered by chunk — and the meta skeleton kept to capture the model again. Each function is handed
the parts it works on (store, layout, capture, data-parallel group), never the engine.
"""
from __future__ import annotations

import copy
import logging
import time
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from ..phases import Phases
from .parallel_init import split_normal_draws

log = logging.getLogger("pstar_fx")

if TYPE_CHECKING:
    from ..capture import Capture
    from ..layout import Chunk, Layout
    from .dist import DataParallel
    from .store import ChunkStore


def skeleton(model: nn.Module) -> nn.Module:
    """The model's structure with meta tensors for its parameters and buffers (ties kept): enough to capture
    another graph of it later, without keeping its weights alive beside the chunks."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return copy.deepcopy(model, memo)


def materialize(model: nn.Module, store: ChunkStore, layout: Layout, cap: Capture, device: torch.device,
                generators: dict[torch.device, torch.Generator]) -> None:
    """A model built on the meta device gets its weights made directly in chunk memory: its parameters
    become views of the fp32 masters (on their tier), then its own init runs on them. The model is
    never whole in memory anywhere else, which is what lets a model larger than either tier start.
    The masters only: the caller refreshes their 16-bit copies (`store.masters_changed()`) once those are ready.
    Its random draws come from `generators` (parallel_init.own_generators: the global ones' states after
    `torch.manual_seed(seed)`), not the global ones, which another thread may be saving and restoring."""
    owner = {alias: i for i, p in enumerate(cap.params) for alias in p.aliases}
    # a parameter whose chunk another rank holds (chunk-partitioned) is initialized in a temporary on the
    # host and dropped: every rank runs the model's whole init alike, so the owners' values agree with it
    shared = [nn.Parameter(store.param_fp32(i) if store.holds(layout.slots[i].chunk)
                           else torch.empty(p.shape), requires_grad=p.requires_grad)
              for i, p in enumerate(cap.params)]
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            full = f"{mod_name}.{name}" if mod_name else name
            if p is not None and full in owner:
                mod._parameters[name] = shared[owner[full]]
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                mod._buffers[name] = torch.empty_like(b, device=device)
    total = sum(s.numel for s in layout.slots)
    shown = [-1]

    def progress(written: int) -> None:          # the status line's percent: sent when it changes
        pct = min(100, 100 * written // max(1, total))
        if pct != shown[0]:
            shown[0] = pct
            Phases.progress("initialize", min(written, total), total)

    # its normal_ draws on every host core, with one thread's bits (runtime/parallel_init.py)
    t0 = time.perf_counter()
    with torch.no_grad(), split_normal_draws(progress=progress, generators=generators):
        if hasattr(model, "init_weights"):
            model.init_weights()
        else:
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        _reset_lora_adapters(model)
    if store.device.type == "cuda":
        torch.cuda.synchronize(store.device)
    log.info("  initialize: the model's init %.1f s", time.perf_counter() - t0)


def _reset_lora_adapters(model: nn.Module) -> None:
    """A peft LoRA model's adapters get peft's own init (B zero, A Kaiming-uniform, or what the adapter's
    `init_lora_weights` says) after the base model's init, which treats their layers as plain Linear ones (a
    Hugging Face model's `init_weights` drew B from a normal: the adapted model no longer equalled its base at
    step 0). Other peft tuners keep the base model's init of their layers, and are said to."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return
    others = set()
    for m in model.modules():
        if not hasattr(m, "active_adapters") or not hasattr(m, "merged"):     # peft's BaseTunerLayer
            continue
        if not hasattr(m, "reset_lora_parameters"):
            others.add(type(m).__name__)
            continue
        for name in getattr(m, "lora_A", {}):
            m.reset_lora_parameters(name, getattr(configs.get(name), "init_lora_weights", True))
    if others:
        log.warning("peft adapter layers %s keep the base model's init of their weights (only LoRA's own init "
                    "is run on a model built on the meta device)", ", ".join(sorted(others)))


def masters_from_rank0(named: dict, store: ChunkStore, layout: Layout, cap: Capture, dp: DataParallel) -> None:
    """Chunk-partitioned: each chunk's master gets rank 0's weights of it (packed there from its model)."""
    where = dp.scratch_device()
    for ch in layout.chunks:
        tmp = torch.zeros(ch.used_elems, dtype=torch.float32, device=where)
        if dp.rank == 0:
            for s in ch.slots:
                tmp[s.offset: s.offset + s.numel].copy_(named[cap.params[s.index].name].detach().reshape(-1))
        dp.broadcast_(tmp, 0)
        if store.holds(ch.id):
            store.master[ch.id][: ch.used_elems].copy_(tmp)


def masters_by_chunk(store: ChunkStore, layout: Layout,
                     dp: DataParallel | None) -> Iterator[tuple[Chunk, torch.Tensor]]:
    """(chunk, its fp32 master) for every chunk, on every rank: a chunk another rank holds is broadcast from
    there into a temporary (a collective: every rank iterates to the end)."""
    for ch in layout.chunks:
        if dp is None or not dp.chunked:
            yield ch, store.master[ch.id][: ch.used_elems]
            continue
        tmp = torch.empty(ch.used_elems, dtype=torch.float32, device=dp.scratch_device())
        if store.holds(ch.id):
            tmp.copy_(store.master[ch.id][: ch.used_elems])
        dp.broadcast_(tmp, dp.owner(ch.id))
        yield ch, tmp
