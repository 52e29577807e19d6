"""quant8: the 8-bit blockwise format of Adam moments (Config optimizer_state="int8"), in plain torch.

A moment is stored as one uint8 code per element and one fp32 scale per block of BLOCK_ELEMS elements: the
block's largest |value| (its absmax). The value of code q in a block with scale s is map[q] * s, where map is
one of two fixed 256-entry "dynamic" maps (Dettmers et al., 8-bit optimizers via block-wise quantization,
2021; bitsandbytes' AdamW8bit and torchao's AdamW8bit use the same two): SIGNED_MAP for exp_avg, UNSIGNED_MAP
for exp_avg_sq (never negative, so all 256 codes go to [0, 1] and its fraction steps are twice as fine).

Why blocks of 256: bitsandbytes' current 8-bit optimizers and torchao both use 256 (the paper used 2048).
A scale costs 4 B per block per moment, 8/256 = 0.03 B/param for both (0.004 at 2048), and a smaller block
keeps an outlier from flattening many neighbours to zero: a block's elements below 2.75e-7 of its absmax
(signed map; 1.6e-7 unsigned) are stored as 0.

The dynamic map: a sign (signed map only), then the decimal exponent as a run of zero bits ended by a one,
then a linear fraction in the bits left. Decade k = 0..6 holds values 10^(k-6) * f, with f the midpoints of
2^k (signed) or 2^(k+1) (unsigned) equal steps of [0.1, 1]; with 0 and 1 that is 256 values each. The
smallest non-zero code is 5.5e-7 (signed) or 3.25e-7 (unsigned); the largest step, at the top decade, is
0.9/64 (signed) and 0.9/128 (unsigned) of the absmax, and it shrinks 5x per decade below: an element is stored
within half the step of its decade (`resolution`), about 2 significant digits at the top of a block.

Quantizing: x = value / absmax (IEEE division; 0 when the block is all zero), then q = the number of
THRESHOLDS below x, the thresholds being the midpoints of neighbouring map values (rounded to fp32): the
nearest map value, ties to the lower one. Every kernel (C++, Triton, this module) takes these same tables
and compares, so they agree bit for bit. The map has no -1: a block whose largest |value| is negative stores
it as map[0] = -0.99297 * absmax (half a step off, as bitsandbytes does).

Blocks start at the first element of the tensor quantized: the engine quantizes each parameter's moments by
itself (blocks never straddle two parameters), so they do not depend on the chunk layout and a checkpoint's
codes and scales load bit for bit at another chunk size.
"""
from __future__ import annotations

import functools

import torch

BLOCK_ELEMS = 256
MAP_SIZE = 256


def _dynamic_map(signed: bool) -> torch.Tensor:
    values = [0.0, 1.0]
    for k in range(7):
        steps = 2 ** k if signed else 2 ** (k + 1)
        edges = torch.linspace(0.1, 1.0, steps + 1, dtype=torch.float32)
        decade = (10.0 ** (k - 6)) * ((edges[:-1] + edges[1:]) / 2)      # fp32
        values += decade.tolist()
        if signed:
            values += (-decade).tolist()
    assert len(values) == MAP_SIZE
    return torch.tensor(sorted(values), dtype=torch.float32)


def _thresholds(code: torch.Tensor) -> torch.Tensor:
    """The midpoints of neighbouring map values (fp32), and +inf last: 256 entries, so an 8-step binary search
    over them needs no bounds check (the count of thresholds below a finite x is at most 255)."""
    mid = ((code[:-1].double() + code[1:].double()) / 2).float()
    return torch.cat([mid, torch.tensor([float("inf")])])


# The tables are CPU constants whatever default device the importer has set: a model built under
# `with torch.device("meta")` may import this module first (transformers probes for a package named `kernels`,
# which this folder is when a clone's root is on sys.path).
with torch.device("cpu"):
    SIGNED_MAP = _dynamic_map(signed=True)
    UNSIGNED_MAP = _dynamic_map(signed=False)
    SIGNED_THRESHOLDS = _thresholds(SIGNED_MAP)
    UNSIGNED_THRESHOLDS = _thresholds(UNSIGNED_MAP)


def _buckets(thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The code of x without a search, for the C++ kernel: x's float bits give its bucket (sign, exponent, the top
    BUCKET_MANTISSA_BITS of the mantissa; every |x| below 2^(BUCKET_MIN_EXP - 127) in one bucket, exponents above
    127 clamped), and each bucket holds at most one threshold, so the code is base[bucket] + (cut[bucket] < x):
    the same count of thresholds below x, from one comparison. (base, cut): int32 and fp32, two signs of
    BUCKETS_PER_SIGN each. Checked here for every bucket."""
    mant = 2 ** BUCKET_MANTISSA_BITS
    k = torch.arange(BUCKETS_PER_SIGN - 1, dtype=torch.int64)
    first = ((BUCKET_MIN_EXP + k // mant) << 23) | ((k % mant) << (23 - BUCKET_MANTISSA_BITS))
    last = first | ((1 << (23 - BUCKET_MANTISSA_BITS)) - 1)
    as_f32 = lambda bits: bits.to(torch.int32).view(torch.float32)  # noqa: E731
    lo = torch.cat([torch.zeros(1), as_f32(first)])                       # the magnitudes each bucket covers
    hi = torch.cat([as_f32(torch.tensor([(BUCKET_MIN_EXP << 23) - 1])), as_f32(last)])
    base, cut = [], []
    for smallest, largest in ((lo, hi), (-hi, -lo)):                     # x >= 0, then x < 0
        q_lo = torch.bucketize(smallest, thresholds, right=False)
        q_hi = torch.bucketize(largest, thresholds, right=False)
        assert int((q_hi - q_lo).max()) <= 1, "a bucket holds two thresholds: use more mantissa bits"
        base.append(q_lo.to(torch.int32))
        cut.append(thresholds[q_lo])
    return torch.cat(base), torch.cat(cut)


BUCKET_MIN_EXP, BUCKET_MANTISSA_BITS = 103, 7            # |x| < 2^-24 is one bucket; 128 buckets per octave above
BUCKETS_PER_SIGN = (127 - BUCKET_MIN_EXP + 1) * 2 ** BUCKET_MANTISSA_BITS + 1
with torch.device("cpu"):
    SIGNED_BUCKETS = _buckets(SIGNED_THRESHOLDS)
    UNSIGNED_BUCKETS = _buckets(UNSIGNED_THRESHOLDS)
# the code of 0: where a fresh moment starts (and what padding and frozen parameters keep)
SIGNED_ZERO = int((SIGNED_MAP == 0).nonzero())
UNSIGNED_ZERO = int((UNSIGNED_MAP == 0).nonzero())


def blocks(numel: int) -> int:
    """Scales of a tensor of `numel` elements: one per block, the last block possibly shorter."""
    return -(-numel // BLOCK_ELEMS)


def blocks_of(spans) -> int:
    """Scales of several (offset, numel) spans quantized each by itself, laid one after another."""
    return sum(blocks(n) for _, n in spans)


def tables(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(map, thresholds) of exp_avg (signed) or exp_avg_sq."""
    return (SIGNED_MAP, SIGNED_THRESHOLDS) if signed else (UNSIGNED_MAP, UNSIGNED_THRESHOLDS)


@functools.cache
def tables_on(device: torch.device) -> tuple[torch.Tensor, ...]:
    """The four tables (signed map, signed thresholds, unsigned map, unsigned thresholds) on `device`."""
    return tuple(t.to(device) for t in (SIGNED_MAP, SIGNED_THRESHOLDS, UNSIGNED_MAP, UNSIGNED_THRESHOLDS))


def cpu_tables() -> tuple[torch.Tensor, ...]:
    """What the C++ kernel reads: signed map, its bucket bases and cuts, unsigned map, its bases and cuts."""
    return (SIGNED_MAP, *SIGNED_BUCKETS, UNSIGNED_MAP, *UNSIGNED_BUCKETS)


def _per_block(x: torch.Tensor) -> torch.Tensor:
    """x (flat) as rows of BLOCK_ELEMS, the last one padded with zeros (which change no absmax)."""
    pad = blocks(x.numel()) * BLOCK_ELEMS - x.numel()
    return torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK_ELEMS)


def quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values (flat) -> (uint8 codes, fp32 absmax per block)."""
    code, thresholds = (t.to(x.device) for t in tables(signed))
    rows = _per_block(x.float())
    absmax = rows.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    # division in float64 rounded once: the IEEE fp32 quotient (53 >= 2 * 24 + 2 bits), as the kernels divide
    normal = torch.where(absmax[:, None] > 0, (rows.double() / safe[:, None].double()).float(), 0.0)
    codes = torch.bucketize(normal, thresholds, right=False)     # how many thresholds lie below x
    return codes.to(torch.uint8).reshape(-1)[: x.numel()], absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """(uint8 codes, fp32 absmax per block) -> fp32 values: map[code] * absmax of its block."""
    code = tables(signed)[0].to(codes.device)
    n = codes.numel()
    scale = absmax.repeat_interleave(BLOCK_ELEMS)[:n]
    return code[codes.long()] * scale


def resolution(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """Per element, how far from the value its code stands for the value it was quantized from can lie, as a
    fraction of its block's absmax: the farther end of the code's interval (t[q-1], t[q]] of normalized values
    (which lie in [-1, 1], or [0, 1] unsigned), plus 2^-23 for the rounding of the quotient and of the
    dequantizing product."""
    code, thresholds = tables(signed)
    lo = torch.cat([torch.tensor([-1.0 if signed else 0.0]), thresholds[:-1]])
    hi = torch.cat([thresholds[:-1], torch.tensor([1.0])])
    half = torch.maximum(code - lo, hi - code)
    return half.to(codes.device)[codes.long()] + 2.0 ** -23
