"""data: a byte-level token set every machine has, the Python standard library's own source.

Tokens are bytes (vocabulary 256, which the "tiny" and "small" models use), read from the stdlib's
top-level `*.py` files in sorted order, so the same Python version gives the same tokens everywhere.
Nothing is downloaded. Batches are random windows drawn from a seeded generator: same seed, same batches.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Iterator

import torch

DEFAULT_MAX_BYTES = 4 * 2**20


def stdlib_tokens(max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """The stdlib's top-level `*.py` files, concatenated in name order and cut at `max_bytes`, as uint8 tokens."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes: expected a positive int, got {max_bytes!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no Python standard library sources (*.py) found in {root}; this Python ships "
                                "its stdlib compiled only, so there is no built-in text to train on")
    buf = bytearray()
    for f in files:
        buf += f.read_bytes()[: max_bytes - len(buf)]
        if len(buf) >= max_bytes:
            break
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


def batches(tokens: torch.Tensor, batch: int, seq: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (idx, tgt) pairs of int64 tensors shaped (batch, seq): random windows, tgt = idx shifted by one."""
    for key, v in (("batch", batch), ("seq", seq)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{key}: expected a positive int, got {v!r}")
    tokens = tokens.flatten()
    if tokens.numel() < seq + 1:
        raise ValueError(f"seq={seq} needs at least {seq + 1} tokens, got {tokens.numel()}")
    gen = torch.Generator().manual_seed(seed)
    window = torch.arange(seq + 1)
    while True:
        start = torch.randint(0, tokens.numel() - seq, (batch, 1), generator=gen)
        rows = tokens[start + window].long()   # (batch, seq + 1)
        yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
