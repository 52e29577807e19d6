"""Config(optimizer_state="int8"): blockwise 8-bit Adam moments (kernels/quant8.py), the step computed in fp32.

Kernels. The reference is kernels/torch_adam.adam_step_int8: plain torch doing the C++ kernel's arithmetic (its op
order, every coefficient rounded to fp32, sqrt and / through float64 rounded once: the IEEE result), the moments
dequantized as map[code] * absmax (one fp32 product) and quantized by comparing value / absmax (one IEEE
division) with the same fp32 thresholds. Products, quotients, square roots and comparisons have one IEEE answer,
and a block's max is the same whatever order it is taken in, so the C++ kernel (every SIMD level, any thread
count) and Triton (interpreted: numpy fp32) must equal it bit for bit.

The engine. Step 1 starts from zero moments, which int8 stores exactly, and the master is updated from the
unquantized moments, so step 1 gives fp32 state's bits. From then on the only difference is what quantization
took from the moments stored after each step: at most `quant8.resolution` of the block's absmax per element
(half the code's interval of the map). So (a) an int8 step equals an fp32-state step from the dequantized
moments bit for bit, its new moments being the quantized fp32 ones; (b) after step 2 each weight lies within the
bound that error gives through Adam's update, from the same gradient (the weights after step 1 are equal); (c)
the loss of step 3 lies within the first-order effect of that bound, sum |dL/dw| * bound. The fp32-state engine
is the comparison: it equals torch.optim.AdamW to 1e-5 (tests/test_engine.py), far inside these bounds.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import pstar_fx  # noqa: E402
from pstar_fx import Config  # noqa: E402
from pstar_fx.kernels import adam_step, adam_undo, cpu_adam, quant8  # noqa: E402
from test_bf16_state import HYPER, needs_ext, needs_triton, small_gpt  # noqa: E402  (the same marks, hyperparameters, model)

N = 4099   # 16 full blocks and a short one; not a multiple of any SIMD width: the scalar tails run too
OPT = {"type": "adamw", "lr": 3e-3, "weight_decay": 0.1}


# ---- the format -------------------------------------------------------------------------------------------

def test_the_dynamic_maps():
    for code, signed in ((quant8.SIGNED_MAP, True), (quant8.UNSIGNED_MAP, False)):
        assert code.numel() == 256 and code.dtype == torch.float32
        assert (code[1:] > code[:-1]).all() and code[-1] == 1.0 and (code == 0).sum() == 1
        assert ((code < 0).sum() == 127) == signed and ((code < 0).sum() == 0) != signed
        t = quant8.tables(signed)[1]
        assert ((code[:-1] < t[:-1]) & (t[:-1] < code[1:])).all() and t[-1] == math.inf
    assert quant8.SIGNED_MAP[quant8.SIGNED_ZERO] == 0 and quant8.UNSIGNED_MAP[quant8.UNSIGNED_ZERO] == 0
    pos = quant8.SIGNED_MAP[quant8.SIGNED_MAP > 0]
    assert math.isclose(pos.min(), 5.5e-7, rel_tol=1e-6)
    assert math.isclose(quant8.SIGNED_MAP[0], -0.99296875, rel_tol=1e-6)
    assert torch.equal(quant8.SIGNED_MAP[:127], -pos[:-1].flip(0))     # symmetric but for +1


def test_quantize_round_trip_is_within_the_maps_resolution():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10 * 256 + 77, generator=gen) * torch.logspace(-6, 2, 10 * 256 + 77)
    x[:256] = 0.0                             # an all-zero block
    x[300] = -1e3                             # a block whose largest |value| is negative (the map has no -1)
    x[600:900] = torch.rand(300, generator=gen) * 1e-30   # tiny values: quotients, not reciprocals
    for signed, values in ((True, x), (False, x.abs())):
        codes, absmax = quant8.quantize(values, signed)
        assert codes.dtype == torch.uint8 and absmax.numel() == quant8.blocks(values.numel())
        back = quant8.dequantize(codes, absmax, signed)
        scale = absmax.repeat_interleave(256)[: values.numel()]
        err = (back - values).abs()
        assert (err <= quant8.resolution(codes, signed) * scale).all()
        assert (back[:256] == 0).all()
        assert (err[300] / 1e3 - (1 + quant8.SIGNED_MAP[0] if signed else 0)).abs() < 1e-6
        # the resolution: half a step of the top decade (0.9/64 signed, 0.9/128 unsigned) at worst
        worst = quant8.resolution(torch.arange(256, dtype=torch.uint8), signed).max()
        assert math.isclose(worst, 0.9 / (128 if signed else 256), rel_tol=1e-4)
        assert torch.equal(quant8.quantize(back, signed)[0][:256], codes[:256])


# ---- the kernels ------------------------------------------------------------------------------------------

def state(n=N, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = 0.1 * torch.randn(n, generator=gen)
    v = 0.01 * torch.rand(n, generator=gen)
    m[:256], v[:256] = 0.0, 0.0                # a fresh block
    m[700] = -5.0                              # an outlier (negative) flattening its block
    mc, ma = quant8.quantize(m, signed=True)
    vc, va = quant8.quantize(v, signed=False)
    return p, mc, vc, ma, va


def grads(steps, n=N, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * 0.3 for _ in range(steps)]


def run(backend, steps=4, n=N, *, grad_dtype=torch.float32, grad_scale=1.0, decoupled=True, out_dtype=torch.bfloat16,
        **kw):
    p, mc, vc, ma, va = state(n)
    out = torch.empty(n, dtype=out_dtype)
    for t, g in enumerate(grads(steps, n), start=1):
        # "cpp" and "triton-launch": the backends' own entry points, which take their tuning knobs
        step = {"cpp": cpu_adam.adam_step, "triton-launch": _triton_step}.get(backend, adam_step)
        extra = {} if backend in ("cpp", "triton-launch") else dict(backend=backend)
        assert step(p, g.to(grad_dtype), mc, vc, step=t, grad_scale=grad_scale, decoupled_weight_decay=decoupled,
                    param_out=out, exp_avg_absmax=ma, exp_avg_sq_absmax=va, **HYPER, **extra, **kw)
    return p, mc, vc, ma, va, out


def _triton_step(*args, **kw):
    from pstar_fx.kernels import triton_adam
    return triton_adam.adam_step(*args, **kw)


def assert_equal(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


CASES = [(torch.float32, 1.0, True, torch.bfloat16), (torch.bfloat16, 1024.0, False, torch.float16),
         (torch.float16, 3.0, True, torch.bfloat16)]


@needs_ext
@pytest.mark.parametrize("simd", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("grad_dtype,grad_scale,decoupled,out_dtype", CASES)
def test_cpp_int8_moments_equal_the_reference_bit_for_bit(simd, grad_dtype, grad_scale, decoupled, out_dtype):
    if simd not in cpu_adam.extension().build_info()["simd_supported"]:
        pytest.skip(f"{simd} not supported here")
    kw = dict(grad_dtype=grad_dtype, grad_scale=grad_scale, decoupled=decoupled, out_dtype=out_dtype)
    ref = run("torch", **kw)
    assert_equal(run("cpp", simd=simd, **kw), ref)
    assert ref[1].dtype == ref[2].dtype == torch.uint8 and not torch.equal(ref[1], state()[1])


@needs_ext
@pytest.mark.parametrize("schedule", ["dynamic", "static"])
def test_cpp_int8_moments_on_several_threads_equal_the_reference(schedule):
    n = 3 * 65536 + 1000            # several 64K work blocks and a short quantization block at the end
    assert_equal(run("cpp", steps=2, n=n, schedule=schedule, num_threads=2), run("torch", steps=2, n=n))


@needs_ext
@pytest.mark.parametrize("simd", ["scalar", "avx2", "avx512"])
def test_cpp_int8_moments_read_and_write_every_code_as_the_reference_does(simd):
    """Every code of both maps read (each block holds all 256, so the AVX-512 level's lookup from registers meets
    each one in every lane position), and new moments spread over 8 decades of their block's absmax (so the
    quantization meets the buckets of every decade, where the AVX-512 level gathers a bucket's base and cut as one
    8-byte entry): the codes, scales, masters and 16-bit copies the reference writes, bit for bit."""
    if simd not in cpu_adam.extension().build_info()["simd_supported"]:
        pytest.skip(f"{simd} not supported here")
    blocks = 40
    n = blocks * quant8.BLOCK_ELEMS + 77
    gen = torch.Generator().manual_seed(3)
    codes = torch.arange(quant8.BLOCK_ELEMS, dtype=torch.uint8).repeat(blocks + 1)[:n]
    rolled = [torch.roll(codes, k * 17) for k in (1, 2)]            # the two moments' codes not aligned alike
    absmax = [torch.rand(quant8.blocks(n), generator=gen) + 0.05 for _ in range(2)]
    # gradients of a block span 1e-8..1 of each other: the new moments' ratios to the absmax, 8 decades
    g = torch.randn(n, generator=gen) * 10 ** (-8 * torch.rand(n, generator=gen))
    p0 = torch.randn(n, generator=gen)

    def one(backend, **kw):
        p, mc, vc = p0.clone(), rolled[0].clone(), rolled[1].clone()
        ma, va = absmax[0].clone(), absmax[1].clone()
        out = torch.empty(n, dtype=torch.bfloat16)
        for t in (3, 4):
            step = cpu_adam.adam_step if backend == "cpp" else adam_step
            extra = {} if backend == "cpp" else dict(backend=backend)
            assert step(p, g * t, mc, vc, step=t, grad_scale=1.0, decoupled_weight_decay=True, param_out=out,
                        exp_avg_absmax=ma, exp_avg_sq_absmax=va, **HYPER, **extra, **kw)
        return p, mc, vc, ma, va, out

    ref = one("torch")
    assert_equal(one("cpp", simd=simd), ref)
    assert len(torch.unique(ref[1])) > 200 and len(torch.unique(ref[2])) > 100     # the new codes spread wide


@needs_triton
def test_triton_int8_moments_equal_the_reference_bit_for_bit():
    for case in CASES[:2]:
        kw = dict(zip(("grad_dtype", "grad_scale", "decoupled", "out_dtype"), case))
        ref = run("torch", steps=3, **kw)
        assert_equal(run("triton", steps=3, **kw), ref)
        assert_equal(run("triton-launch", steps=3, block=1024, **kw), ref)   # 4 blocks per program, 5 programs


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpp", marks=needs_ext),
                                     pytest.param("triton", marks=needs_triton)])
def test_a_non_finite_grad_changes_no_int8_moment(backend):
    before = state()
    p, mc, vc, ma, va = (t.clone() for t in before)
    g = grads(1)[0]
    g[N // 2] = float("inf")
    assert adam_step(p, g, mc, vc, step=3, backend=backend, exp_avg_absmax=ma, exp_avg_sq_absmax=va,
                     **HYPER) is False
    assert_equal((p, mc, vc, ma, va), before)


def test_int8_moments_are_refused_where_they_do_not_fit():
    p, mc, vc, ma, va = state()
    g = grads(1)[0]
    with pytest.raises(ValueError, match="cannot be undone"):
        adam_undo(p, g, mc, vc, step=2, **HYPER)
    with pytest.raises(ValueError, match="need exp_avg_absmax"):
        adam_step(p, g, mc, vc, step=1, **HYPER)
    with pytest.raises(ValueError, match="need 17"):
        adam_step(p, g, mc, vc, step=1, exp_avg_absmax=ma[:-1], exp_avg_sq_absmax=va, **HYPER)
    with pytest.raises(ValueError, match="scales of uint8 moments"):
        adam_step(p, g, torch.zeros(N), torch.zeros(N), step=1, exp_avg_absmax=ma, exp_avg_sq_absmax=va, **HYPER)
    with pytest.raises(ValueError, match="cannot be undone"):
        Config(optimizer_state="int8", transaction="kept_grads")
    with pytest.raises(ValueError, match="int8 moments.*cannot be undone"):
        Config(optimizer_state="int8", transaction="replay")


# ---- config, plan -----------------------------------------------------------------------------------------

def test_plan_counts_int8_state_exactly_and_picks_an_exact_transaction():
    model, inputs = small_gpt()
    cfg = {"device": "cpu", "chunk_size": 16384, "placement": "device", "optimizer_state": "int8"}
    assert Config(optimizer_state="int8").state_bytes_per_param == 6 + 8 / 256
    plan = pstar_fx.plan(model, Config.from_dict(cfg), inputs)
    engine = pstar_fx.compile(model, cfg, inputs)
    layout, store = engine.lowered.layout, engine.rt.store
    blocks = [quant8.blocks_of(ch.param_spans()) for ch in layout.chunks]
    assert [t.numel() for t in store.exp_avg_absmax] == blocks
    assert plan.device_breakdown["chunk state"] == len(blocks) * (16384 * 6 + 8 * max(blocks))
    assert "chunk state: 6.03 B/param (fp32 master + int8 exp_avg and exp_avg_sq, an fp32 scale per 256" \
        in plan.summary()
    assert plan.transaction == "deferred"
    engine.step(*inputs)
    assert engine.memory_stats()["device_peak_bytes"] <= engine.plan.device_peak_bytes


def test_the_plan_times_the_host_adam_at_the_rate_of_its_moments():
    """The host Adam's seconds in the estimate are at the rate measured for the configured moments (int8's
    (de)quantization makes it several times slower than fp32's), not at fp32's."""
    from pstar_fx.planning.costs import assumed
    from pstar_fx.pipeline.lower import Lowered
    model, inputs = small_gpt()
    cfg = Config.from_dict({"device": "cpu", "chunk_size": 16384, "placement": "host", "optimizer_state": "int8"})
    with assumed(host_adam=1e9, host_adam_int8=1e9):
        lowered = Lowered(model, cfg, inputs)
    with assumed(host_adam=1e9, host_adam_int8=1e8):
        slow = pstar_fx.plan(model, cfg, inputs)
    updated = sum(ch.used_elems for c, ch in enumerate(lowered.layout.chunks)
                  if ch.grad_spans() and lowered.plan.placement[c] == "host")
    assert updated > 0
    extra = slow.estimated_step_seconds - lowered.plan.estimated_step_seconds
    assert math.isclose(extra, updated * (1 / 1e8 - 1 / 1e9), rel_tol=1e-6), (extra, updated)


# ---- the engine -------------------------------------------------------------------------------------------

def compile_gpt(state_mode, placement="device", chunk_size=16384, resume=None):
    model, inputs = small_gpt()
    cfg = {"device": "cpu", "chunk_size": chunk_size, "placement": placement, "optimizer": OPT,
           "optimizer_state": state_mode}
    return pstar_fx.compile(model, cfg, inputs, resume=resume), inputs


def moments(engine, fp32=False):
    """name.key -> the moment as the chunks hold it (int8: (codes, absmax)), or its fp32 values."""
    store, out = engine.rt.store, {}
    for i, p in enumerate(engine.lowered.capture.params):
        if p.has_grad:
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{p.name}.{key}"] = (store.moment_fp32(i, key).clone() if fp32 else
                                          (store.moment(i, key).clone(), store.moment_absmax(i, key).clone())
                                          if store.quantized else store.moment(i, key).clone())
    return out


@pytest.mark.parametrize("placement", ["device", "host"])
def test_an_int8_step_is_an_fp32_step_from_the_dequantized_moments(placement, tmp_path):
    int8, inputs = compile_gpt("int8", placement)
    int8.step(*inputs)
    for k in range(2):
        int8.save(tmp_path / f"s{k}")
        fp32, _ = compile_gpt("fp32", placement, resume=tmp_path / f"s{k}")   # loads the dequantized moments
        assert int8.step(*inputs).item() == fp32.step(*inputs).item()
        w8, w32 = int8.state_dict(), fp32.state_dict()
        assert all(torch.equal(w8[n], w32[n]) for n in w32)
        quantized, exact = moments(int8), moments(fp32)
        for name, (codes, absmax) in quantized.items():
            expect = quant8.quantize(exact[name].reshape(-1), signed=name.endswith("exp_avg"))
            assert torch.equal(codes.reshape(-1), expect[0]) and torch.equal(absmax, expect[1]), name


def test_int8_state_trains_within_the_bound_its_quantization_gives():
    int8, inputs = compile_gpt("int8")
    fp32, _ = compile_gpt("fp32")
    b1, b2 = 0.9, 0.999
    assert int8.step(*inputs).item() == fp32.step(*inputs).item()
    assert all(torch.equal(a, b) for a, b in zip(int8.state_dict().values(), fp32.state_dict().values()))
    # what quantizing the step-1 moments may have taken from each element
    store = int8.rt.store
    lost = {}
    for i, p in enumerate(int8.lowered.capture.params):
        if p.has_grad:
            for key in ("exp_avg", "exp_avg_sq"):
                codes, absmax = store.moment(i, key).reshape(-1), store.moment_absmax(i, key)
                lost[f"{p.name}.{key}"] = (quant8.resolution(codes, key == "exp_avg")
                                           * absmax.repeat_interleave(256)[: codes.numel()]).view(p.shape)
    assert int8.step(*inputs).item() == fp32.step(*inputs).item()         # the same weights: the same loss
    exact = moments(fp32)
    step_size, c, eps = OPT["lr"] / (1 - b1 ** 2), 1 / math.sqrt(1 - b2 ** 2), 1e-8
    w8, w32 = int8.state_dict(), fp32.state_dict()
    bound, diff = {}, {}
    for name, w in w32.items():
        if f"{name}.exp_avg" not in exact:
            continue
        m, v = exact[f"{name}.exp_avg"].double(), exact[f"{name}.exp_avg_sq"].double()
        dm = b1 * lost[f"{name}.exp_avg"].double() + 2 ** -22 * m.abs()      # + the sums' roundings
        dv = b2 * lost[f"{name}.exp_avg_sq"].double() + 2 ** -22 * v
        f = lambda mm, vv: mm / (vv.clamp_min(0).sqrt() * c + eps)  # noqa: E731 - the update's shape
        centre = f(m, v)
        worst = torch.stack([(f(m + sm * dm, v + sv * dv) - centre).abs() for sm in (-1, 1) for sv in (-1, 1)])
        bound[name] = step_size * worst.amax(0) + 2 ** -20 * (w.double().abs() + step_size * centre.abs())
        diff[name] = (w8[name].double() - w.double()).abs()
        assert (diff[name] <= bound[name]).all(), name
    assert any(d.max() > 0 for d in diff.values())                       # quantization did change something
    # step 3's loss: within the first-order effect of the bound, sum |dL/dw| * bound, dL/dw at fp32's weights
    model, _ = small_gpt()
    model.load_state_dict(w32)
    model.zero_grad()
    model(*inputs).backward()
    first_order = sum(float((p.grad.double().abs() * bound[n]).sum()) for n, p in model.named_parameters()
                      if n in bound)
    gap = abs(int8.step(*inputs).item() - fp32.step(*inputs).item())
    assert 0 < gap <= first_order, (gap, first_order)


@pytest.mark.parametrize("placement", ["device", "host"])
def test_an_int8_checkpoint_resumes_bit_for_bit_at_another_chunk_size(placement, tmp_path):
    a, inputs = compile_gpt("int8", placement)
    for _ in range(2):
        a.step(*inputs)
    a.save(tmp_path / "ckpt")
    losses_a = [a.step(*inputs).item() for _ in range(2)]
    b, _ = compile_gpt("int8", placement, chunk_size=32768, resume=tmp_path / "ckpt")
    assert len(b.lowered.layout.chunks) != len(a.lowered.layout.chunks)
    losses_b = [b.step(*inputs).item() for _ in range(2)]
    assert losses_a == losses_b and b.steps == a.steps == 4
    wa, wb = a.state_dict(), b.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    ma, mb = moments(a), moments(b)
    assert all(torch.equal(ma[k][0], mb[k][0]) and torch.equal(ma[k][1], mb[k][1]) for k in ma)


def test_an_fp32_checkpoint_loads_quantized_into_int8_state(tmp_path):
    fp32, inputs = compile_gpt("fp32")
    for _ in range(2):
        fp32.step(*inputs)
    fp32.save(tmp_path / "f")
    int8, _ = compile_gpt("int8", resume=tmp_path / "f")
    exact, quantized = moments(fp32), moments(int8)
    for name, (codes, absmax) in quantized.items():
        expect = quant8.quantize(exact[name].reshape(-1), signed=name.endswith("exp_avg"))
        assert torch.equal(codes.reshape(-1), expect[0]) and torch.equal(absmax, expect[1]), name
    assert int8.steps == 2 and all(torch.equal(a, b) for a, b in zip(int8.state_dict().values(),
                                                                    fp32.state_dict().values()))


@pytest.mark.parametrize("placement,transaction", [("device", "deferred"), ("host", "two_pass")])
def test_a_skipped_step_with_int8_moments_changes_nothing(placement, transaction):
    from test_transaction import Regression, regression_batches
    torch.manual_seed(0)
    batches = regression_batches(3, overflow_at=(1,))
    engine = pstar_fx.compile(Regression(), {"device": "cpu", "placement": placement, "chunk_size": 4096,
                                             "optimizer": OPT, "optimizer_state": "int8", "grad_clip": 1.0,
                                             "transaction": transaction}, batches[0])
    assert engine.plan.transaction == transaction and engine.rt.store.exp_avg[0].dtype == torch.uint8
    engine.step(*batches[0])
    before, st = engine.state_dict(), moments(engine)
    with pytest.warns(RuntimeWarning, match="skipped"):
        engine.step(*batches[1])
    assert engine.last_step.skipped and engine.steps == 1
    after = engine.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(moments(engine).values(),
                                                                                  st.values()))
    engine.step(*batches[2])
    assert engine.steps == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_int8_moments_on_the_gpu_agree_with_the_cpu():
    """On the GPU Triton may fuse multiply-adds: the master within a few fp32 ulps of the update, and a code
    off by one only where the value lies within rounding of a threshold."""
    cpu = run("torch", steps=3)
    p, mc, vc, ma, va = (t.cuda() for t in state())
    out = torch.empty(N, dtype=torch.bfloat16, device="cuda")
    for t, g in enumerate(grads(3), start=1):
        assert adam_step(p, g.cuda(), mc, vc, step=t, param_out=out, exp_avg_absmax=ma, exp_avg_sq_absmax=va,
                         decoupled_weight_decay=True, **HYPER)
    assert torch.allclose(p.cpu(), cpu[0], rtol=1e-5, atol=1e-6)
    for a, b in ((mc, cpu[1]), (vc, cpu[2])):
        off = (a.cpu().int() - b.int()).abs()
        assert off.max() <= 1 and (off > 0).float().mean() < 0.01
