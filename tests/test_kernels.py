"""pstar_fx.kernels against the things users trust: torch.optim.AdamW / Adam, a float64 reference,
and torch's own fp32 -> bf16/fp16 casts — for every backend (C++, Triton under the interpreter on
CPU or compiled on CUDA, pure torch).

On the GPU machine run with TRITON_INTERPRET=0 so the CUDA cases compile real Triton kernels; the
interpreted-CPU Triton cases then skip.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import pstar_fx.kernels as K  # noqa: E402
from pstar_fx.kernels import adam_step, cast_, cpu_adam, ops, sq_norm  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

needs_ext = pytest.mark.skipif(not cpu_adam.available(), reason=f"C++ extension not built: {cpu_adam.extension()}")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def _backend_params():
    """(backend, device) pairs, each skipped with its reason where it cannot run."""
    return [
        pytest.param("cpp", "cpu", marks=needs_ext, id="cpp"),
        pytest.param("torch", "cpu", id="torch"),
        pytest.param("triton", "cpu", id="triton-interp", marks=pytest.mark.skipif(
            not (HAS_TRITON and INTERPRET), reason="triton on CPU needs triton and TRITON_INTERPRET=1")),
        pytest.param("triton", "cuda", id="triton-cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
            not (HAS_TRITON and HAS_CUDA and not INTERPRET),
            reason="needs CUDA, triton and TRITON_INTERPRET=0 (else the kernels would be interpreted)")]),
        pytest.param("torch", "cuda", id="torch-cuda", marks=[pytest.mark.gpu, needs_cuda]),
    ]


BACKENDS = _backend_params()
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def _state(n, grad_dtype, device, seed=0, steps=3):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) * 0.1).to(grad_dtype) for _ in range(steps)]
    return p.to(device), [g.to(device) for g in grads]


def _torch_reference(p0, grads, *, wd, decoupled, grad_scale):
    """torch.optim.AdamW / Adam (single-tensor, non-fused) fed the unscaled fp32 grads."""
    param = torch.nn.Parameter(p0.detach().clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([param], betas=(HYPER["beta1"], HYPER["beta2"]), lr=HYPER["lr"], eps=HYPER["eps"], weight_decay=wd,
              foreach=False, fused=False)
    for g in grads:
        param.grad = g.float() / grad_scale
        opt.step()
    st = opt.state[param]
    return param.detach(), st["exp_avg"], st["exp_avg_sq"]


def _float64_reference(p0, grads, *, wd, decoupled, grad_scale):
    p = p0.double().cpu()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    b1, b2, lr, eps = HYPER["beta1"], HYPER["beta2"], HYPER["lr"], HYPER["eps"]
    for t, g in enumerate(grads, start=1):
        g = g.double().cpu() / grad_scale
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr / (1 - b1**t) * m / (v.sqrt() / math.sqrt(1 - b2**t) + eps)
    return p, m, v


def _run(backend, p0, grads, *, wd, decoupled, grad_scale, out_dtype=None):
    p = p0.clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    out = None if out_dtype is None else torch.empty(p.shape, dtype=out_dtype, device=p.device)
    for t, g in enumerate(grads, start=1):
        ok = adam_step(p, g * grad_scale if g.dtype == torch.float32 else (g.float() * grad_scale).to(g.dtype),
                       m, v, step=t, weight_decay=wd, grad_scale=grad_scale, param_out=out,
                       decoupled_weight_decay=decoupled, backend=backend, **HYPER)
        assert ok is True
    return p, m, v, out


# ---------------------------------------------------------------------------------------------- Adam


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("n", [1, 7, 65537])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["g32", "gbf16", "gf16"])
def test_adamw_matches_torch(backend, device, n, grad_dtype):
    p0, grads = _state(n, grad_dtype, device)
    p, m, v, _ = _run(backend, p0, grads, wd=0.1, decoupled=True, grad_scale=1.0)
    rp, rm, rv = _torch_reference(p0, grads, wd=0.1, decoupled=True, grad_scale=1.0)
    torch.testing.assert_close(p, rp, rtol=1e-6, atol=1e-6)
    # torch's single-tensor AdamW updates m with lerp (m + 0.1*(g - m)), this with b1*m + 0.1*g:
    # the two round differently when m nearly cancels, so m is compared at the grad's scale.
    torch.testing.assert_close(m, rm, rtol=1e-6, atol=2e-8)
    torch.testing.assert_close(v, rv, rtol=1e-6, atol=1e-12)
    fp, fm, fv = _float64_reference(p0, grads, wd=0.1, decoupled=True, grad_scale=1.0)
    torch.testing.assert_close(p.double().cpu(), fp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.double().cpu(), fm, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(v.double().cpu(), fv, rtol=1e-5, atol=1e-11)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("grad_scale", [1024.0, 3.0], ids=["scale-pow2", "scale-3"])
def test_weight_decay_modes_and_loss_scale(backend, device, decoupled, grad_scale):
    p0, grads = _state(4099, torch.float32, device, seed=1)
    p, m, v, _ = _run(backend, p0, grads, wd=0.05, decoupled=decoupled, grad_scale=grad_scale)
    rp, rm, rv = _torch_reference(p0, grads, wd=0.05, decoupled=decoupled, grad_scale=1.0)
    # Adam's L2 term can cancel the grad (g + wd*p ~ 0, then the step is eps-dominated and a
    # 1-ulp difference in g + wd*p — torch's add uses an FMA — moves p by up to ~1% of lr).
    atol = 1e-6 if decoupled else HYPER["lr"] / 100
    torch.testing.assert_close(p, rp, rtol=1e-6, atol=atol)
    torch.testing.assert_close(m, rm, rtol=1e-6, atol=2e-8 if decoupled else 1e-6)
    torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-12 if decoupled else 1e-9)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("n", [7, 65537])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "gbf16"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["out-bf16", "out-f16"])
def test_param_out_is_rounded_copy(backend, device, n, grad_dtype, out_dtype):
    p0, grads = _state(n, grad_dtype, device, seed=2, steps=2)
    p, _, _, out = _run(backend, p0, grads, wd=0.1, decoupled=True, grad_scale=1.0, out_dtype=out_dtype)
    assert torch.equal(out.view(torch.int16), p.to(out_dtype).view(torch.int16))  # torch's cast rounds RNE


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_weight_decay_zero_and_step_one(backend, device):
    p0, grads = _state(1000, torch.float32, device, seed=3, steps=1)
    for decoupled in (True, False):
        p, m, v, _ = _run(backend, p0, grads, wd=0.0, decoupled=decoupled, grad_scale=1.0)
        rp, rm, rv = _torch_reference(p0, grads, wd=0.0, decoupled=decoupled, grad_scale=1.0)
        torch.testing.assert_close(p, rp, rtol=1e-6, atol=1e-6)


def test_torch_backend_is_torch_adamw_bit_for_bit():
    p0, grads = _state(5003, torch.float32, "cpu", seed=4)
    p, m, v, _ = _run("torch", p0, grads, wd=0.1, decoupled=True, grad_scale=1.0)
    rp, rm, rv = _torch_reference(p0, grads, wd=0.1, decoupled=True, grad_scale=1.0)
    assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)


# ----------------------------------------------------------------------------- non-finite gradients


def _bits(t):
    return t.clone().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["g32", "gbf16", "gf16"])
@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [0, 40000, -1], ids=["first", "middle", "last"])
def test_nonfinite_grad_changes_nothing(backend, device, grad_dtype, bad, where):
    n = 65537
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, generator=gen).to(device)
    m = (torch.randn(n, generator=gen) * 0.01).to(device)
    v = (torch.rand(n, generator=gen) * 0.01).to(device)
    g = torch.randn(n, generator=gen).to(grad_dtype).to(device)
    g[where] = float(bad)
    out = torch.full((n,), 7.0, dtype=torch.bfloat16, device=device)
    before = [_bits(t) for t in (p, m, v, out)]
    ok = adam_step(p, g, m, v, step=3, weight_decay=0.1, param_out=out, backend=backend, **HYPER)
    assert ok is False
    for name, t, b in zip(("param", "exp_avg", "exp_avg_sq", "param_out"), (p, m, v, out), before):
        assert torch.equal(_bits(t), b), f"{name} was modified"


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("grad_scale", [0.5, 0.3])
def test_overflow_when_unscaling_is_nonfinite(backend, device, grad_scale):
    # 3e38 / 0.5 overflows fp32: the unscaled grad is inf, so the step must not happen.
    p, m, v = (torch.ones(70000, device=device) for _ in range(3))
    g = torch.zeros(70000, device=device)
    g[12345] = 3e38
    before = [_bits(t) for t in (p, m, v)]
    assert adam_step(p, g, m, v, step=1, weight_decay=0.0, grad_scale=grad_scale, backend=backend, **HYPER) is False
    assert all(torch.equal(_bits(t), b) for t, b in zip((p, m, v), before))
    g[12345] = 1e38  # finite after unscaling by 0.5 / 0.3
    assert adam_step(p, g, m, v, step=1, weight_decay=0.0, grad_scale=grad_scale, backend=backend, **HYPER) is True


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_found_inf_flag_accumulates_without_sync(backend, device):
    n = 1000
    p, m, v = torch.randn(n, device=device), torch.zeros(n, device=device), torch.zeros(n, device=device)
    found_inf = torch.zeros(1, device=device)
    g = torch.randn(n, device=device)
    assert adam_step(p, g, m, v, step=1, weight_decay=0.0, backend=backend, found_inf=found_inf, **HYPER) is None
    assert found_inf.item() == 0 and bool(m.abs().sum() > 0)
    g[3] = float("nan")
    adam_step(p, g, m, v, step=2, weight_decay=0.0, backend=backend, found_inf=found_inf, **HYPER)
    assert found_inf.item() == 1
    before = [_bits(t) for t in (p, m, v)]
    g[3] = 0.0  # finite, but the flag from the earlier chunk skips this step too
    adam_step(p, g, m, v, step=2, weight_decay=0.0, backend=backend, found_inf=found_inf, **HYPER)
    assert all(torch.equal(_bits(t), b) for t, b in zip((p, m, v), before))


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_check_finite_off_applies_like_torch(backend, device):
    p0, grads = _state(3000, torch.float32, device, seed=6, steps=1)
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    assert adam_step(p, grads[0], m, v, step=1, weight_decay=0.1, check_finite=False, backend=backend, **HYPER)
    rp, _, _ = _torch_reference(p0, grads, wd=0.1, decoupled=True, grad_scale=1.0)
    torch.testing.assert_close(p, rp, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ C++ specifics


@needs_ext
def test_cpp_simd_levels_agree_bit_for_bit():
    info = K.build_info()["cpu_adam"]
    assert info["simd"] == info["simd_supported"][0] and "scalar" in info["simd_supported"]
    n = 70001  # two blocks, and a tail for every vector width
    gen = torch.Generator().manual_seed(7)
    base = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.1]
    for grad_dtype in (torch.float32, torch.bfloat16, torch.float16):
        g = torch.randn(n, generator=gen).to(grad_dtype)
        for out_dtype in (torch.bfloat16, torch.float16):
            results = {}
            for level in info["simd_supported"]:
                p, m, v = (t.clone() for t in base)
                out = torch.empty(n, dtype=out_dtype)
                assert cpu_adam.adam_step(p, g, m, v, step=2, weight_decay=0.1, grad_scale=3.0, param_out=out,
                                          decoupled_weight_decay=True, simd=level, **HYPER)
                results[level] = [_bits(t) for t in (p, m, v, out)]
            ref = results["scalar"]
            for level, res in results.items():
                assert all(torch.equal(a, b) for a, b in zip(res, ref)), f"{level} differs from scalar"
    with pytest.raises(ValueError, match="unknown simd level"):
        cpu_adam.cast_(torch.empty(4, dtype=torch.bfloat16), torch.zeros(4), simd="sse9")


@needs_ext
@pytest.mark.skipif(not (HAS_TRITON and INTERPRET), reason="needs triton under TRITON_INTERPRET=1")
def test_cpp_and_interpreted_triton_agree_bit_for_bit():
    # Same arithmetic in the same order, IEEE ops only (no FMA in either): identical bits.
    for grad_dtype, scale in ((torch.float32, 1.0), (torch.bfloat16, 8.0), (torch.float16, 3.0)):
        p0, grads = _state(4097, grad_dtype, "cpu", seed=8)
        a = _run("cpp", p0, grads, wd=0.1, decoupled=False, grad_scale=scale, out_dtype=torch.bfloat16)
        b = _run("triton", p0, grads, wd=0.1, decoupled=False, grad_scale=scale, out_dtype=torch.bfloat16)
        assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


CPP_VARIANTS = [(st, sc) for sc in ("dynamic", "static") for st in ("plain", "stream_out")]


def _cpp_step(state, g, out, *, simd="auto", stores="plain", schedule="dynamic", num_threads=0, decoupled=True,
              wd=0.1, grad_scale=1.0, step=2, check_finite=True, prefetch_elems=0):
    p, m, v = state
    return cpu_adam.adam_step(p, g, m, v, step=step, weight_decay=wd, grad_scale=grad_scale, param_out=out,
                              decoupled_weight_decay=decoupled, check_finite=check_finite, simd=simd,
                              num_threads=num_threads, stores=stores, schedule=schedule,
                              prefetch_elems=prefetch_elems, **HYPER)


@needs_ext
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "gbf16"])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16], ids=["no-out", "out-bf16"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
def test_cpp_stores_and_schedules_agree_bit_for_bit(grad_dtype, out_dtype, decoupled):
    """Every store kind (plain, non-temporal 16-bit copy), schedule (dynamic blocks, static shares) and
    prefetch distance at every SIMD level gives the scalar, plain, dynamic path's bits, at 1 to 4 threads
    and at slice offsets that leave the arrays unaligned (the non-temporal head)."""
    n = 100_003  # several 64K blocks, uneven static shares, a tail for every vector width
    gen = torch.Generator().manual_seed(12)
    base = [torch.randn(n + 8, generator=gen), torch.randn(n + 8, generator=gen) * 0.1,
            torch.rand(n + 8, generator=gen) * 0.1]
    g_all = (torch.randn(n + 8, generator=gen) * 0.1).to(grad_dtype)
    levels = K.build_info()["cpu_adam"]["simd_supported"]
    # (offset of p, m, v; offset of grad and out): aligned, all shifted alike, out shifted apart from p
    for off, off_out in ((0, 0), (3, 3), (5, 1)):
        g = g_all[off_out: off_out + n]

        def run(**kw):
            state = [t.clone()[off: off + n] for t in base]
            out = None if out_dtype is None else torch.full((n + 8,), 7.0, dtype=out_dtype)[off_out: off_out + n]
            assert _cpp_step(state, g, out, decoupled=decoupled, grad_scale=3.0, **kw) is True
            return [_bits(t) for t in state] + ([] if out is None else [_bits(out)])

        ref = run(simd="scalar", num_threads=1)
        if out_dtype is not None:
            p_after = ref[0].view(torch.float32)
            assert torch.equal(ref[3], _bits(p_after.to(out_dtype))), "param_out is not torch's rounding"
        for level in levels:
            for stores, schedule in CPP_VARIANTS:
                for threads, prefetch in ((1, 0), (3, 0), (4, 0), (3, 1024), (3, -512)):
                    got = run(simd=level, stores=stores, schedule=schedule, num_threads=threads,
                              prefetch_elems=prefetch)
                    assert all(torch.equal(a, b) for a, b in zip(got, ref)), \
                        f"{level} {stores} {schedule} x{threads} pf {prefetch} at offsets {off}/{off_out} differs"


@needs_ext
@pytest.mark.parametrize("stores,schedule", CPP_VARIANTS, ids=[f"{a}-{b}" for a, b in CPP_VARIANTS])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "gbf16"])
def test_cpp_nonfinite_anywhere_changes_nothing(stores, schedule, grad_dtype):
    """All or nothing under every schedule: a NaN or inf at the first, a middle, the last element, or at the
    edge of a thread's static share or of a dynamic block, leaves master, moments and the 16-bit copy as they
    were, whatever the thread count."""
    n = 200_001
    gen = torch.Generator().manual_seed(13)
    state0 = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01,
              torch.rand(n, generator=gen) * 0.01]
    g0 = torch.randn(n, generator=gen).to(grad_dtype)
    out0 = torch.full((n,), 7.0, dtype=torch.bfloat16)
    per = -(-n // 4)
    share = -(-per // 64) * 64  # a static share of 4 threads: n / 4 rounded up to 64 elements
    for where in (0, 1, 65535, 65536, n // 2, share - 1, share, 3 * share, n - 2, n - 1):
        for bad in (float("nan"), float("inf"), float("-inf")):
            for threads in (1, 4):
                state, out, g = [t.clone() for t in state0], out0.clone(), g0.clone()
                g[where] = bad
                assert _cpp_step(state, g, out, stores=stores, schedule=schedule, num_threads=threads) is False
                for name, t, t0 in zip(("param", "exp_avg", "exp_avg_sq", "param_out"), state + [out],
                                       state0 + [out0]):
                    assert torch.equal(_bits(t), _bits(t0)), f"{name} modified: {bad} at {where}, x{threads}"
    # and a finite grad is applied by the same call
    state, out = [t.clone() for t in state0], out0.clone()
    assert _cpp_step(state, g0, out, stores=stores, schedule=schedule, num_threads=4) is True
    assert not torch.equal(state[0], state0[0]) and torch.equal(out, state[0].to(torch.bfloat16))


@needs_ext
def test_cpp_bad_stores_or_schedule_raise():
    state, g = [torch.zeros(64) for _ in range(3)], torch.zeros(64)
    with pytest.raises(ValueError, match="stores must be"):
        _cpp_step(state, g, None, stores="nt")
    with pytest.raises(ValueError, match="schedule must be"):
        _cpp_step(state, g, None, schedule="guided")


@needs_ext
@pytest.mark.parametrize("nt", [False, True], ids=["plain", "non-temporal"])
def test_stream_triad_computes_the_triad(nt):
    n = 100_003
    gen = torch.Generator().manual_seed(14)
    b, c = torch.randn(n + 1, generator=gen)[1:], torch.randn(n, generator=gen)  # b unaligned: the head path
    a = torch.full((n + 1,), float("nan"))[1:]
    for level in K.build_info()["cpu_adam"]["simd_supported"]:
        for threads in (1, 3):
            a.fill_(float("nan"))
            seconds = cpu_adam.stream_triad(a, b, c, scalar=3.0, reps=2, nt=nt, simd=level, num_threads=threads)
            assert seconds > 0 and torch.equal(a, b + c * 3.0), (level, threads)


def test_default_threads_counts_physical_cores(monkeypatch):
    cpu_adam.default_threads.cache_clear()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert cpu_adam.default_threads() == 3
        cpu_adam.default_threads.cache_clear()
        monkeypatch.delenv("OMP_NUM_THREADS")
        threads = cpu_adam.default_threads()
        assert 1 <= threads <= len(os.sched_getaffinity(0))
    finally:
        cpu_adam.default_threads.cache_clear()


def test_the_host_worker_leaves_a_core_to_the_launching_thread(monkeypatch):
    """worker_threads: one core fewer than the default beside the thread that launches GPU work, unless
    OMP_NUM_THREADS is set or only two cores are there; set_threads applies to the calling Python thread alone."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for cores, worker in ((16, 15), (3, 2), (2, 2), (1, 1)):
        monkeypatch.setattr(cpu_adam, "default_threads", lambda cores=cores: cores)
        assert cpu_adam.worker_threads() == worker, cores
    monkeypatch.setenv("OMP_NUM_THREADS", "16")     # the user's count stands (default_threads returns it)
    monkeypatch.setattr(cpu_adam, "default_threads", lambda: 16)
    assert cpu_adam.worker_threads() == 16
    seen = {}
    try:
        cpu_adam.set_threads(5)
        other = threading.Thread(target=lambda: seen.setdefault("other", cpu_adam._threads(0)))
        other.start()
        other.join()
        assert cpu_adam._threads(0) == 5 and cpu_adam._threads(3) == 3 and seen["other"] == 16
    finally:
        cpu_adam.set_threads(0)
    assert cpu_adam._threads(0) == 16


@needs_ext
def test_cpp_releases_the_gil():
    n = 8_000_000
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    span = {}

    def work():
        span["start"] = time.perf_counter()
        for step in range(1, 4):
            adam_step(p, g, m, v, step=step, weight_decay=0.0, backend="cpp", **HYPER)
        span["end"] = time.perf_counter()

    ticks = []
    t = threading.Thread(target=work)
    t.start()
    while t.is_alive():
        ticks.append(time.perf_counter())
    t.join()
    inside = [x for x in ticks if span["start"] + 0.002 < x < span["end"] - 0.002]
    assert span["end"] - span["start"] > 0.01
    assert len(inside) > 100, "the Python thread did not run while C++ Adam was working: GIL held"


def test_build_info_and_lazy_triton_import():
    code = ("import sys, torch, pstar_fx.kernels as K; info = K.build_info(); "
            "K.adam_step(torch.zeros(8), torch.ones(8), torch.zeros(8), torch.zeros(8), step=1, lr=1e-3, beta1=0.9, "
            "beta2=0.999, eps=1e-8, weight_decay=0.0, backend='torch'); "
            "print('triton' in sys.modules, info['cpu_adam'] is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "False", "import pstar_fx.kernels imported triton"
    assert out[1] == str(cpu_adam.available())


def test_missing_extension_falls_back_to_torch_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpu_adam, "extension", lambda: ImportError("no _cpu_adam here (simulated)"))
    ops._warn_fallback.cache_clear()
    p0, grads = _state(100, torch.float32, "cpu", seed=9, steps=1)
    p, m, v = p0.clone(), torch.zeros(100), torch.zeros(100)
    with pytest.warns(RuntimeWarning, match="not built"):
        assert adam_step(p, grads[0], m, v, step=1, weight_decay=0.1, **HYPER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sq_norm(p)  # second use: silent
        cast_(torch.empty(100, dtype=torch.bfloat16), p)
    rp, _, _ = _torch_reference(p0, grads, wd=0.1, decoupled=True, grad_scale=1.0)
    assert torch.equal(p, rp)
    with pytest.raises(RuntimeError, match="not built"):
        adam_step(p, grads[0], m, v, step=1, weight_decay=0.1, backend="cpp", **HYPER)
    ops._warn_fallback.cache_clear()


# ----------------------------------------------------------------------------------- bad calls


def test_bad_calls_raise_and_name_the_problem():
    n = 16
    p, g, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    kw = dict(step=1, weight_decay=0.0, **HYPER)
    with pytest.raises(ValueError, match="grad has 15 elements"):
        adam_step(p, torch.zeros(15), m, v, **kw)
    with pytest.raises(ValueError, match="exp_avg must be contiguous"):
        adam_step(p, g, torch.zeros(n, 2)[:, 0], v, **kw)
    with pytest.raises(TypeError, match="exp_avg_sq has dtype bfloat16"):
        adam_step(p, g, m, v.bfloat16(), **kw)
    with pytest.raises(TypeError, match="param has dtype float16"):
        adam_step(p.half(), g, m, v, **kw)
    with pytest.raises(TypeError, match="grad has dtype float64"):
        adam_step(p, g.double(), m, v, **kw)
    with pytest.raises(TypeError, match="param_out has dtype float32"):
        adam_step(p, g, m, v, param_out=torch.zeros(n), **kw)
    with pytest.raises(ValueError, match="grad is on meta"):
        adam_step(p, torch.zeros(n, device="meta"), m, v, **kw)
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        adam_step(p, g, m, v, backend="gpu", **kw)
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        adam_step(p, g, m, v, **{**kw, "step": 0})
    with pytest.raises(ValueError, match="grad_scale must be positive"):
        adam_step(p, g, m, v, grad_scale=0.0, **kw)
    with pytest.raises(ValueError, match="grad_scale must be finite"):
        adam_step(p, g, m, v, grad_scale=float("inf"), **kw)
    with pytest.raises(TypeError, match="lr must be a number"):
        adam_step(p, g, m, v, **{**kw, "lr": "0.1"})
    with pytest.raises(ValueError, match="betas must be in"):
        adam_step(p, g, m, v, **{**kw, "beta2": 1.0})
    with pytest.raises(ValueError, match="distinct memory"):
        adam_step(p, g, p, v, **kw)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        adam_step(p, [0.0] * n, m, v, **kw)
    with pytest.raises(ValueError, match="needs CPU tensors"):
        adam_step(*(torch.zeros(n, device="meta") for _ in range(4)), backend="cpp", **kw)
    with pytest.raises(TypeError, match="float32 -> bfloat16/float16"):
        cast_(torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dst has 8 elements"):
        cast_(torch.zeros(8, dtype=torch.bfloat16), torch.zeros(n))
    with pytest.raises(TypeError, match="x has dtype int64"):
        sq_norm(torch.zeros(n, dtype=torch.int64))
    with pytest.raises(ValueError, match="unknown backend"):
        sq_norm(p, backend="cuda")


# ------------------------------------------------------------------------------------------ cast


def _cast_inputs():
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 65504.0, 65519.99, 65520.0, 70000.0,
                             -70000.0, 3.0e38, -3.4e38, 1e-45, -1e-45, 1.17e-38, 5.96e-8, 2.98e-8, 2.99e-8, 6.1e-5,
                             6.0e-5, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11])
    gen = torch.Generator().manual_seed(10)
    # random bit patterns over the whole range (subnormals, huge, ties), NaNs removed
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    rand = bits.view(torch.float32)
    rand = rand[~torch.isnan(rand)]
    # exact ties between neighbours for both 16-bit formats
    ties = torch.tensor([(1 + 2 * k + 1) * 2**-9 for k in range(64)] + [(1 + 2 * k + 1) * 2**-12 for k in range(64)])
    return torch.cat([specials, rand, ties, torch.randn(65537, generator=gen) * 1e-6])


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_cast_bit_exact_vs_torch(backend, device, dtype):
    src = _cast_inputs().to(device)
    dst = torch.empty(src.shape, dtype=dtype, device=device)
    cast_(dst, src, backend=backend)
    assert torch.equal(dst.view(torch.int16).cpu(), src.to(dtype).view(torch.int16).cpu())


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_cast_nan_stays_nan(backend, device, dtype):
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0xFF800001, 0xFFFFFFFF, 0x7FFFFFFF, 0x7F80FFFF, 0xFFC00000] * 5,
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    src = torch.cat([nans, torch.ones(3)]).to(device)
    dst = torch.empty(src.shape, dtype=dtype, device=device)
    cast_(dst, src, backend=backend)
    assert bool(torch.isnan(dst[:-3].float()).all()) and bool((dst[-3:] == 1).all())


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("n", [0, 1, 7, 65537])
def test_cast_sizes_and_same_dtype_copy(backend, device, n):
    src = torch.randn(n, device=device)
    for dtype in (torch.bfloat16, torch.float16):
        dst = torch.empty(n, dtype=dtype, device=device)
        cast_(dst, src, backend=backend)
        assert torch.equal(dst, src.to(dtype))
    dst = torch.empty(n, device=device)
    cast_(dst, src, backend=backend)
    assert torch.equal(dst, src)


# --------------------------------------------------------------------------------------- sq_norm


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("n", [0, 1, 7, 65537, 300_001])
def test_sq_norm_vs_float64(backend, device, dtype, n):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=gen) * 3).to(dtype)
    out = sq_norm(x.to(device), backend=backend)
    assert out.dtype == torch.float32 and out.dim() == 0 and out.device.type == device
    ref = x.double().square().sum()
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_sq_norms_of_a_segment_do_not_depend_on_where_it_lies(backend, device):
    """sq_norms: a segment's sum of squares has the same bits at every offset (alignment) and beside any
    neighbours (other segments of the same call, before and after it), at sizes below and above the C++
    kernel's parallel threshold and block and Triton's block; and it is the float64 sum to the rounding of
    fp32 partials. The engine's global norm is built from these, so it does not depend on the chunk layout."""
    g = torch.Generator().manual_seed(0)
    for n in (7, 1000, 40000, 200001):
        x = torch.randn(n, generator=g) * torch.rand(n, generator=g).exp()
        truth = x.double().square().sum().item()
        seen = set()
        for off in range(0, 17, 2 if backend == "triton" and device == "cpu" else 1):   # the interpreter is slow
            buf = torch.randn(n + 40, generator=g)
            buf[off: off + n] = x
            before = [(0, off)] if off else []
            out = ops.sq_norms(buf.to(device), before + [(off, n), (off + n, 3), (off + n, 0)], backend=backend)
            assert out.dtype == torch.float64 and out.device.type == device
            seen.add(out[len(before)].item())
            assert out[-1].item() == 0.0
        assert len(seen) == 1, (n, seen)
        # fp32 partials of at most 64K squares each: relative error below 64K * 2^-24 (a loose bound)
        assert abs(seen.pop() - truth) <= 4e-3 * truth, n


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_sq_norm_nonfinite_propagates(backend, device):
    x = torch.ones(1000, device=device)
    x[10] = float("inf")
    assert math.isinf(sq_norm(x, backend=backend).item())
    x[10] = float("nan")
    assert math.isnan(sq_norm(x, backend=backend).item())


def test_hyperparameters_may_be_numpy_scalars_or_0d_tensors():
    import numpy as np

    p0, grads = _state(100, torch.float32, "cpu", seed=11, steps=1)
    p, m, v = p0.clone(), torch.zeros(100), torch.zeros(100)
    assert adam_step(p, grads[0], m, v, step=np.int64(1), lr=torch.tensor(HYPER["lr"]), beta1=np.float32(0.9),
                     beta2=0.999, eps=1e-8, weight_decay=np.float64(0.1))
    rp, _, _ = _torch_reference(p0, grads, wd=0.1, decoupled=True, grad_scale=1.0)
    torch.testing.assert_close(p, rp, rtol=1e-6, atol=1e-6)


# ---- adam_undo: the inverse the step transaction rolls back and corrects with ------------------------------

UNDO_BACKENDS = [pytest.param("cpp", "cpu", marks=needs_ext, id="cpp"), pytest.param("torch", "cpu", id="torch"),
                 pytest.param("torch", "cuda", id="torch-cuda", marks=[pytest.mark.gpu, needs_cuda])]


@pytest.mark.parametrize("backend,device", UNDO_BACKENDS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["g32", "gbf16", "gf16"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("grad_scale", [1.0, 1024.0, 3.0])
def test_adam_undo_restores_the_state_before_the_step(backend, device, grad_dtype, decoupled, grad_scale):
    """undo(step(x)) = x within two ulps of x and of step(x) (what rounding took from the updated value
    cannot come back); after step 1 the moments return as exact zeros. With L2 weight decay the moments
    are undone from grad + wd * param, recomputed from the restored param: its error (two ulps, scaled by wd)
    and the new roundings of that sum enter them too."""
    n = 65537
    p, grads = _state(n, grad_dtype, device, seed=4, steps=4)
    m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    hyper = dict(HYPER, weight_decay=0.1, decoupled_weight_decay=decoupled, grad_scale=grad_scale)
    for step, g in enumerate(grads, start=1):
        g = (g.float() * grad_scale).to(grad_dtype)
        before = [t.clone() for t in (p, m, v)]
        adam_step(p, g, m, v, step=step, backend="cpp" if device == "cpu" else "auto", **hyper)
        after = [t.clone() for t in (p, m, v)]
        K.adam_undo(p, g, m, v, step=step, backend=backend, **hyper)
        for name, got, want, start in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), before, after):
            if step == 1 and name != "param":
                assert torch.equal(got, torch.zeros_like(got)), name
                continue
            bound = 2.0**-22 * (start.abs() + want.abs()) + 1e-38
            if device == "cuda":   # the step ran in Triton, which may contract multiply-adds the undo does not
                bound = 2 * bound
            if not decoupled and name != "param":
                dp = 2.0**-22 * (after[0].abs() + before[0].abs())           # the restored param's error
                g_eff = (g.float() / grad_scale).abs() + 0.1 * before[0].abs()
                dg = 0.1 * dp + 2.0**-22 * g_eff          # and g + wd * p is rounded anew (twice)
                b1, b2 = HYPER["beta1"], HYPER["beta2"]
                bound = bound + dg * ((1 - b1) / b1 if name == "exp_avg" else 2 * (1 - b2) / b2 * g_eff)
            worst = float(((got - want).abs() / bound).max())
            assert worst <= 1.0, f"step {step} {name}: {worst:.2f} x the two-ulp bound"
        p.copy_(after[0]), m.copy_(after[1]), v.copy_(after[2])       # go on from the stepped state


CORRECT_BACKENDS = UNDO_BACKENDS + [
    pytest.param("triton", "cpu", id="triton-interp", marks=pytest.mark.skipif(
        not (HAS_TRITON and INTERPRET), reason="triton on CPU needs triton and TRITON_INTERPRET=1")),
    pytest.param("triton", "cuda", id="triton-cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not (HAS_TRITON and HAS_CUDA and not INTERPRET), reason="needs CUDA, triton and TRITON_INTERPRET=0")])]


@pytest.mark.parametrize("backend,device", CORRECT_BACKENDS)
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
def test_adam_undo_with_redo_is_undo_then_step(backend, device, decoupled):
    """A correction in one pass equals an undo followed by adam_step with the corrected grad scale (bit for
    bit on the CPU backends and the interpreter; on the GPU Triton may contract multiply-adds differently)."""
    n = 65537
    p, grads = _state(n, torch.bfloat16, device, seed=6, steps=3)
    m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    hyper = dict(HYPER, weight_decay=0.1, decoupled_weight_decay=decoupled)
    for step, g in enumerate(grads[:2], start=1):
        adam_step(p, g, m, v, step=step, grad_scale=1.0, **hyper)
    adam_step(p, grads[2], m, v, step=3, grad_scale=1.0, **hyper)      # the speculative step (coefficient 1)
    fused = [t.clone() for t in (p, m, v)]
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    K.adam_undo(*fused[:1], grads[2], *fused[1:], step=3, grad_scale=1.0, redo_scale=4.0, param_out=out,
                backend=backend, **hyper)
    twice = [t.clone() for t in (p, m, v)]
    K.adam_undo(*twice[:1], grads[2], *twice[1:], step=3, grad_scale=1.0, backend=backend, **hyper)
    adam_step(*twice[:1], grads[2], *twice[1:], step=3, grad_scale=4.0, check_finite=False,
              backend="torch" if backend == "torch" else "auto", **hyper)
    for a, b in zip(fused, twice):
        if device == "cuda":
            torch.testing.assert_close(a, b, rtol=2e-6, atol=0)
        else:
            assert torch.equal(a, b)
    assert torch.equal(out, fused[0].to(torch.bfloat16))
    # part "copy": that correction's 16-bit copy alone, the same bits; the state is left as it was
    alone, copy = [t.clone() for t in (p, m, v)], torch.empty(n, dtype=torch.bfloat16, device=device)
    K.adam_undo(*alone[:1], grads[2], *alone[1:], step=3, grad_scale=1.0, redo_scale=4.0, param_out=copy,
                part="copy", backend=backend, **hyper)
    assert torch.equal(copy, out) and all(torch.equal(a, b) for a, b in zip(alone, (p, m, v)))
    with pytest.raises(ValueError, match="needs redo_scale and param_out"):
        K.adam_undo(*alone[:1], grads[2], *alone[1:], step=3, grad_scale=1.0, part="copy", backend=backend, **hyper)


@needs_ext
@pytest.mark.parametrize("other,grad_dtype,decoupled,grad_scale,redo_scale,seed", [
    pytest.param("torch", torch.bfloat16, True, 1.0, None, 5, id="torch"),
    pytest.param("triton", torch.float16, False, 3.0, 5.0, 7, id="triton-interp", marks=pytest.mark.skipif(
        not (HAS_TRITON and INTERPRET), reason="needs triton under TRITON_INTERPRET=1")),
])
def test_adam_undo_backends_agree_with_cpp_bit_for_bit(other, grad_dtype, decoupled, grad_scale, redo_scale, seed):
    n = 40000
    p, grads = _state(n, grad_dtype, "cpu", seed=seed, steps=3)
    m, v = torch.zeros(n), torch.zeros(n)
    hyper = dict(HYPER, weight_decay=0.05, decoupled_weight_decay=decoupled, grad_scale=grad_scale)
    for step, g in enumerate(grads, start=1):
        adam_step(p, g, m, v, step=step, **hyper)
    results = {}
    for backend in ("cpp", other):
        state = [t.clone() for t in (p, m, v)]
        K.adam_undo(*state[:1], grads[-1], *state[1:], step=3, redo_scale=redo_scale, backend=backend, **hyper)
        results[backend] = state
    assert all(torch.equal(a, b) for a, b in zip(results["cpp"], results[other]))


def _undo_case(n, grad_dtype, seed):
    """A stepped state with the undo's edge cases: zero grads of both signs, second moments near eps^2 and at zero,
    signed zeros and subnormals in the master and the first moment."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-4
    g = torch.randn(n, generator=gen) * 0.1
    g[::5], g[1::17] = 0.0, -0.0
    v[::7], v[2::19] = 1e-16, 0.0                 # sqrt(v) * inv_bc2_sqrt next to eps; v - (1 - b2) g^2 < 0 on undo
    m[::11], p[::13], p[3::29], m[4::31] = -0.0, -0.0, 1e-41, -3e-42
    return p, m, v, g.to(grad_dtype)


@needs_ext
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["g32", "gbf16", "gf16"])
def test_cpp_undo_every_simd_level_is_the_old_kernel_bit_for_bit(grad_dtype):
    """Every SIMD level of adam_undo gives the scalar level's bits: the kernel before issue 24, whose float64
    quotients are IEEE divisions (the vector levels' reciprocal quotients are proven equal to them in
    cpu_adam_impl.h: the bound is 0 ulps, for the master, both moments and the 16-bit copy). The scalar level in
    turn is torch_adam.adam_undo's float64 arithmetic bit for bit, and a correction in one pass is that undo
    followed by adam_step with the new scale. Over parts, weight decay modes (AdamW, Adam-L2, none), loss scales
    that multiply (1, 1024) and divide (3), redo scales, step 1 (zero moments) and 3, a large lr, and the
    hyperparameters that take the scalar level everywhere (b1 = 0.5, decay 1 - lr*wd = 0.5 and <= 0)."""
    from pstar_fx.kernels import torch_adam
    levels = K.build_info()["cpu_adam"]["simd_supported"]
    n = 70001  # two 64K blocks, and a tail for every vector width
    cases = [dict(decoupled=True, wd=0.1, lr=1e-2, b1=0.9), dict(decoupled=False, wd=0.1, lr=1e-2, b1=0.9),
             dict(decoupled=True, wd=0.0, lr=1e-2, b1=0.9), dict(decoupled=True, wd=0.1, lr=3.0, b1=0.9),
             dict(decoupled=True, wd=0.1, lr=5.0, b1=0.9), dict(decoupled=True, wd=0.1, lr=12.0, b1=0.9),
             dict(decoupled=False, wd=0.0, lr=1e-2, b1=0.5)]
    for ci, case in enumerate(cases):
        for step, scale, redo, part in ((3, 1.0, None, "all"), (3, 1024.0, 0.37, "all"), (3, 3.0, 4.0, "all"),
                                        (1, 1.0, 2.0, "all"), (3, 1.0, None, "param"), (3, 3.0, 0.5, "moments"),
                                        (1, 1.0, None, "moments")):
            p, m, v, g = _undo_case(n, grad_dtype, seed=100 * ci + step)
            hyper = dict(step=step, lr=case["lr"], beta1=case["b1"], beta2=0.999, eps=1e-8, weight_decay=case["wd"],
                         decoupled_weight_decay=case["decoupled"])
            g = (g.float() * scale).to(grad_dtype)
            assert cpu_adam.adam_step(p, g, m, v, grad_scale=scale, param_out=None, **hyper)
            code = {"all": 0, "param": 1, "moments": 2}[part]
            if part == "moments":   # the master was restored first
                cpu_adam.adam_undo(p, None, m, v, grad_scale=scale, part=1, simd="scalar", **hyper)
            results = {}
            for level in levels:
                for threads, off in ((1, 0), (3, 1)):   # off: the 16-bit copy's start, unaligned to the vectors
                    state = [t.clone() for t in (p, m, v)]
                    out = torch.full((n + 1,), 7.0, dtype=torch.bfloat16)[off:off + n] if redo else None
                    cpu_adam.adam_undo(state[0], None if part == "param" else g, state[1], state[2], grad_scale=scale,
                                       redo_scale=redo, param_out=out, part=code, simd=level, num_threads=threads,
                                       **hyper)
                    results[level, threads, off] = [_bits(t) for t in state] + ([_bits(out)] if redo else [])
                    if part == "all" and redo:   # part 3, the corrected 16-bit copy alone: the same bits, no state
                        alone = [t.clone() for t in (p, m, v)]
                        copy = torch.full((n + 1,), 7.0, dtype=torch.bfloat16)[off:off + n]
                        cpu_adam.adam_undo(alone[0], g, alone[1], alone[2], grad_scale=scale, redo_scale=redo,
                                           param_out=copy, part=3, simd=level, num_threads=threads, **hyper)
                        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(alone, (p, m, v))), (ci, level)
                        assert torch.equal(_bits(copy), results[level, threads, off][3]), (ci, step, level, threads)
            ref = results["scalar", 1, 0]
            for key, got in results.items():
                assert all(torch.equal(a, b) for a, b in zip(got, ref)), f"case {ci} step {step} {part}: {key} differs"
            want = [t.clone() for t in (p, m, v)]
            torch_adam.adam_undo(want[0], g, want[1], want[2], grad_scale=scale, part=code, **hyper)
            if redo:
                cpu_adam.adam_step(want[0], g, want[1], want[2], grad_scale=redo, simd="scalar", check_finite=False,
                                   param_out=None, **hyper)
                assert torch.equal(ref[3], _bits(ref[0].view(torch.float32).to(torch.bfloat16)))
            assert all(torch.equal(a, _bits(b)) for a, b in zip(ref, want)), f"case {ci} step {step} {part}: reference"


# ----------------------------------------------------------------------------- the one-pass correction

RESCALE_CASES = [dict(decoupled=True, wd=0.1, lr=1e-2, b1=0.9), dict(decoupled=False, wd=0.1, lr=1e-2, b1=0.9),
                 dict(decoupled=True, wd=0.0, lr=1e-2, b1=0.9), dict(decoupled=True, wd=0.1, lr=3.0, b1=0.9),
                 dict(decoupled=False, wd=0.0, lr=1e-2, b1=0.5), dict(decoupled=True, wd=0.1, lr=1e-2, b1=0.0)]


@needs_ext
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["g32", "gbf16", "gf16"])
def test_cpp_rescale_every_simd_level_gives_the_torch_reference_bits(grad_dtype):
    """adam_rescale (the one-pass fp32 correction): every SIMD level, thread count and 16-bit copy alignment gives
    torch_adam.adam_rescale's bits (each fp32 op IEEE-rounded, in the kernel's order), for the master, both moments
    and the copy; part "copy" writes those copy bits and leaves the state alone. Over weight decay modes, loss scales
    that multiply (1024) and divide (3), redo scales that shrink and grow, step 1 (zero moments) and 3, a large lr,
    b1 = 0.5 and 0, and the undo's edge cases (signed zeros, subnormals, v at 0 and next to eps^2)."""
    from pstar_fx.kernels import torch_adam
    levels = K.build_info()["cpu_adam"]["simd_supported"]
    n = 70001  # two 64K blocks, and a tail for every vector width
    for ci, case in enumerate(RESCALE_CASES):
        for step, scale, redo in ((3, 1.0, 2.7), (3, 1024.0, 0.37), (3, 3.0, 4.0), (1, 1.0, 2.0), (3, 1.0, 1.0)):
            p, m, v, g = _undo_case(n, grad_dtype, seed=100 * ci + step)
            hyper = dict(step=step, lr=case["lr"], beta1=case["b1"], beta2=0.999, eps=1e-8, weight_decay=case["wd"],
                         decoupled_weight_decay=case["decoupled"])
            g = (g.float() * scale).to(grad_dtype)
            assert cpu_adam.adam_step(p, g, m, v, grad_scale=scale, param_out=None, **hyper)
            results = {}
            for level in levels:
                for threads, off in ((1, 0), (3, 1)):   # off: the 16-bit copy's start, unaligned to the vectors
                    state = [t.clone() for t in (p, m, v)]
                    out = torch.full((n + 1,), 7.0, dtype=torch.bfloat16)[off:off + n]
                    cpu_adam.adam_rescale(state[0], g, state[1], state[2], grad_scale=scale, redo_scale=redo,
                                          param_out=out, simd=level, num_threads=threads, **hyper)
                    results[level, threads, off] = [_bits(t) for t in (*state, out)]
                    alone = [t.clone() for t in (p, m, v)]
                    copy = torch.full((n + 1,), 7.0, dtype=torch.bfloat16)[off:off + n]
                    cpu_adam.adam_rescale(alone[0], g, alone[1], alone[2], grad_scale=scale, redo_scale=redo,
                                          param_out=copy, copy_only=True, simd=level, num_threads=threads, **hyper)
                    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(alone, (p, m, v))), (ci, level)
                    assert torch.equal(_bits(copy), results[level, threads, off][3]), (ci, step, level, threads)
            want = [t.clone() for t in (p, m, v)]
            want_out = torch.empty(n, dtype=torch.bfloat16)
            torch_adam.adam_rescale(want[0], g, want[1], want[2], grad_scale=scale, redo_scale=redo,
                                    param_out=want_out, **hyper)
            want = [_bits(t) for t in (*want, want_out)]
            for key, got in results.items():
                assert all(torch.equal(a, b) for a, b in zip(got, want)), f"case {ci} step {step}: {key} differs"


@needs_ext
@pytest.mark.skipif(not (HAS_TRITON and INTERPRET), reason="needs triton under TRITON_INTERPRET=1")
@pytest.mark.parametrize("decoupled,part", [(True, "all"), (False, "copy")])
def test_adam_rescale_triton_equals_cpp_bit_for_bit(decoupled, part):
    n = 40000
    p, grads = _state(n, torch.float16, "cpu", seed=11, steps=3)
    m, v = torch.zeros(n), torch.zeros(n)
    hyper = dict(HYPER, weight_decay=0.05, decoupled_weight_decay=decoupled, grad_scale=3.0)
    for step, g in enumerate(grads, start=1):
        adam_step(p, g, m, v, step=step, **hyper)
    results = {}
    for backend in ("cpp", "triton"):
        state = [t.clone() for t in (p, m, v)] + [torch.zeros(n, dtype=torch.bfloat16)]
        K.adam_rescale(*state[:1], grads[-1], *state[1:3], step=3, redo_scale=5.0, param_out=state[3], part=part,
                       backend=backend, **hyper)
        results[backend] = state
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(results["cpp"], results["triton"]))


@needs_ext
@pytest.mark.parametrize("case", range(3), ids=["adamw", "adam-l2", "no-decay"])
def test_adam_rescale_lands_within_its_bound_of_the_step_made_afresh(case):
    """The correction against the step made afresh from the state before it with the verdict's scale (what a
    deferred step computes). Its errors, from the arithmetic: the master carries the speculated master's rounding
    once more plus the final add's (<= 2 ulps of the larger of the masters and the update terms, the restore
    contract's two), and whatever the moments' differences move the new update term by (with its fp32 arithmetic's
    own rounding, <= 3 ulps of the term, once its inputs differ at all); each moment carries the
    rounding of its speculated value and of the two grad terms (<= 2 ulps of the speculated moment + an ulp of each
    term + an ulp of the result); with L2 decay the grad's wd * p term uses p1 + u1, within an ulp of the master
    before the step. The old undo-then-redo has the same kinds of error (it restores the moments to their
    speculated values' rounding)."""
    decoupled, wd = [(True, 0.1), (False, 0.1), (True, 0.0)][case]
    gen = torch.Generator().manual_seed(case)
    n = 200_003
    inf = torch.tensor(float("inf"))

    def ulp(x):
        return (torch.nextafter(x.abs(), inf) - x.abs()).double()

    for step in (1, 3, 50):
        for s1, s2 in ((1.0, 0.3), (1.0, 0.03), (3.0, 4.0), (1024.0, 0.37), (1.0, 1.0)):
            p = torch.randn(n, generator=gen)
            m = torch.randn(n, generator=gen) * 1e-2 if step > 1 else torch.zeros(n)
            v = torch.rand(n, generator=gen) * 1e-4 if step > 1 else torch.zeros(n)
            graw = (torch.randn(n, generator=gen) * 0.1 * s1).bfloat16()
            lr = 1e-2
            hyper = dict(step=step, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd,
                         decoupled_weight_decay=decoupled)
            redo = s1 / s2
            fresh = [t.clone() for t in (p, m, v)]
            cpu_adam.adam_step(fresh[0], graw, fresh[1], fresh[2], grad_scale=redo, param_out=None, **hyper)
            spec = [t.clone() for t in (p, m, v)]
            cpu_adam.adam_step(spec[0], graw, spec[1], spec[2], grad_scale=s1, param_out=None, **hyper)
            got = [t.clone() for t in spec]
            K.adam_rescale(got[0], graw, got[1], got[2], grad_scale=s1, redo_scale=redo, **hyper)
            step_size, c = lr / (1 - 0.9 ** step), 1 / (1 - 0.999 ** step) ** 0.5

            def term(m, v):
                return step_size * m.double() / (v.double().sqrt() * c + 1e-8)

            big_p = torch.maximum(spec[0].abs(), fresh[0].abs()).double()
            big = torch.maximum(big_p, torch.maximum(term(*spec[1:]).abs(), term(*fresh[1:]).abs()))
            u2 = term(*fresh[1:]).abs().float()
            bound_p = 2 * ulp(big.float()) + (term(*got[1:]) - term(*fresh[1:])).abs() + 3 * ulp(u2)
            wp = 0.0 if decoupled else wd * p.double()                 # L2: the grads the moments take
            gs, gr = graw.double() / s1 + wp, graw.double() / redo + wp
            l2 = 0.0 if decoupled else 2 * wd * ulp(big_p.float())   # the grads' wd * p term, p within an ulp
            bound_m = 2 * ulp(spec[1]) + ulp((0.1 * gs).float()) + ulp((0.1 * gr).float()) + ulp(fresh[1]) + 0.1 * l2
            bound_v = (2 * ulp(spec[2]) + ulp((1e-3 * gs * gs).float()) + ulp((1e-3 * gr * gr).float())
                       + ulp(fresh[2]) + 2e-3 * (gs.abs() + gr.abs()) * (l2 + ulp(gr.float())))
            for name, a, b, bound in (("master", got[0], fresh[0], bound_p), ("exp_avg", got[1], fresh[1], bound_m),
                                      ("exp_avg_sq", got[2], fresh[2], bound_v)):
                excess = float(((a.double() - b.double()).abs() / bound).max())
                assert excess <= 1.0, f"step {step}, scales {s1} -> {redo}: {name} at {excess:.2f}x its bound"


@needs_ext
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16], ids=["m32", "mbf16"])
def test_cpp_adam_copy_part_writes_the_steps_copy_and_nothing_else(moments):
    """adam_step(part="copy"): the 16-bit copy the full step writes, bit for bit, at every SIMD level, thread count
    and copy alignment, with param and moments left as they are (a step's weights first, its state after); the torch
    backend gives the same copy from copies of the state."""
    levels = K.build_info()["cpu_adam"]["simd_supported"]
    n = 70001
    p, m, v, g = _undo_case(n, torch.bfloat16, seed=3)
    m, v = m.to(moments), v.to(moments)
    for decoupled, scale in ((True, 1.0), (False, 3.0)):
        hyper = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                     decoupled_weight_decay=decoupled, grad_scale=scale)
        full = [t.clone() for t in (p, m, v)]
        want = torch.empty(n, dtype=torch.bfloat16)
        assert cpu_adam.adam_step(*full[:1], g, *full[1:], param_out=want, simd="scalar", **hyper)
        for level in levels:
            for threads, off in ((1, 0), (3, 1)):
                state = [t.clone() for t in (p, m, v)]
                out = torch.full((n + 1,), 7.0, dtype=torch.bfloat16)[off:off + n]
                assert cpu_adam.adam_step(*state[:1], g, *state[1:], param_out=out, simd=level, num_threads=threads,
                                          copy_only=True, **hyper)
                assert torch.equal(_bits(out), _bits(want)), (level, threads, off)
                assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(state, (p, m, v))), (level, threads)
        stepped, want_torch = [t.clone() for t in (p, m, v)], torch.empty(n, dtype=torch.bfloat16)
        K.adam_step(*stepped[:1], g, *stepped[1:], param_out=want_torch, backend="torch", **hyper)
        state, out = [t.clone() for t in (p, m, v)], torch.empty(n, dtype=torch.bfloat16)
        assert K.adam_step(*state[:1], g, *state[1:], param_out=out, part="copy", backend="torch", **hyper)
        assert torch.equal(_bits(out), _bits(want_torch))
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(state, (p, m, v)))
    with pytest.raises(ValueError, match="param_out"):
        K.adam_step(p.clone(), g, m.clone(), v.clone(), step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.0, part="copy")


@needs_ext
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_adam_rescale_never_drops_v_below_the_new_gradients_share(backend):
    """v1 a little below the guessed gradient's share (1-b2) gs^2 as the correction recomputes it (with L2 decay
    the grad's wd * p term is recomputed from p1 + u1, an ulp or so from the step's own; v1's rounding can also
    swamp b2 * v0): v1 - (1-b2) gs^2 is then negative. Clamped before the new gradient's share is added (as the
    undo's restored v0 is), v2 stays at least (1-b2) gr^2, so no update divides by eps alone and the master moves
    by at most the step size (Adam's |m / sqrt(v)| is about 1 here); clamped after the sum, v2 would be 0."""
    n = 4096
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(n, generator=gen) * 10.0
    hyper = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True)
    omb2 = torch.tensor(0.001, dtype=torch.float32)
    v = (omb2 * g) * g * (1 - 2.0 ** -20)              # below the guessed share by 2^-20 of it
    m = torch.tensor(0.1, dtype=torch.float32) * g      # a first moment as that grad leaves it
    p = torch.randn(n, generator=gen)
    before = p.clone()
    redo = 1e4                                          # (1-b2) gr^2 = 2^-26.6 of the guessed share: below the gap
    K.adam_rescale(p, g, m, v, grad_scale=1.0, redo_scale=redo, backend=backend, **hyper)
    gr = g / redo
    assert bool((v >= (omb2 * gr) * gr).all()) and bool((v > 0).all())
    step_size = hyper["lr"] / (1 - 0.9 ** 3)
    assert float((p - before).abs().max()) <= 3 * step_size
