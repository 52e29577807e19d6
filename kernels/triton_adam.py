"""Triton kernels for CUDA chunks: fused Adam/AdamW, fp32 -> bf16/fp16 cast, sum-of-squares partials.

Imported only when backend "triton" is used: `import pstar_fx.kernels` does not import triton.
On CPU tensors they run under TRITON_INTERPRET=1 (that is how CI tests them); there the per-program
cost dominates, so BLOCK is chosen large (up to 64K elements, one or a few programs per call).

Bytes per element (the kernels are memory-bound):
  adam   pass 1 reads the grad (4 B fp32 / 2 B 16-bit); pass 2 reads p, g, m, v and writes p, m, v
         (28 B fp32 grads / 26 B 16-bit grads), + 2 B for the optional 16-bit param copy.
         fp32 grads: 32 B; bf16 grads + bf16 copy: 30 B; torch's fused AdamW moves 28 B.
         bf16 moments (optimizer_state="bf16") save 8 B: m and v are read and written as bf16.
         int8 moments (optimizer_state="int8", _adam_q8_kernel) save 12 B: one code each read and written, and
         two fp32 scales per 256 elements (kernels/quant8.py).
  cast   read 4 B, write 2 B = 6 B.
  sq_sum read 4 B (fp32) / 2 B (16-bit), + one fp32 partial per block.

Non-finite gradients leave all state untouched, by construction: pass 1 (_nonfinite_kernel) reads
only the grad and sets a device flag when any grad / grad_scale is inf or NaN; pass 2 (_adam_kernel)
loads that flag first in every program and folds it into the mask of every load and store, so
when it is set not one element of param, exp_avg, exp_avg_sq or param_out is written — no block can
commit before another block has looked. Cost: one extra read of the grad (+4 B on 28, about 14%,
for fp32 grads; +2 B for 16-bit grads), one extra launch, and — only to return a Python bool — one
device-to-host read of the 4-byte flag, which waits for the kernels. Pass `found_inf` (a 1-element
float32 tensor on the device) to keep the whole step asynchronous; the result is then in the flag.

Arithmetic is the C++ kernel's (torch.optim.AdamW's order, sqrt(v) times 1/sqrt(1-b2^t), grad_scale
applied as a multiplication when its reciprocal is exact), with IEEE-rounded sqrt and division
(sqrt_rn, div_rn). Under the interpreter the results equal the C++ kernel's bit for bit; on the GPU
the compiler may fuse multiply-adds, so they match torch to float rounding, not bits.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
import triton
import triton.language as tl

from . import quant8

# grad / output dtype codes (constexpr kernel arguments)
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# GPU launch shapes. Memory-bound elementwise kernels are flat over 1K-4K elements per program.
GPU_BLOCK = {"adam": 2048, "check": 4096, "cast": 4096, "sq_sum": 4096, "adam_q8": 2048}
GPU_WARPS = {"adam": 8, "check": 8, "cast": 8, "sq_sum": 8, "adam_q8": 8}
INTERPRETER_MAX_BLOCK = 1 << 16


@triton.jit
def _load_f32(ptr, offs, mask, KIND: tl.constexpr):
    if KIND == 1:
        # bf16 -> fp32 through the bits: exact, and the interpreter's own bf16 cast mishandles subnormals.
        h = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True)
        return (h.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0).to(tl.float32)


@triton.jit
def _unscale(g, grad_scale, SCALE_MODE: tl.constexpr):
    # SCALE_MODE 0: no scale; 1: grad_scale holds the exact reciprocal (a power of two); 2: divide.
    if SCALE_MODE == 1:
        g = g * grad_scale
    elif SCALE_MODE == 2:
        g = tl.div_rn(g, grad_scale)
    return g


@triton.jit
def _f32_to_bf16_rne(x):
    # Round to nearest even through the bits: the interpreter truncates x.to(tl.bfloat16), the GPU
    # rounds; this is exact in both. NaN stays NaN (quiet bit set, sign and top payload kept).
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _store_16bit(ptr, offs, x, mask, OUT_KIND: tl.constexpr):
    # the 16-bit copy of x, when there is one: OUT_KIND 1 bf16 (rounded to nearest even), 2 fp16 (cvt.rn)
    if OUT_KIND == 1:
        tl.store(ptr + offs, _f32_to_bf16_rne(x), mask=mask)
    elif OUT_KIND == 2:
        tl.store(ptr + offs, x.to(tl.float16), mask=mask)


@triton.jit
def _adam_update(p, g, m, v, l2_wd, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, step_size,
                 eps, DECOUPLED: tl.constexpr):
    """One Adam/AdamW step of (p, m, v) with the unscaled grad g, in torch.optim.AdamW's order."""
    if DECOUPLED:
        p = p * decay
    else:
        g = g + l2_wd * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + (one_minus_beta2 * g) * g
    denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
    p = p - step_size * tl.div_rn(m, denom)
    return p, m, v


@triton.jit
def _nonfinite_kernel(g_ptr, flag_ptr, n, grad_scale, BLOCK: tl.constexpr, GRAD_KIND: tl.constexpr,
                      SCALE_MODE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # A flag already set (found_inf from an earlier chunk) makes this pass free.
    mask = offs < tl.where(tl.load(flag_ptr) == 0, n, 0)
    g = _unscale(_load_f32(g_ptr, offs, mask, GRAD_KIND), grad_scale, SCALE_MODE)
    u = g.to(tl.uint32, bitcast=True)
    bad = ((u & 0x7F800000) == 0x7F800000) & mask
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.store(flag_ptr, 1.0)


@triton.jit
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, flag_ptr, n,
                 grad_scale, l2_wd, decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
                 inv_bc2_sqrt, step_size, eps,
                 BLOCK: tl.constexpr, GRAD_KIND: tl.constexpr, OUT_KIND: tl.constexpr,
                 SCALE_MODE: tl.constexpr, DECOUPLED: tl.constexpr, MOMENT_KIND: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # Pass 1's verdict gates every load and store: a set flag masks off all of them, so nothing
    # anywhere is written.
    mask = offs < tl.where(tl.load(flag_ptr) == 0, n, 0)
    g = _unscale(_load_f32(g_ptr, offs, mask, GRAD_KIND), grad_scale, SCALE_MODE)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = _load_f32(m_ptr, offs, mask, MOMENT_KIND)   # MOMENT_KIND 1: bf16 moments, read exactly
    v = _load_f32(v_ptr, offs, mask, MOMENT_KIND)
    p, m, v = _adam_update(p, g, m, v, l2_wd, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt,
                           step_size, eps, DECOUPLED)
    tl.store(p_ptr + offs, p, mask=mask)
    if MOMENT_KIND == 1:   # written back rounded to nearest even
        tl.store(m_ptr + offs, _f32_to_bf16_rne(m), mask=mask)
        tl.store(v_ptr + offs, _f32_to_bf16_rne(v), mask=mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
    _store_16bit(out_ptr, offs, p, mask, OUT_KIND)


@triton.jit
def _code(x, thr_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    # The int8 code of each normalized x: how many of the 256 sorted thresholds lie below it, by an 8-step binary
    # search (the last threshold is +inf, so every index stays in the table): the C++ kernel's comparisons.
    q = tl.zeros([ROWS, COLS], dtype=tl.int32)
    for k in tl.static_range(8):
        t = tl.load(thr_ptr + q + ((128 >> k) - 1))
        q = q + tl.where(t < x, 128 >> k, 0)
    return q.to(tl.uint8)


@triton.jit
def _adam_q8_kernel(p_ptr, g_ptr, mc_ptr, vc_ptr, ms_ptr, vs_ptr, out_ptr, flag_ptr,
                    smap_ptr, sthr_ptr, umap_ptr, uthr_ptr, n,
                    grad_scale, l2_wd, decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
                    inv_bc2_sqrt, step_size, eps,
                    GROUPS: tl.constexpr, QBLOCK: tl.constexpr, GRAD_KIND: tl.constexpr, OUT_KIND: tl.constexpr,
                    SCALE_MODE: tl.constexpr, DECOUPLED: tl.constexpr):
    # int8 moments: a program takes GROUPS quantization blocks of QBLOCK elements as the rows of a tile, so each
    # block's new absmax is one row's max. Dequantize (map[code] * scale), _adam_update, master from the
    # unquantized moments, then each row quantized against its own absmax (an all-zero row divides by 1).
    blk = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    offs = blk[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    limit = tl.where(tl.load(flag_ptr) == 0, n, 0)       # pass 1's verdict gates every load and store
    mask = offs < limit
    rows = blk * QBLOCK < limit
    g = _unscale(_load_f32(g_ptr, offs, mask, GRAD_KIND), grad_scale, SCALE_MODE)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    mq = tl.load(mc_ptr + offs, mask=mask, other=0).to(tl.int32)
    vq = tl.load(vc_ptr + offs, mask=mask, other=0).to(tl.int32)
    m = tl.load(smap_ptr + mq) * tl.load(ms_ptr + blk, mask=rows, other=0.0)[:, None]
    v = tl.load(umap_ptr + vq) * tl.load(vs_ptr + blk, mask=rows, other=0.0)[:, None]
    p, m, v = _adam_update(p, g, m, v, l2_wd, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt,
                           step_size, eps, DECOUPLED)
    m = tl.where(mask, m, 0.0)     # a short last block's missing elements change no absmax
    v = tl.where(mask, v, 0.0)
    m_absmax = tl.max(tl.abs(m), axis=1)
    v_absmax = tl.max(tl.abs(v), axis=1)
    m_div = tl.where(m_absmax > 0, m_absmax, 1.0)
    v_div = tl.where(v_absmax > 0, v_absmax, 1.0)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(mc_ptr + offs, _code(tl.div_rn(m, m_div[:, None]), sthr_ptr, GROUPS, QBLOCK), mask=mask)
    tl.store(vc_ptr + offs, _code(tl.div_rn(v, v_div[:, None]), uthr_ptr, GROUPS, QBLOCK), mask=mask)
    tl.store(ms_ptr + blk, m_absmax, mask=rows)
    tl.store(vs_ptr + blk, v_absmax, mask=rows)
    _store_16bit(out_ptr, offs, p, mask, OUT_KIND)


@triton.jit
def _undo_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, n, grad_scale, redo_scale, l2_wd, decay, beta1, one_minus_beta1,
                 beta2, one_minus_beta2, inv_bc2_sqrt, step_size, eps,
                 BLOCK: tl.constexpr, GRAD_KIND: tl.constexpr, OUT_KIND: tl.constexpr, SCALE_MODE: tl.constexpr,
                 REDO_MODE: tl.constexpr, DECOUPLED: tl.constexpr, FIRST: tl.constexpr, REDO: tl.constexpr,
                 PART: tl.constexpr):
    # The inverse of _adam_kernel given the grad it consumed (see adam_undo below); with REDO, the step
    # again with grad / redo_scale from the restored state, in _adam_kernel's arithmetic.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p0 = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m1 = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v1 = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if PART != 2:          # the master, from the updated moments (PART 2: it is already restored)
        denom = tl.sqrt_rn(v1) * inv_bc2_sqrt + eps
        u = step_size * tl.div_rn(m1, denom)
        pd = p0.to(tl.float64) + u.to(tl.float64)
        if DECOUPLED:
            p0 = (pd / decay).to(tl.float32)
        else:
            p0 = pd.to(tl.float32)
    if PART == 1:
        tl.store(p_ptr + offs, p0, mask=mask)
        return
    g_raw = _load_f32(g_ptr, offs, mask, GRAD_KIND)
    g = _unscale(g_raw, grad_scale, SCALE_MODE)
    if not DECOUPLED:
        g = g + l2_wd * p0
    if FIRST:
        m0 = tl.zeros_like(m1)
        v0 = tl.zeros_like(v1)
    else:
        m0 = ((m1.to(tl.float64) - (one_minus_beta1 * g).to(tl.float64)) / beta1).to(tl.float32)
        t = (one_minus_beta2 * g) * g
        v0 = tl.maximum((v1.to(tl.float64) - t.to(tl.float64)) / beta2, 0.0).to(tl.float32)
    if REDO:
        p0, m0, v0 = _adam_update(p0, _unscale(g_raw, redo_scale, REDO_MODE), m0, v0, l2_wd, decay, beta1,
                                  one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, step_size, eps, DECOUPLED)
        _store_16bit(out_ptr, offs, p0, mask, OUT_KIND)
    tl.store(p_ptr + offs, p0, mask=mask)
    tl.store(m_ptr + offs, m0, mask=mask)
    tl.store(v_ptr + offs, v0, mask=mask)


@triton.jit
def _rescale_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, n, grad_scale, redo_scale, l2_wd, beta1, one_minus_beta1,
                    beta2, one_minus_beta2, inv_bc2_sqrt, step_size, eps,
                    BLOCK: tl.constexpr, GRAD_KIND: tl.constexpr, OUT_KIND: tl.constexpr, SCALE_MODE: tl.constexpr,
                    REDO_MODE: tl.constexpr, DECOUPLED: tl.constexpr, FIRST: tl.constexpr, COPY_ONLY: tl.constexpr):
    # A correction in one fp32 pass from the updated state (see adam_rescale below; cpu_adam_impl.h rescale_elems)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p1 = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m1 = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v1 = tl.load(v_ptr + offs, mask=mask, other=0.0)
    g_raw = _load_f32(g_ptr, offs, mask, GRAD_KIND)
    gs = _unscale(g_raw, grad_scale, SCALE_MODE)
    gr = _unscale(g_raw, redo_scale, REDO_MODE)
    u1 = step_size * tl.div_rn(m1, tl.sqrt_rn(v1) * inv_bc2_sqrt + eps)
    if not DECOUPLED:
        wp = l2_wd * (p1 + u1)
        gs = gs + wp
        gr = gr + wp
    if FIRST:
        m2 = beta1 * 0.0 + one_minus_beta1 * gr
        v2 = beta2 * 0.0 + (one_minus_beta2 * gr) * gr
    else:
        m2 = (m1 - one_minus_beta1 * gs) + one_minus_beta1 * gr
        v2 = tl.maximum(v1 - (one_minus_beta2 * gs) * gs, 0.0) + (one_minus_beta2 * gr) * gr
    u2 = step_size * tl.div_rn(m2, tl.sqrt_rn(v2) * inv_bc2_sqrt + eps)
    p2 = p1 + (u1 - u2)
    _store_16bit(out_ptr, offs, p2, mask, OUT_KIND)
    if not COPY_ONLY:
        tl.store(p_ptr + offs, p2, mask=mask)
        tl.store(m_ptr + offs, m2, mask=mask)
        tl.store(v_ptr + offs, v2, mask=mask)


@triton.jit
def _cast_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr, OUT_KIND: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # OUT_KIND 1 or 2: ops.cast_ sends only fp32 -> bf16/fp16 here (it copies equal dtypes itself)
    _store_16bit(dst_ptr, offs, tl.load(src_ptr + offs, mask=mask), mask, OUT_KIND)


@triton.jit
def _sq_sum_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr, KIND: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = _load_f32(x_ptr, offs, offs < n, KIND)
    tl.store(partial_ptr + pid, tl.sum(x * x, axis=0))


@triton.jit
def _sq_sum_blocks_kernel(x_ptr, start_ptr, end_ptr, partial_ptr, BLOCK: tl.constexpr, KIND: tl.constexpr):
    # program i: the fp32 sum of squares of x[start[i]:end[i]] (at most BLOCK elements; blocks start at their
    # segment's first element). The offsets are loaded, so the compiler knows nothing of their alignment and
    # lays out every block alike: a block's sum depends on its elements alone, not on where it lies in x.
    pid = tl.program_id(0)
    start = tl.load(start_ptr + pid)
    offs = start + tl.arange(0, BLOCK)
    x = _load_f32(x_ptr, offs, offs < tl.load(end_ptr + pid), KIND)
    tl.store(partial_ptr + pid, tl.sum(x * x, axis=0))


@triton.jit
def _sum_segments_f64_kernel(partial_ptr, first_ptr, out_ptr, BLOCK: tl.constexpr):
    # program j: segment j's partials first[j]:first[j+1] summed in float64, lane k taking partials k, k+BLOCK,
    # ... of the segment in order, then one tree: the order is a function of the segment's partial count only
    seg = tl.program_id(0)
    lo = tl.load(first_ptr + seg)
    hi = tl.load(first_ptr + seg + 1)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for i in range(lo, hi, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + offs, mask=offs < hi, other=0.0).to(tl.float64)
    tl.store(out_ptr + seg, tl.sum(acc, axis=0))


_SEGMENT_TABLES: dict = {}   # (segments, device, block) -> (block starts, block ends, first block per segment)


def _segment_table(segments, device: torch.device, block: int):
    """Each segment cut into blocks of `block` elements from its first element, as device tensors; a chunk's
    segments never change, so each table is built (one host-to-device copy) once."""
    key = (tuple(segments), device, block)
    table = _SEGMENT_TABLES.get(key)
    if table is None:
        starts, ends, first = [], [], [0]
        for off, n in segments:
            for b in range(off, off + n, block):
                starts.append(b)
                ends.append(min(b + block, off + n))
            first.append(len(starts))
        table = tuple(torch.tensor(v, dtype=torch.int64).to(device) for v in (starts, ends, first))
        if len(_SEGMENT_TABLES) > 4096:          # many distinct layouts (tests): forget the oldest
            _SEGMENT_TABLES.pop(next(iter(_SEGMENT_TABLES)))
        _SEGMENT_TABLES[key] = table
    return table


def _scale_mode(grad_scale: float):
    """(SCALE_MODE, the float the kernel gets): as the C++ kernel, multiply by 1/grad_scale when
    that is exact in fp32 (grad_scale a power of two, as loss scalers use), else divide."""
    s32 = float(np.float32(grad_scale))
    if s32 == 1.0:
        return 0, 1.0
    inv = float(np.float32(1.0) / np.float32(s32))
    if math.frexp(s32)[0] == 0.5 and np.isfinite(inv) and inv >= float(np.finfo(np.float32).tiny):
        return 1, inv
    return 2, s32


def _quiet(device: torch.device):
    """The interpreter computes with numpy, which warns on inf arithmetic (e.g. an overflowing
    unscale, which is exactly what the check pass is for); silence that, on CPU only."""
    return np.errstate(all="ignore") if device.type != "cuda" else contextlib.nullcontext()


def _launch_shape(kernel: str, n: int, device: torch.device, block: int | None, num_warps: int | None):
    if device.type != "cuda":  # the interpreter: few, large programs
        b = block or min(max(triton.next_power_of_2(n), 16), INTERPRETER_MAX_BLOCK)
        return b, num_warps or 4
    return block or GPU_BLOCK[kernel], num_warps or GPU_WARPS[kernel]


def adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
              grad_scale, param_out, decoupled_weight_decay, check_finite=True, found_inf=None, block=None,
              num_warps=None, exp_avg_absmax=None, exp_avg_sq_absmax=None):
    """Fused Adam/AdamW on one chunk. Returns True/False (False: non-finite grads, nothing written),
    or None when `found_inf` is given (no host sync; the verdict is in found_inf)."""
    n = param.numel()
    flag = found_inf if found_inf is not None else torch.zeros(1, dtype=torch.float32, device=param.device)
    if n == 0:
        return None if found_inf is not None else True
    scale_mode, scale_arg = _scale_mode(grad_scale)
    with _quiet(param.device):
        if check_finite:
            blk, warps = _launch_shape("check", n, param.device, block, num_warps)
            _nonfinite_kernel[(triton.cdiv(n, blk),)](
                grad, flag, n, scale_arg, BLOCK=blk, GRAD_KIND=_KIND[grad.dtype], SCALE_MODE=scale_mode,
                num_warps=warps)
        coefficients = (float(weight_decay), 1.0 - lr * weight_decay, float(beta1), 1.0 - beta1, float(beta2),
                        1.0 - beta2, 1.0 / math.sqrt(1.0 - beta2**step), lr / (1.0 - beta1**step), float(eps))
        common = dict(GRAD_KIND=_KIND[grad.dtype], OUT_KIND=0 if param_out is None else _KIND[param_out.dtype],
                      SCALE_MODE=scale_mode, DECOUPLED=bool(decoupled_weight_decay) or weight_decay == 0.0)
        if exp_avg.dtype == torch.uint8:
            blk, warps = _launch_shape("adam_q8", n, param.device, block, num_warps)
            groups = max(1, blk // quant8.BLOCK_ELEMS)
            _adam_q8_kernel[(triton.cdiv(quant8.blocks(n), groups),)](
                param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax,
                param if param_out is None else param_out, flag, *quant8.tables_on(param.device), n,
                scale_arg, *coefficients, GROUPS=groups, QBLOCK=quant8.BLOCK_ELEMS, num_warps=warps, **common)
            return None if found_inf is not None else bool(flag.item() == 0)
        blk, warps = _launch_shape("adam", n, param.device, block, num_warps)
        _adam_kernel[(triton.cdiv(n, blk),)](
            param, grad, exp_avg, exp_avg_sq, param if param_out is None else param_out, flag, n,
            scale_arg, *coefficients, BLOCK=blk, MOMENT_KIND=_KIND[exp_avg.dtype], num_warps=warps, **common)
    if found_inf is not None:
        return None
    return bool(flag.item() == 0)


def adam_undo(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, grad_scale,
              decoupled_weight_decay, redo_scale=None, param_out=None, part=0, block=None, num_warps=None) -> None:
    """Undo one adam_step given the grad it consumed (28 B/elem); with `redo_scale`, apply it again with
    grad / redo_scale in the same pass (30 B with a 16-bit copy). beta1, beta2 > 0."""
    n = param.numel()
    if n == 0:
        return
    f32 = lambda x: float(np.float32(x))  # noqa: E731 - the coefficients as the Adam kernel rounds them
    scale_mode, scale_arg = _scale_mode(grad_scale)
    redo_mode, redo_arg = _scale_mode(1.0 if redo_scale is None else redo_scale)
    blk, warps = _launch_shape("adam", n, param.device, block, num_warps)
    with _quiet(param.device):
        _undo_kernel[(triton.cdiv(n, blk),)](
            param, param if grad is None else grad, exp_avg, exp_avg_sq, param if param_out is None else param_out, n,
            scale_arg, redo_arg,
            f32(weight_decay), f32(1.0 - lr * weight_decay), f32(beta1), f32(1.0 - beta1), f32(beta2),
            f32(1.0 - beta2), f32(1.0 / math.sqrt(1.0 - beta2**step)), f32(lr / (1.0 - beta1**step)), f32(eps),
            BLOCK=blk, GRAD_KIND=0 if grad is None else _KIND[grad.dtype],
            OUT_KIND=0 if param_out is None else _KIND[param_out.dtype], SCALE_MODE=scale_mode, REDO_MODE=redo_mode,
            DECOUPLED=bool(decoupled_weight_decay) or weight_decay == 0.0, FIRST=step == 1,
            REDO=redo_scale is not None, PART=part, num_warps=warps)


def adam_rescale(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, grad_scale,
                 decoupled_weight_decay, redo_scale, param_out=None, copy_only=False, block=None,
                 num_warps=None) -> None:
    """Make a step taken with grad / grad_scale again with grad / redo_scale, in one fp32 pass over the
    updated state (28 B/elem with bf16 grads and a 16-bit copy; the copy alone 16 B)."""
    n = param.numel()
    if n == 0:
        return
    f32 = lambda x: float(np.float32(x))  # noqa: E731 - the coefficients as the Adam kernel rounds them
    scale_mode, scale_arg = _scale_mode(grad_scale)
    redo_mode, redo_arg = _scale_mode(redo_scale)
    blk, warps = _launch_shape("adam", n, param.device, block, num_warps)
    with _quiet(param.device):
        _rescale_kernel[(triton.cdiv(n, blk),)](
            param, grad, exp_avg, exp_avg_sq, param if param_out is None else param_out, n, scale_arg, redo_arg,
            f32(weight_decay), f32(beta1), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2),
            f32(1.0 / math.sqrt(1.0 - beta2**step)), f32(lr / (1.0 - beta1**step)), f32(eps),
            BLOCK=blk, GRAD_KIND=_KIND[grad.dtype], OUT_KIND=0 if param_out is None else _KIND[param_out.dtype],
            SCALE_MODE=scale_mode, REDO_MODE=redo_mode,
            DECOUPLED=bool(decoupled_weight_decay) or weight_decay == 0.0, FIRST=step == 1,
            COPY_ONLY=bool(copy_only), num_warps=warps)


def cast_(dst, src, *, block=None, num_warps=None) -> None:
    n = src.numel()
    if n == 0:
        return
    blk, warps = _launch_shape("cast", n, src.device, block, num_warps)
    with _quiet(src.device):  # fp16 overflow to inf
        _cast_kernel[(triton.cdiv(n, blk),)](dst, src, n, BLOCK=blk, OUT_KIND=_KIND[dst.dtype], num_warps=warps)


def sq_norm_partials(x, *, block=None, num_warps=None) -> torch.Tensor:
    """One fp32 sum of squares per block of x (for global-norm clipping across chunks)."""
    n = x.numel()
    blk, warps = _launch_shape("sq_sum", n, x.device, block, num_warps)
    partials = torch.empty(triton.cdiv(n, blk), dtype=torch.float32, device=x.device)
    if n > 0:
        with _quiet(x.device):
            _sq_sum_kernel[(partials.numel(),)](x, partials, n, BLOCK=blk, KIND=_KIND[x.dtype], num_warps=warps)
    return partials


def sq_norms(x, segments, *, block=None, num_warps=None) -> torch.Tensor:
    """Per segment: fp32 partials per block (blocks start at the segment's first element) summed in float64.
    Two launches for all the segments (a chunk's parameters: hundreds of them), whatever their number."""
    out = torch.empty(len(segments), dtype=torch.float64, device=x.device)
    if not segments:
        return out
    # one block size for every segment (not sized by each), so a segment's sum is a function of it alone; the
    # GPU's under the interpreter too (parameters are small there; a 64K block would cost each one 64K lanes)
    blk, warps = block or GPU_BLOCK["sq_sum"], num_warps or GPU_WARPS["sq_sum"]
    starts, ends, first = _segment_table(segments, x.device, blk)
    partials = torch.empty(max(1, starts.numel()), dtype=torch.float32, device=x.device)
    with _quiet(x.device):
        if starts.numel():
            _sq_sum_blocks_kernel[(starts.numel(),)](x, starts, ends, partials, BLOCK=blk, KIND=_KIND[x.dtype],
                                                    num_warps=warps)
        _sum_segments_f64_kernel[(len(segments),)](partials, first, out, BLOCK=256, num_warps=4)
    return out


def sq_norm(x, **launch) -> torch.Tensor:
    # Partials summed in float64 on the device: no host sync, no loss across many blocks.
    return sq_norm_partials(x, **launch).sum(dtype=torch.float64).to(torch.float32)
