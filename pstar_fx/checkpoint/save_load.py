"""checkpoint: save and load an engine by parameter name, streamed, written beside the target and renamed.

A checkpoint is a directory:

  model.safetensors (or model-0000K-of-0000N.safetensors + model.safetensors.index.json, as save_pretrained
                     shards them)  fp32 weights (or bf16 for export) under the model's own names; a tied weight
                     once, under its first name; persistent buffers (BatchNorm statistics) under theirs
  optimizer.safetensors           "<name>.exp_avg" and "<name>.exp_avg_sq" of every trained parameter, fp32 in
                                  every optimizer_state (bf16 widened, int8 dequantized); with int8 moments also
                                  "<name>.exp_avg.codes" (U8, the parameter's shape) and "<name>.exp_avg.absmax"
                                  (F32, one scale per 256 elements), and the same for exp_avg_sq: what the chunks
                                  hold (kernels/quant8.py), so an int8 engine resumes bit for bit (quantizing the
                                  fp32 values again would not give the same codes: the maps have no -1). An int8
                                  checkpoint's moments take 10.06 B/param on disk, fp32's and bf16's 8
  pstar_fx_state.json             step, loss scale, the last clip coefficient, the optimizer and schedule
                                  config, the RNG state, the package version
  config.json                     a Hugging Face model's config, so `from_pretrained(path)` loads the weights

It speaks parameter names, never chunk ids, so it loads at another budget, chunk size or placement (int8 moments
are quantized per parameter, so their codes and scales do not depend on the chunks either), and in another
optimizer_state: fp32 moments load rounded into bf16 and quantized into int8. Files are
written one tensor at a time from whichever tier holds it (a GPU tensor in 64 MiB blocks through two page-locked
buffers, the copy of one overlapping the disk's write of the other: extra host memory 128 MiB), in the safetensors
format (an 8-byte header length, a JSON header of names, dtypes, shapes and offsets, then the bytes), into a
directory beside the target that is renamed into place once every file is synced: a crash mid-save leaves
the previous checkpoint whole. A folder of safetensors weights alone (e.g. from `save_pretrained`) loads too,
with zeroed moments and step 0.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch

from ..kernels import quant8

MOMENTS = ("exp_avg", "exp_avg_sq")
WEIGHTS, INDEX, OPTIMIZER, STATE = "model.safetensors", "model.safetensors.index.json", "optimizer.safetensors", \
    "pstar_fx_state.json"
OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
           torch.int32: "I32", torch.bool: "BOOL", torch.uint8: "U8", torch.float64: "F64", torch.int16: "I16",
           torch.int8: "I8"}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}
SHARD_BYTES = 5 * 10**9          # save_pretrained's default max_shard_size


class CheckpointError(ValueError):
    """A path that is not a checkpoint, or one that does not match this engine; the engine is unchanged."""


def _nbytes(entry) -> int:
    """Bytes of an entry (name, dtype, shape, produce)."""
    return entry[1].itemsize * int(torch.Size(entry[2]).numel())


BLOCK_BYTES = 64 * 2**20        # a tensor crosses between the GPU and the disk in blocks of this size


class _Blocks:
    """Two page-locked host blocks and a copy stream: a GPU tensor's bytes move to or from the disk a block at
    a time, the copy of one block overlapping the disk's work on the other. Host memory: 2 blocks, whatever
    the tensor's size (a tensor on the host is read or written in place)."""

    def __init__(self):
        self.bufs: list[torch.Tensor] = []
        self.done: list = [None, None]
        self.stream = None

    def _ready(self, device: torch.device) -> None:
        if not self.bufs:
            self.bufs = [torch.empty(BLOCK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self.stream = torch.cuda.Stream(device)

    def write(self, f, t: torch.Tensor, dtype: torch.dtype) -> None:
        """t's elements as `dtype`, appended to file f."""
        if t.device.type != "cuda":
            t = t.detach().to(dtype).contiguous()            # no copy for an fp32 master on the host
            _write_all(f, memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            return
        self._ready(t.device)
        flat = t.detach().reshape(-1)
        per = BLOCK_BYTES // dtype.itemsize
        self.stream.wait_stream(torch.cuda.current_stream(t.device))     # t's last writer has finished
        pending = None
        for k, start in enumerate(range(0, flat.numel(), per)):
            part = flat[start:start + per]
            buf = self.bufs[k % 2][: part.numel() * dtype.itemsize]
            with torch.cuda.stream(self.stream):
                buf.view(dtype).copy_(part.to(dtype), non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            if pending is not None:                          # the disk writes block k-1 while block k copies
                pending[1].synchronize()
                _write_all(f, memoryview(pending[0].numpy()))
            pending = (buf, ev)
        if pending is not None:
            pending[1].synchronize()
            _write_all(f, memoryview(pending[0].numpy()))

    def read(self, f, target: torch.Tensor, dtype: torch.dtype) -> None:
        """target <- the next target.numel() elements of file f, stored as `dtype`."""
        if target.device.type != "cuda":
            direct = target.dtype == dtype and target.is_contiguous()
            buf = target if direct else torch.empty(target.shape, dtype=dtype)   # one tensor, no more
            _read_all(f, memoryview(buf.reshape(-1).view(torch.uint8).numpy()))
            if not direct:
                target.copy_(buf)
            return
        self._ready(target.device)
        flat = target.view(-1) if target.is_contiguous() else torch.empty(target.numel(), dtype=target.dtype,
                                                                           device=target.device)
        per = BLOCK_BYTES // dtype.itemsize
        self.stream.wait_stream(torch.cuda.current_stream(target.device))   # nobody reads target meanwhile
        for k, start in enumerate(range(0, flat.numel(), per)):
            part = flat[start:start + per]
            buf = self.bufs[k % 2][: part.numel() * dtype.itemsize]
            if self.done[k % 2] is not None:
                self.done[k % 2].synchronize()               # the copy out of this block two steps ago
            _read_all(f, memoryview(buf.numpy()))            # the disk reads block k while block k-1 copies
            with torch.cuda.stream(self.stream):
                part.copy_(buf.view(dtype), non_blocking=True)
                self.done[k % 2] = torch.cuda.Event()
                self.done[k % 2].record(self.stream)
        torch.cuda.current_stream(target.device).wait_stream(self.stream)
        self.stream.synchronize()
        if flat.data_ptr() != target.data_ptr():
            target.copy_(flat.view(target.shape))


def _write_all(f, view: memoryview) -> None:
    for start in range(0, len(view), BLOCK_BYTES):           # large single writes are slow on some kernels
        f.write(view[start:start + BLOCK_BYTES])


def _read_all(f, view: memoryview) -> None:
    done = 0
    while done < len(view):
        k = f.readinto(view[done:done + BLOCK_BYTES])
        if not k:
            raise CheckpointError(f"{f.name}: ends inside a tensor")
        done += k


def write_safetensors(path: Path, entries: list[tuple[str, torch.dtype, tuple, object]], metadata: dict,
                      blocks: _Blocks | None = None) -> None:
    """Write tensors to `path` one at a time: `entries` are (name, dtype, shape, produce) with produce() giving
    the tensor (on any tier) only when its bytes are due; a GPU tensor crosses in blocks (`_Blocks`)."""
    blocks = blocks or _Blocks()
    header, offset = {}, 0
    for entry in entries:
        name, dtype, shape, _ = entry
        n = _nbytes(entry)
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)                  # the data section starts 8-byte aligned
    with open(path, "wb", buffering=0) as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, dtype, shape, produce in entries:
            t = produce()
            if tuple(t.shape) != tuple(shape):
                raise RuntimeError(f"{name}: produced shape {tuple(t.shape)}, header says {tuple(shape)}")
            if t.numel():
                blocks.write(f, t, dtype)
        os.fsync(f.fileno())


def _shards(entries, max_bytes: int) -> list[list]:
    shards, size = [[]], 0
    for e in entries:
        n = _nbytes(e)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    return shards


def _entries(engine, rank: int | None, wdtype: torch.dtype) -> tuple[list, list]:
    """(weights, moments) entries of the parameters whose chunks `rank` owns (None: all), the buffers with
    rank 0's (or all) weights. Only the caller's own entries are ever produced."""
    store, cap, plan = engine.rt.store, engine.lowered.capture, engine.lowered.plan
    layout = engine.lowered.layout
    mine = [i for i in range(len(cap.params)) if rank is None or plan.owner(layout.slots[i].chunk) == rank]
    weights = [(cap.params[i].name, wdtype, tuple(cap.params[i].shape), lambda i=i: store.param_fp32(i))
               for i in mine]
    if rank in (None, 0):
        weights += [(name, b.dtype, tuple(b.shape), lambda b=b: b) for name, b in engine.persistent_buffers().items()]
    moments = []
    for i in mine:
        p = cap.params[i]
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


def _sharded(per_rank: list[list], max_bytes: int, stem: str) -> list[list[tuple[str, list]]]:
    """Per rank, its (file name, entries) shards, numbered across every rank's as save_pretrained names them."""
    shards = [_shards(entries, max_bytes) if entries else [] for entries in per_rank]
    total = sum(len(x) for x in shards)
    out, k = [], 0
    for rank_shards in shards:
        named = []
        for shard in rank_shards:
            k += 1
            named.append((f"{stem}.safetensors" if total == 1 else f"{stem}-{k:05d}-of-{total:05d}.safetensors", shard))
        out.append(named)
    return out


def save(engine, path, *, dtype: str = "fp32", max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Write a checkpoint. With chunks partitioned over data-parallel ranks every rank calls it and writes the
    shards of the chunks it owns, in parallel, into one directory (on a file system the ranks share); rank 0
    writes the indexes and the loop state and renames the directory into place once every rank has synced."""
    from .. import __version__
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype: {dtype!r} is not one of ['fp32', 'bf16']")
    engine.drain()
    path = Path(path)
    dp = engine.dp if engine.dp is not None and engine.dp.chunked else None
    rank, world = (dp.rank, dp.world) if dp else (0, 1)
    wdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    ranks = [_entries(engine, r if dp else None, wdtype) for r in range(world)]
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
    tmp = parent / (f".{path.name}.tmp-{os.getpid()}" if not dp else f".{path.name}.tmp-{world}ranks")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _agree(dp, "")
    try:
        meta = {"format": "pt", "pstar_fx": __version__}
        blocks = _Blocks()
        for name, shard in weight_files[rank] + moment_files[rank]:
            write_safetensors(tmp / name, shard, meta, blocks)
        if rank == 0:
            for files, index_name in ((weight_files, INDEX), (moment_files, OPTIMIZER_INDEX)):
                every = [(name, shard) for per in files for name, shard in per]
                if len(every) > 1:
                    _write_json(tmp / index_name, {
                        "metadata": {"total_size": sum(_nbytes(e) for _, shard in every for e in shard)},
                        "weight_map": {e[0]: name for name, shard in every for e in shard}})
            hf_config = getattr(engine._skeleton, "config", None)
            if hasattr(hf_config, "to_json_file"):        # a Hugging Face model: from_pretrained(path) reads it back
                hf_config.to_json_file(tmp / "config.json")
            _write_json(tmp / STATE, engine.stepper.state_dict() | {
                "pstar_fx": __version__, "weights_dtype": dtype, "world_size": world,
                "optimizer": {k: list(v) if isinstance(v, tuple) else v for k, v in engine.config.optimizer.items()},
                "lr_schedule": engine.config.lr_schedule if not callable(engine.config.lr_schedule) else "callable",
                "rng": torch.get_rng_state().tolist()})
    except BaseException as e:
        _agree(dp, f"rank {rank}: {type(e).__name__}: {e}", fail_quietly=True)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _agree(dp, "")                                # every rank's shards are written and synced
    except RuntimeError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    problem, error = "", None
    if rank == 0:
        try:
            _fsync_dir(tmp)
            old = parent / f".{path.name}.old-{os.getpid()}"
            if path.exists():
                path.rename(old)                      # the previous checkpoint stays whole under this name ...
            tmp.rename(path)                          # ... until the new one is in place
            _fsync_dir(parent)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if dp is None:
                raise
            problem, error = f"rank 0 could not put the checkpoint in place: {type(e).__name__}: {e}", e
    try:
        _agree(dp, problem)
    except RuntimeError as e:
        raise e from error
    return path


def _agree(dp, problem: str, error=RuntimeError, fail_quietly: bool = False) -> None:
    """Every rank learns whether any rank has a problem (one all-reduce), and all raise together: a rank that
    failed alone would leave the others waiting in the next collective. Without ranks: raise `problem`."""
    if dp is None:
        if problem and not fail_quietly:
            raise error(problem)
        return
    import torch.distributed as dist
    flag = torch.tensor([1.0 if problem else 0.0], device=dp.scratch_device())
    dist.all_reduce(flag)
    if fail_quietly:
        return
    if problem:
        raise error(problem)
    if flag.item():
        raise RuntimeError("another rank could not save its part of the checkpoint (its error says why); the "
                           "previous checkpoint, if any, is unchanged")


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _recover(path: Path) -> Path:
    """A save that died between its two renames left the previous checkpoint beside the target."""
    if path.exists():
        return path
    olds = sorted(path.absolute().parent.glob(f".{path.name}.old-*"))
    if olds:
        return olds[-1]
    raise CheckpointError(f"{path}: no such checkpoint")


def _weight_files(path: Path, index: str = INDEX, single: str = WEIGHTS, required: bool = True) -> list[Path]:
    """The files of the weights (or, with OPTIMIZER_INDEX and OPTIMIZER, of the moments): an index's shards or
    the single file."""
    if (path / index).exists():
        with open(path / index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [name for name in files if not (path / name).exists()]
        if missing:
            raise CheckpointError(f"{path}: shard(s) {missing} named in {index} are missing")
        return [path / name for name in files]
    if (path / single).exists():
        return [path / single]
    if not required:
        return []
    raise CheckpointError(f"{path} is not a checkpoint: it has neither {single} nor {index}")


def _open(files: list[Path]) -> dict[str, tuple]:
    """name -> (file, header entry) over the files, each header read and checked against the file's size."""
    out = {}
    for file in files:
        try:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > 100 * 2**20:
                    raise ValueError(f"header length {n}")
                header = json.loads(f.read(n))
            start = 8 + n
            size = file.stat().st_size
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                a, b = entry["data_offsets"]
                dtype = _FROM_NAME[entry["dtype"]]
                numel = int(torch.Size(entry["shape"]).numel())
                if b - a != numel * dtype.itemsize or start + b > size:
                    raise ValueError(f"{key}: bytes [{a}, {b}) do not fit the file ({size - start} data bytes)")
                out[key] = (file, start + a, dtype, tuple(entry["shape"]))
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:  # truncated or foreign: say which
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e
    return out


class _File:
    """A tensor in a safetensors file, read only when applied, straight into its target (`_Blocks.read`)."""

    def __init__(self, file: Path, offset: int, dtype: torch.dtype, shape: tuple):
        self.file, self.offset, self.dtype, self._shape = file, offset, dtype, shape

    def shape(self) -> tuple:
        return self._shape

    def read_into(self, target: torch.Tensor, blocks: _Blocks) -> None:
        with open(self.file, "rb", buffering=0) as f:
            f.seek(self.offset)
            blocks.read(f, target, self.dtype)


class _Mem:
    """A tensor already in memory (load_state_dict)."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def shape(self) -> tuple:
        return tuple(self.t.shape)

    def read_into(self, target: torch.Tensor, blocks=None) -> None:
        target.copy_(self.t)


def load(engine, path, *, strict: bool = True) -> None:
    """Weights (and, when present, optimizer and loop state) into the engine, by name. Everything is checked
    before anything changes: names, shapes, the optimizer type."""
    path = _recover(Path(path))
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory")
    engine.drain()
    weights = {k: _File(*v) for k, v in _open(_weight_files(path)).items()}
    moment_files = _weight_files(path, OPTIMIZER_INDEX, OPTIMIZER, required=False)
    moments = {k: _File(*v) for k, v in _open(moment_files).items()}
    state = None
    if (path / STATE).exists():
        with open(path / STATE) as f:
            state = json.load(f)
        kind = state.get("optimizer", {}).get("type")
        if kind is not None and kind != engine.config.optimizer["type"]:
            raise CheckpointError(f"{path}: saved with optimizer type {kind!r}, this engine uses "
                                  f"{engine.config.optimizer['type']!r}")
    apply(engine, weights, moments, strict=strict, where=str(path))
    engine.stepper.load_state_dict(state if (state and moments) else None)
    if state and "rng" in state:
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))


def load_state_dict(engine, sd: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """fp32 weights and buffers by name into chunk memory, as nn.Module.load_state_dict (moments untouched)."""
    engine.drain()
    apply(engine, {k: _Mem(v) for k, v in sd.items()}, None, strict=strict, where="state_dict")


def apply(engine, weights: dict, moments: dict | None, *, strict: bool, where: str) -> None:
    """Check every name and shape, then write. `moments` None: leave the optimizer state; {}: zero it."""
    cap, store = engine.lowered.capture, engine.rt.store
    held = [store.holds(s.chunk) for s in engine.lowered.layout.slots]   # chunk-partitioned: this rank's own
    buffers = engine.persistent_buffers()
    todo, found, problems = [], [], []               # found: (name, shape) of every entry, held here or not
    for i, p in enumerate(cap.params):
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
    known = {a for p in cap.params for a in p.aliases} | set(buffers)
    problems += [f"unexpected {k}" for k in weights if k not in known]
    problems += [f"{name}: shape {weights[name].shape()} given, {shape} in the model" for name, shape in found
                 if weights[name].shape() != shape]
    if moments:
        for p in cap.params:
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
            for i, p in enumerate(cap.params):
                if held[i]:
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
