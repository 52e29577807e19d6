"""data: tokens from a source, batches from tokens.

Sources (`read_tokens`):
    None         the Python standard library's top-level `*.py` files in name order (`stdlib_tokens`): a text
                 every machine has, the same tokens for the same Python version everywhere. Nothing is downloaded.
    FILE.bin     token ids as nanoGPT's prepare.py writes them: raw little-endian uint16 (the default) or uint32,
    FILE.dat     memory-mapped (numpy.memmap), never read whole; a size that is not a whole number of ids is an
                 error, and so is an id outside the model's vocabulary (`check_vocab`).
    FILE         any other file is UTF-8 text: bytes that are not UTF-8 are an error naming the file and offset
                 (binary data given as text would otherwise train silently as byte soup).
    DIR          every text file under DIR (`TEXT_SUFFIXES`, recursively, hidden names skipped) in sorted path
                 order, concatenated; with a tokenizer that has an end-of-text token, it separates the files.
Text becomes bytes (vocabulary 256) or, with a tokenizer (`load_tokenizer`: a local Hugging Face tokenizer
directory), its ids. `check_vocab` says which token does not fit a model's vocabulary; `held_out` splits off the
last 5%. Batches are random windows drawn from a seeded generator: same seed, same batches.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterator, Union

import numpy as np
import torch

DEFAULT_MAX_BYTES = 4 * 2**20
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")   # what a --data folder contributes; other files are skipped
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
TOKEN_SUFFIXES = (".bin", ".dat")                 # a --data file of raw token ids (nanoGPT's train.bin, a memmap)
HELD_OUT_FRACTION = 0.05
SCAN_ELEMS = 2**24                                # check_vocab reads a memory-mapped file this many tokens at a time

Tokens = Union[torch.Tensor, np.ndarray]         # 1-d; an np.memmap for token files


def stdlib_tokens(max_bytes: int = DEFAULT_MAX_BYTES, tokenizer=None) -> torch.Tensor:
    """The stdlib's top-level `*.py` files, concatenated in name order and cut at `max_bytes`, as uint8 tokens
    (or, with a tokenizer, that text's ids as int64)."""
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
    if tokenizer is not None:
        return _encode(tokenizer, [bytes(buf)])
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


def text_files(root: str | os.PathLike) -> list[Path]:
    """The text files (`TEXT_SUFFIXES`) under a folder, recursively, in sorted path order; hidden names skipped."""
    root = Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [Path(dirpath, f) for f in filenames if f.endswith(TEXT_SUFFIXES) and not f.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def read_tokens(path: str | os.PathLike | None, tokenizer=None, dtype: str = "uint16") -> Tokens:
    """The tokens of a source (the module docstring lists them): a 1-d uint8 tensor of bytes, an int64 tensor
    of a tokenizer's ids, or a memory-mapped array of a token file's ids. `dtype` is a token file's."""
    if path is None:
        return stdlib_tokens(tokenizer=tokenizer)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data: {path} does not exist")
    if path.is_dir():
        files = text_files(path)
        if not files:
            raise ValueError(f"data: no text files ({', '.join('*' + s for s in TEXT_SUFFIXES)}) under {path}")
    elif path.suffix in TOKEN_SUFFIXES:
        if tokenizer is not None:
            raise ValueError(f"data: {path} holds token ids already; a tokenizer applies to text only")
        return token_file(path, dtype)
    else:
        files = [path]
    texts = [_utf8(f) for f in files]
    if not any(texts):
        raise ValueError(f"data: {path} is empty" if path.is_file() else f"data: the text files under {path} are empty")
    if tokenizer is not None:
        return _encode(tokenizer, texts)
    return torch.frombuffer(bytearray(b"".join(texts)), dtype=torch.uint8)


def _utf8(path: Path) -> bytes:
    """A text file's bytes, checked to be UTF-8."""
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data: {path} is not UTF-8 text: byte {raw[e.start]:#04x} at offset {e.start:,} "
                         f"({e.reason}); a file of token ids is read as such when it is named *.bin or *.dat"
                         ) from None
    return raw


def token_file(path: str | os.PathLike, dtype: str = "uint16") -> np.memmap:
    """A file of raw token ids (nanoGPT's train.bin: np.uint16 in native order, little-endian everywhere we run),
    memory-mapped read-only: pages are read as batches touch them."""
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"data dtype {dtype!r}: choose from {', '.join(TOKEN_DTYPES)}")
    np_dtype = np.dtype(TOKEN_DTYPES[dtype])
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"data: {path} is empty")
    if size % np_dtype.itemsize:
        raise ValueError(f"data: {path} is {size:,} bytes, not a whole number of {dtype} tokens "
                         f"({np_dtype.itemsize} bytes each); is it a token file of another dtype?")
    return np.memmap(path, dtype=np_dtype, mode="r")


def load_tokenizer(path: str | os.PathLike):
    """A Hugging Face tokenizer from a local directory (`save_pretrained`'s files); never downloads."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer: {path} is not a directory (a tokenizer's save_pretrained folder)")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"tokenizer: cannot load a tokenizer from {path}: {' '.join(str(e).split())}") from None


def has_tokenizer(path: str | os.PathLike) -> bool:
    """Whether a model directory carries its own tokenizer files."""
    return any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                                                    "tokenizer.model"))


def _encode(tokenizer, texts: list[bytes]) -> torch.Tensor:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for i, text in enumerate(texts):
        if i and eos is not None:
            ids.append(eos)
        # the whole text at once: longer than the tokenizer's model_max_length by design (we cut windows)
        ids += tokenizer(text.decode("utf-8", errors="replace"), add_special_tokens=False, verbose=False)["input_ids"]
    if not ids:
        raise ValueError("data: the tokenizer made no tokens of the text")
    return torch.tensor(ids, dtype=torch.int64)


def vocab_size(tokenizer) -> int:
    """Ids a tokenizer can produce: its base vocabulary and added tokens (bytes: 256)."""
    return 256 if tokenizer is None else len(tokenizer)


def check_vocab(tokens: Tokens, vocab: int, what: str = "data") -> None:
    """A ValueError naming the first token id outside [0, vocab) and where it is; scans a memory-mapped file
    in pieces of SCAN_ELEMS so that it is never read whole."""
    n = len(tokens)
    for start in range(0, n, SCAN_ELEMS):
        piece = tokens[start:start + SCAN_ELEMS]
        piece = piece.numpy() if isinstance(piece, torch.Tensor) else np.asarray(piece)
        if piece.size and (int(piece.max()) >= vocab or int(piece.min()) < 0):
            at = int(np.flatnonzero((piece >= vocab) | (piece < 0))[0])
            raise ValueError(f"{what}: token {int(piece[at])} at position {start + at:,} is outside the model's "
                             f"vocabulary (vocab_size {vocab}); the data was made for a larger vocabulary "
                             "(another tokenizer, or a uint32 file read as uint16?)")


def held_out(tokens: Tokens, fraction: float = HELD_OUT_FRACTION) -> tuple[Tokens, Tokens]:
    """(train, held-out): the last `fraction` of the tokens kept apart for evaluation (views, nothing copied)."""
    cut = len(tokens) - int(len(tokens) * fraction)
    return tokens[:cut], tokens[cut:]


def batches(tokens: Tokens, batch: int, seq: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (idx, tgt) pairs of int64 tensors shaped (batch, seq): random windows, tgt = idx shifted by one.
    `tokens` is a 1-d tensor or numpy array (a memory-mapped file is read one window at a time)."""
    for key, v in (("batch", batch), ("seq", seq)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{key}: expected a positive int, got {v!r}")
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.flatten()
    n = len(tokens)
    if n < seq + 1:
        raise ValueError(f"seq={seq} needs at least {seq + 1} tokens, got {n}")
    gen = torch.Generator().manual_seed(seed)
    window = torch.arange(seq + 1)
    while True:
        start = torch.randint(0, n - seq, (batch, 1), generator=gen)
        at = start + window                                  # (batch, seq + 1)
        if isinstance(tokens, torch.Tensor):
            rows = tokens[at].long()
        else:
            rows = torch.from_numpy(tokens[at.numpy()].astype(np.int64))
        yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
