"""save, load and load_state_dict: a checkpoint directory written from the parts an owner hands over (`Parts`),
through the safetensors files (`safetensors`), replaced whole (`atomic`), and read back by name (`state`).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .atomic import _agree, _recover, _write_json, replacing
from .safetensors import (INDEX, OPTIMIZER, OPTIMIZER_INDEX, SHARD_BYTES, STATE, CheckpointError, _Blocks, _File,
                          _Mem, _nbytes, _open, _sharded, _weight_files, read_json, write_safetensors)
from .adapters import ADAPTER_WEIGHTS
from .state import Parts, _entries, apply


def _parts(owner) -> Parts:
    """The parts themselves, or an engine's (tests and scripts call `save(engine, path)`): asked in this one place."""
    return owner if isinstance(owner, Parts) else owner._checkpoint_parts()


def save(parts: Parts, path, *, dtype: str = "fp32", max_shard_bytes: int = SHARD_BYTES, full: bool = False) -> Path:
    """Write a checkpoint of `parts`. With chunks partitioned over data-parallel ranks every rank calls it and
    writes the shards of the chunks it owns, in parallel, into one directory (on a file system the ranks share);
    rank 0 writes the indexes and the loop state and renames the directory into place once every rank has synced.
    A `peft` model (`parts.adapter`) writes its adapter as peft does (adapter_model.safetensors, adapter_config.json)
    in place of the weights; `full`: the whole model's weights as well."""
    from .. import __version__
    parts = _parts(parts)
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype: {dtype!r} is not one of ['fp32', 'bf16']")
    parts.drain()
    path = Path(path)
    dp = parts.dp if parts.dp is not None and parts.dp.chunked else None
    rank, world = (dp.rank, dp.world) if dp else (0, 1)
    wdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    ranks = [_entries(parts, r if dp else None, wdtype) for r in range(world)]
    adapter = parts.adapter
    if adapter is not None and dp:
        raise NotImplementedError("saving a peft adapter with chunks partitioned over data-parallel ranks is not "
                                  "supported yet; train it with replicated data parallelism or on one rank")
    if adapter is not None:
        # the adapter's trained weights under peft's keys, from the same entries a whole save writes
        adapter_entries = [(adapter.keys[name], *rest) for name, *rest in ranks[0][0] if name in adapter.keys]
        if not full:
            ranks = [([], moments) for _, moments in ranks]
    weight_files = _sharded([w for w, _ in ranks], max_shard_bytes, "model")
    moment_files = _sharded([m for _, m in ranks], max_shard_bytes, "optimizer")
    if not dp:
        moment_files = [[(OPTIMIZER, [e for _, shard in moment_files[0] for e in shard])]]
    weights, moments = ranks[rank]
    need = sum(_nbytes(e) for e in weights + moments) + 2**20
    parent = path.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    problem = (f"not enough disk for a checkpoint at {path}: it needs {need / 2**30:.2f} GiB"
               + (f" on rank {rank}" if dp else "") + f", {free / 2**30:.2f} GiB free; nothing was written"
               if need > free else "")
    _agree(dp, problem, OSError)
    with replacing(path, dp) as tmp:
        meta = {"format": "pt", "pstar_fx": __version__}
        blocks = _Blocks()
        for name, shard in weight_files[rank] + moment_files[rank]:
            write_safetensors(tmp / name, shard, meta, blocks)
        if adapter is not None:
            write_safetensors(tmp / ADAPTER_WEIGHTS, adapter_entries, {"format": "pt"}, blocks)
            adapter.write_config(tmp)
        if rank == 0:
            for files, index_name in ((weight_files, INDEX), (moment_files, OPTIMIZER_INDEX)):
                every = [(name, shard) for per in files for name, shard in per]
                if len(every) > 1:
                    _write_json(tmp / index_name, {
                        "metadata": {"total_size": sum(_nbytes(e) for _, shard in every for e in shard)},
                        "weight_map": {e[0]: name for name, shard in every for e in shard}})
            # a Hugging Face model: from_pretrained(path) reads it back (not beside an adapter alone: its folder is
            # no model's)
            if hasattr(parts.hf_config, "to_json_file") and (adapter is None or full):
                parts.hf_config.to_json_file(tmp / "config.json")
            _write_json(tmp / STATE, parts.loop_state() | {
                "pstar_fx": __version__, "weights_dtype": dtype, "world_size": world,
                "optimizer": {k: list(v) if isinstance(v, tuple) else v for k, v in parts.optimizer.items()},
                "lr_schedule": parts.lr_schedule if not callable(parts.lr_schedule) else "callable",
                "rng": torch.get_rng_state().tolist()})
    return path


def load(parts: Parts, path, *, strict: bool = True) -> None:
    """Weights (and, when present, optimizer and loop state) into `parts`, by name. Everything is checked
    before anything changes: names, shapes, the optimizer type. A peft adapter's directory (adapter_model.safetensors
    without model weights) loads into a peft model's adapter; its frozen base weights stay as they are."""
    parts = _parts(parts)
    path = _recover(Path(path))
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory")
    parts.drain()
    adapter_only = (path / ADAPTER_WEIGHTS).exists() and not _weight_files(path, required=False)
    if adapter_only and parts.adapter is None:
        raise CheckpointError(f"{path} holds a peft adapter ({ADAPTER_WEIGHTS}) and no model weights: compile the "
                              "PeftModel it belongs to (peft.get_peft_model(base, its config)) to load it, or load "
                              "the base model's own checkpoint")
    if adapter_only:
        # peft's keys back to the model's names; every trained parameter must be there, the frozen ones stay
        names = {key: name for name, key in parts.adapter.keys.items()}
        saved = _open([path / ADAPTER_WEIGHTS])
        wrong = [k for k in saved if k not in names] + [f"missing {n}" for k, n in names.items() if k not in saved]
        if wrong:
            raise CheckpointError(f"{path / ADAPTER_WEIGHTS} does not match this model's adapter: {wrong[:10]}")
        weights = {names[k]: _File(*v) for k, v in saved.items()}
        strict = False
    else:
        weights = {k: _File(*v) for k, v in _open(_weight_files(path)).items()}
    moment_files = _weight_files(path, OPTIMIZER_INDEX, OPTIMIZER, required=False)
    moments = {k: _File(*v) for k, v in _open(moment_files).items()}
    state = None
    if (path / STATE).exists():
        state = read_json(path / STATE)
        if not isinstance(state, dict):
            raise CheckpointError(f"{path / STATE}: expected a JSON object, got {type(state).__name__}; nothing "
                                  "was loaded")
        kind = state.get("optimizer", {}).get("type")
        if kind is not None and kind != parts.optimizer["type"]:
            raise CheckpointError(f"{path}: saved with optimizer type {kind!r}, this engine uses "
                                  f"{parts.optimizer['type']!r}")
    apply(parts, weights, moments, strict=strict, where=str(path))
    parts.load_loop_state(state if (state and moments) else None)
    if state and "rng" in state:
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))


def load_state_dict(parts: Parts, sd: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """fp32 weights and buffers by name into chunk memory, as nn.Module.load_state_dict (moments untouched)."""
    parts = _parts(parts)
    parts.drain()
    apply(parts, {k: _Mem(v) for k, v in sd.items()}, None, strict=strict, where="state_dict")

