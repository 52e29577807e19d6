"""Config(optimizer_state="bf16"): Adam moments stored in bf16, the step computed in fp32.

The reference is plain torch doing the kernels' arithmetic on fp32 tensors (the C++ kernel's op order:
m = b1*m + (1-b1)*g, v = b2*v + ((1-b2)*g)*g, denom = sqrt(v) * (1/sqrt(1-b2^t)) + eps,
p -= lr/(1-b1^t) * (m / denom), every coefficient rounded to fp32, sqrt and / IEEE-rounded), the moments
then rounded to bf16 by
.to(torch.bfloat16) after each step. IEEE fp32 ops in the same order give the same bits, so the C++ kernel
(every SIMD level) and Triton (interpreted, numpy fp32) must equal it bit for bit.

The torch backend follows torch.optim.AdamW's order instead (lerp, addcmul, division by sqrt(1-b2^t)):
its fp32 moments differ from the reference's by a few fp32 ulps (2^-23 relative each), far less than a bf16
ulp (2^-7 relative); two fp32 values that close round to the same bf16 value or to neighbours, so from
one state its moments are within one bf16 ulp of the reference's, and its master within a few fp32 ulps
of the update (the update term's relative error is about 4 fp32 ulps, plus what the one-ulp moment gives
through m / sqrt(v): at most 2^-7 + 2^-8 relative of the update)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import math  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import pstar_fx  # noqa: E402
from pstar_fx import Config  # noqa: E402
from pstar_fx.kernels import adam_step, adam_undo, cpu_adam  # noqa: E402

try:
    import triton  # noqa: F401
    HAS_TRITON = os.environ.get("TRITON_INTERPRET") == "1"
except ImportError:
    HAS_TRITON = False

needs_ext = pytest.mark.skipif(not cpu_adam.available(), reason="C++ extension not built")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton with TRITON_INTERPRET=1")
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
N = 4099   # not a multiple of any SIMD width: the scalar tail runs too


def f32(x):
    return torch.tensor(float(np.float32(x)), dtype=torch.float32)


def reference_step(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, grad_scale=1.0, decoupled=True):
    """fp32 math in the kernels' order from bf16 moments; returns (p, m, v) with m, v rounded to bf16."""
    g = g.float()
    if grad_scale != 1.0:
        g = g / f32(grad_scale)
    m, v = m.float(), v.float()
    if decoupled:
        p = p * f32(1.0 - lr * weight_decay)
    else:
        g = g + f32(weight_decay) * p
    m = f32(beta1) * m + f32(1.0 - beta1) * g
    v = f32(beta2) * v + (f32(1.0 - beta2) * g) * g
    # sqrt and / in float64, rounded once to fp32: the IEEE-rounded result (53 >= 2 * 24 + 2 bits: no double
    # rounding error), which torch's own vectorized fp32 sqrt on CPU misses by an ulp now and then
    denom = torch.sqrt(v.double()).float() * f32(1.0 / math.sqrt(1.0 - beta2 ** step)) + f32(eps)
    p = p - f32(lr / (1.0 - beta1 ** step)) * (m.double() / denom.double()).float()
    return p, m.to(torch.bfloat16), v.to(torch.bfloat16)


def state(seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(N, generator=gen)
    m = (0.1 * torch.randn(N, generator=gen)).to(torch.bfloat16)
    v = (0.01 * torch.rand(N, generator=gen)).to(torch.bfloat16)
    return p, m, v


def grads(steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=gen) * 0.3 for _ in range(steps)]


def bf16_ulp(x):
    a = x.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def run_backend(backend, steps=5, *, grad_dtype=torch.float32, grad_scale=1.0, decoupled=True, **kw):
    p, m, v = state()
    out = torch.empty(N, dtype=torch.bfloat16)
    for t, g in enumerate(grads(steps), start=1):
        assert adam_step(p, g.to(grad_dtype), m, v, step=t, grad_scale=grad_scale, decoupled_weight_decay=decoupled,
                         param_out=out, backend=backend, **HYPER, **kw)
    return p, m, v, out


def run_reference(steps=5, *, grad_dtype=torch.float32, grad_scale=1.0, decoupled=True):
    p, m, v = state()
    for t, g in enumerate(grads(steps), start=1):
        p, m, v = reference_step(p, g.to(grad_dtype), m, v, step=t, grad_scale=grad_scale, decoupled=decoupled,
                                 **HYPER)
    return p, m, v


@needs_ext
@pytest.mark.parametrize("simd", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("grad_dtype,grad_scale,decoupled", [(torch.float32, 1.0, True), (torch.bfloat16, 1024.0, False),
                                                             (torch.float16, 3.0, True)])
@pytest.mark.parametrize("out_dtype,offset", [(torch.bfloat16, 0), (torch.float16, 0), (torch.bfloat16, 3)])
def test_cpp_bf16_moments_equal_the_reference_bit_for_bit(simd, grad_dtype, grad_scale, decoupled, out_dtype, offset):
    """The 16-bit copy written (non-temporal stores from its first vector-aligned element, cpu_adam.STORES) as the
    reference rounds it, bf16 or fp16; `offset`: every tensor a view starting that many elements into its buffer, as
    a parameter's span inside a chunk is."""
    if simd != "scalar":
        try:
            cpu_adam.adam_step(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), step=1, param_out=None,
                               grad_scale=1.0, decoupled_weight_decay=True, simd=simd, **HYPER)
        except ValueError:
            pytest.skip(f"{simd} not supported here")
    p, m, v = (torch.cat([torch.zeros(offset, dtype=x.dtype), x])[offset:] for x in state())
    out = torch.empty(N + offset, dtype=out_dtype)[offset:]
    for t, g in enumerate(grads(5), start=1):
        assert cpu_adam.adam_step(p, g.to(grad_dtype), m, v, step=t, grad_scale=grad_scale, param_out=out,
                                  decoupled_weight_decay=decoupled, simd=simd, **HYPER)
    rp, rm, rv = run_reference(grad_dtype=grad_dtype, grad_scale=grad_scale, decoupled=decoupled)
    assert m.dtype == v.dtype == torch.bfloat16
    assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)
    assert torch.equal(out, rp.to(out_dtype))


@needs_triton
@needs_ext
def test_triton_and_cpp_bf16_moments_agree_bit_for_bit():
    tp, tm, tv, tout = run_backend("triton", grad_dtype=torch.bfloat16, grad_scale=1024.0, decoupled=False)
    cp, cm, cv, cout = run_backend("cpp", grad_dtype=torch.bfloat16, grad_scale=1024.0, decoupled=False)
    rp, rm, rv = run_reference(grad_dtype=torch.bfloat16, grad_scale=1024.0, decoupled=False)
    for a, b, r in ((tp, cp, rp), (tm, cm, rm), (tv, cv, rv), (tout, cout, rp.to(torch.bfloat16))):
        assert torch.equal(a, b) and torch.equal(a, r)


def test_torch_backend_bf16_moments_within_one_bf16_ulp_of_the_reference():
    p0, m0, v0 = state()
    g = grads(1)[0]
    for t in (1, 7):
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        assert adam_step(p, g, m, v, step=t, backend="torch", param_out=None, **HYPER)
        rp, rm, rv = reference_step(p0, g, m0, v0, step=t, **HYPER)
        assert m.dtype == v.dtype == torch.bfloat16
        for a, r in ((m, rm), (v, rv)):
            assert ((a.float() - r.float()).abs() <= bf16_ulp(r)).all()
        update = (rp - p0 * f32(1.0 - HYPER["lr"] * HYPER["weight_decay"])).abs()
        assert ((p - rp).abs() <= update * (2.0 ** -7 + 2.0 ** -8) + 4 * 2.0 ** -23 * rp.abs()).all()


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpp", marks=needs_ext),
                                     pytest.param("triton", marks=needs_triton)])
def test_a_non_finite_grad_changes_no_bf16_moment(backend):
    p, m, v = state()
    g = grads(1)[0]
    g[N // 2] = float("nan")
    before = [t.clone() for t in (p, m, v)]
    assert adam_step(p, g, m, v, step=3, backend=backend, **HYPER) is False
    assert all(torch.equal(a, b) for a, b in zip((p, m, v), before))


def test_bf16_moments_cannot_be_undone():
    p, m, v = state()
    with pytest.raises(ValueError, match="cannot be undone"):
        adam_undo(p, grads(1)[0], m, v, step=2, **HYPER)


# ---- config, plan ----------------------------------------------------------------------------------------

def test_an_unknown_state_and_undo_transactions_are_refused():
    with pytest.raises(ValueError, match="is not one of"):
        Config(optimizer_state="fp16")
    for tx in ("kept_grads", "replay"):
        with pytest.raises(ValueError, match="cannot be undone"):
            Config(optimizer_state="bf16", transaction=tx)
    assert Config().state_bytes_per_param == 12 and Config(optimizer_state="bf16").state_bytes_per_param == 8


def small_gpt():
    from pstar_fx.models import GPT, gpt_config
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
    return model, (idx, torch.roll(idx, -1, 1))


def test_plan_counts_8_bytes_per_param_and_picks_an_exact_transaction():
    model, inputs = small_gpt()
    cfg = {"device": "cpu", "chunk_size": 16384, "placement": "device"}
    fp32 = pstar_fx.plan(model, Config.from_dict(cfg), inputs)
    bf16 = pstar_fx.plan(model, Config.from_dict({**cfg, "optimizer_state": "bf16", "grad_clip": 1.0}), inputs)
    n_chunks = len(fp32.placement)
    assert fp32.device_breakdown["chunk state"] == n_chunks * 16384 * 12
    assert bf16.device_breakdown["chunk state"] == n_chunks * 16384 * 8
    assert bf16.state_bytes_per_param == 8 and "chunk state: 8 B/param" in bf16.summary()
    assert "chunk state: 12 B/param" in fp32.summary()
    assert bf16.transaction == "deferred"                   # the host holds the kept gradients
    tight = pstar_fx.plan(model, Config.from_dict({**cfg, "optimizer_state": "bf16", "grad_clip": 1.0,
                                                   "placement": "host", "host_memory": bf16.host_peak_bytes
                                                   + n_chunks * 16384 * 8 + 2 * 16384 * 4}), inputs)
    assert tight.transaction == "two_pass", tight.summary()   # it does not: measure first


def test_deferred_keeps_each_host_chunk_s_gradient_in_its_shadow():
    """16-bit compute, deferred: a host chunk's kept gradient and its 16-bit shadow share one buffer, so at the
    host memory of the state and the kept gradients alone every host chunk still crosses in 16 bits (before,
    the shadows came on top, as room allowed, and the rest crossed as fp32 or were cast on the host)."""
    model, inputs = small_gpt()
    cfg = {"device": "cpu", "chunk_size": 16384, "placement": "host", "dtype": "bf16", "optimizer_state": "bf16"}
    roomy = pstar_fx.plan(model, Config.from_dict(cfg), inputs)
    n = len(roomy.placement)
    assert roomy.transaction == "deferred" and roomy.kept_in_shadow and roomy.ship == ["shadow"] * n
    assert roomy.host_breakdown["16-bit shadows"] == 0 and roomy.host_breakdown["kept gradients"] == n * 16384 * 2
    assert "in its 16-bit shadow" in roomy.transaction_cost
    # (the CPU runtime holds one chunk of 16-bit cast staging back when it checks that the kept gradients fit)
    tight = pstar_fx.plan(model, Config.from_dict({**cfg, "host_memory": roomy.host_peak_bytes + 16384 * 2}),
                          inputs)
    assert tight.transaction == "deferred" and tight.ship == ["shadow"] * n and not tight.why
    fp32 = pstar_fx.plan(model, Config.from_dict({**cfg, "dtype": "fp32"}), inputs)   # fp32 ships its masters
    assert fp32.transaction == "deferred" and not fp32.kept_in_shadow


# ---- the engine: a skipped step, checkpoints -------------------------------------------------------------

def state_of(engine):
    store = engine.rt.store
    return [t.clone() for c in range(len(store.master)) for t in (store.master[c], store.exp_avg[c],
                                                                   store.exp_avg_sq[c])]


def assert_shadows_are_masters(engine):
    """Every 16-bit shadow holds its master's weights, rounded (not a kept gradient)."""
    store = engine.rt.store
    for c, shadow in store.shadow.items():
        assert torch.equal(shadow, store.master[c].to(shadow.dtype)), c


@pytest.mark.parametrize("transaction", ["deferred", "two_pass"])
@pytest.mark.parametrize("placement,dtype", [("device", "fp32"), ("host", "fp32"), ("host", "bf16")])
def test_a_skipped_step_with_bf16_moments_changes_nothing(placement, dtype, transaction):
    """(bf16 compute, host chunks, deferred: each host chunk's gradient lands in its 16-bit shadow; after the
    skip the shadows hold the weights again.)"""
    from test_transaction import OPT, Regression, regression_batches
    torch.manual_seed(0)
    model = Regression()
    batches = regression_batches(3, overflow_at=(1,))
    engine = pstar_fx.compile(model, {"device": "cpu", "placement": placement, "chunk_size": 4096, "optimizer": OPT,
                                      "optimizer_state": "bf16", "grad_clip": 1.0, "transaction": transaction,
                                      "dtype": dtype}, batches[0])
    assert engine.plan.kept_in_shadow == (dtype == "bf16" and transaction == "deferred")
    assert engine.plan.transaction == transaction and engine.rt.store.exp_avg[0].dtype == torch.bfloat16
    engine.step(*batches[0])
    before, st = engine.state_dict(), state_of(engine)
    with pytest.warns(RuntimeWarning, match="skipped"):
        engine.step(*batches[1])
    assert engine.last_step.skipped and engine.steps == 1
    after = engine.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(torch.equal(a, b) for a, b in zip(state_of(engine), st))
    assert_shadows_are_masters(engine)
    engine.step(*batches[2])
    assert engine.steps == 2
    assert_shadows_are_masters(engine)


@pytest.mark.parametrize("placement,dtype", [("device", "fp32"), ("host", "fp32"), ("host", "bf16")])
def test_deferred_updates_equal_two_passes_bit_for_bit(placement, dtype):
    """Both apply every update after the verdict, from the same gradients: the same bits, at half the compute.
    bf16 compute on the host: deferred keeps each host chunk's gradient in its 16-bit shadow, where the host Adam
    writes the new weights."""
    from test_transaction import OPT, gpt_batches, tiny_gpt
    batches = gpt_batches(4)
    runs = []
    for transaction in ("deferred", "two_pass"):
        engine = pstar_fx.compile(tiny_gpt(), {"device": "cpu", "placement": placement, "chunk_size": 16384,
                                               "optimizer": OPT, "optimizer_state": "bf16", "grad_clip": 0.05,
                                               "transaction": transaction, "dtype": dtype}, batches[0])
        in_shadow = dtype == "bf16" and transaction == "deferred"
        assert engine.plan.kept_in_shadow == in_shadow
        up, store = engine.rt.updater, engine.rt.store
        assert in_shadow == (len(store.shadow) > 0 and all(up.kept.get(c) is store.shadow[c] for c in store.shadow))
        reports = []
        for b in batches:
            engine.step(*b)
            reports.append((engine.last_step.loss, engine.last_step.grad_norm, engine.last_step.clip_coef))
        assert_shadows_are_masters(engine)
        runs.append((reports, engine.state_dict(), state_of(engine)))
    assert runs[0][0] == runs[1][0] and all(r[2] < 1 for r in runs[0][0])      # clipping triggered every step
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))


def test_an_interrupted_deferred_step_gives_the_shadows_their_weights_back(monkeypatch):
    """bf16 compute, host chunks, deferred: an exception in backward after some host chunks' gradients landed in
    their shadows changes nothing (the shadows are cast from their masters again), and the run goes on to equal
    an uninterrupted one bit for bit."""
    from test_transaction import OPT, Boom, gpt_batches, interrupt, tiny_gpt
    batches = gpt_batches(3)
    cfg = {"device": "cpu", "placement": "host", "chunk_size": 16384, "optimizer": OPT, "optimizer_state": "bf16",
           "dtype": "bf16", "transaction": "deferred"}
    ref = pstar_fx.compile(tiny_gpt(), cfg, batches[0])
    for b in batches:
        ref.step(*b)
    engine = pstar_fx.compile(tiny_gpt(), cfg, batches[0])
    assert engine.plan.kept_in_shadow and len(engine.plan.placement) > 3
    engine.step(*batches[0])
    state = state_of(engine)
    with monkeypatch.context() as m:
        interrupt(m, engine, "backward", at=3)        # two chunks' gradients are in their shadows by then
        with pytest.raises(Boom):
            engine.step(*batches[1])
    assert all(torch.equal(a, b) for a, b in zip(state_of(engine), state)) and engine.steps == 1
    assert_shadows_are_masters(engine)
    for b in batches[1:]:
        engine.step(*b)
    assert all(torch.equal(a, b) for a, b in zip(state_of(engine), state_of(ref)))


def test_checkpoint_moves_between_fp32_and_bf16_state(tmp_path):
    from test_checkpoint import moments_by_name
    model, inputs = small_gpt()
    cfg = {"device": "cpu", "chunk_size": 16384, "optimizer": {"type": "adamw", "lr": 3e-3}}
    fp32 = pstar_fx.compile(model, cfg, inputs)
    for _ in range(2):
        fp32.step(*inputs)
    fp32.save(tmp_path / "a")
    bf16 = pstar_fx.compile(model, {**cfg, "optimizer_state": "bf16"}, inputs, resume=tmp_path / "a")
    m32, m16 = moments_by_name(fp32), moments_by_name(bf16)
    assert m16.keys() == m32.keys()
    for k in m32:   # loaded rounded to nearest even
        assert m16[k].dtype == torch.bfloat16 and torch.equal(m16[k], m32[k].to(torch.bfloat16)), k
    w32, w16 = fp32.state_dict(), bf16.state_dict()
    assert all(torch.equal(w32[k], w16[k]) for k in w32)
    bf16.step(*inputs)
    bf16.save(tmp_path / "b")
    back = pstar_fx.compile(model, cfg, inputs, resume=tmp_path / "b")
    mb, m16 = moments_by_name(back), moments_by_name(bf16)
    for k in m16:   # saved as fp32 (exact), loaded into fp32 state
        assert mb[k].dtype == torch.float32 and torch.equal(mb[k], m16[k].float()), k
    wb, w16 = back.state_dict(), bf16.state_dict()
    assert all(torch.equal(wb[k], w16[k]) for k in w16)
    assert back.steps == bf16.steps == 3
