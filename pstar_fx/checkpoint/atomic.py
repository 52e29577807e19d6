"""A checkpoint directory replaced whole or not at all: written into a directory beside the target, synced, then
renamed into place, the previous checkpoint kept under another name until the new one is there (a save that dies
between the two renames leaves it for `_recover`; what a killed save leaves behind, the next save into the same
folder removes: `_remove_stale`). With chunk-partitioned data parallelism every rank writes into
the same directory and they agree (`_agree`) at each step, so that all fail together rather than one hanging.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

import torch

from .safetensors import CheckpointError


@contextlib.contextmanager
def replacing(path: Path, dp):
    """A fresh directory beside `path` to write into; on leaving the block without an error, every rank's files
    are synced and rank 0 renames it to `path`. On an error anywhere it is removed and `path` is unchanged.
    `dp`: the chunk-partitioned ranks, or None (one writer)."""
    rank, world = (dp.rank, dp.world) if dp else (0, 1)
    parent = path.absolute().parent
    tmp = parent / (f".{path.name}.tmp-{os.getpid()}" if not dp else f".{path.name}.tmp-{world}ranks")
    if rank == 0:
        _remove_stale(parent)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _agree(dp, "")
    try:
        yield tmp
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
            _remove_stale(parent)                     # a dead save's previous checkpoint: this one replaces it
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if dp is None:
                raise
            problem, error = f"rank 0 could not put the checkpoint in place: {type(e).__name__}: {e}", e
    try:
        _agree(dp, problem)
    except RuntimeError as e:
        raise e from error


_LEFT_BY_A_SAVE = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)")


def _remove_stale(parent: Path) -> None:
    """Folders that saves killed mid-way left in `parent`, by a process that is no longer running (a live one's,
    another save in progress, are never touched): `.NAME.tmp-PID`, a partial write, is removed;
    `.NAME.old-PID`, the checkpoint NAME held before the killed save renamed it away, is removed once NAME is
    in place again (until then it is the newest whole checkpoint, which `_recover` loads)."""
    for entry in parent.iterdir():
        m = _LEFT_BY_A_SAVE.fullmatch(entry.name)
        if m is None or not entry.is_dir():
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or _running(pid):
            continue
        if m["kind"] == "old" and not (parent / m["name"]).exists():
            continue
        shutil.rmtree(entry, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)                               # signal 0: asks only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:                           # another user's process
        return True
    return True


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
