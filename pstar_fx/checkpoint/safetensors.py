"""The safetensors files of a checkpoint: the format (an 8-byte header length, a JSON header of names, dtypes,
shapes and offsets, then the bytes, 8-byte aligned), written and read one tensor at a time, a GPU tensor crossing
in blocks (`_Blocks`), and split into shards numbered as `save_pretrained` numbers them. Nothing here knows an
engine: a file is a list of (name, dtype, shape, produce) entries.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

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


def read_json(file: Path):
    """A checkpoint's JSON file; a truncated or damaged one (a save killed while writing it, a bad copy) is a
    CheckpointError naming the file."""
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON, the file is truncated or damaged ({e}); nothing was "
                              "loaded") from e


def _weight_files(path: Path, index: str = INDEX, single: str = WEIGHTS, required: bool = True) -> list[Path]:
    """The files of the weights (or, with OPTIMIZER_INDEX and OPTIMIZER, of the moments): an index's shards or
    the single file."""
    if (path / index).exists():
        index_json = read_json(path / index)
        if not isinstance(index_json, dict) or not isinstance(index_json.get("weight_map"), dict):
            raise CheckpointError(f"{path / index}: no \"weight_map\" object: not a safetensors index")
        files = sorted(set(index_json["weight_map"].values()))
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

