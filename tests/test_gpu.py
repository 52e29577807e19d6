"""On the GPU machine: the CUDA runtime against the CPU fp32 reference, and the plan against the allocator."""
import copy

import pytest
import torch

import pstar_fx
from pstar_fx.models import GPT, gpt_config
from pstar_fx.planning.memory import usable_budget
from pstar_fx.runtime import StepRolledBack
from test_transaction import OPT, gpt_batches, hf_cosine, optimizer_state, reference, step_clock

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def regions_traced_not_compiled(request, monkeypatch):
    """compute "auto" is Inductor on CUDA: these tests trace its regions with Dynamo alone (the same ops, fast to
    build), so the runtime is tested on the graph it runs; tests marked `inductor` build the real kernels."""
    if "inductor" not in request.keywords:
        import sys
        import pstar_fx.passes.compile_regions  # noqa: F401
        monkeypatch.setattr(sys.modules["pstar_fx.passes.compile_regions"], "BACKEND", "eager")


def _batches(n, vocab=256, b=4, t=64):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g))
            for _ in range(n)]


def test_bf16_on_gpu_tracks_cpu_fp32_reference_with_host_offload():
    torch.manual_seed(0)
    model = GPT(gpt_config("small"))
    ref = copy.deepcopy(model)
    batches = _batches(20)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_losses = []
    for idx, tgt in batches:
        opt.zero_grad()
        loss = ref(idx, tgt)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    engine = pstar_fx.compile(model, {"device": "cuda", "dtype": "bf16", "placement": "host",
                                      "optimizer": {"lr": 1e-3}}, batches[0])
    losses = [engine.step(idx.cuda(), tgt.cuda()).item() for idx, tgt in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=3e-2, atol=0)
    stats = engine.memory_stats()
    assert stats["h2d_bytes"] > 0 and stats["d2h_bytes"] > 0
    phases = engine.rt.timing()
    assert set(phases) == {"compute_waits_for_copies", "host_adam", "wait_for_host_grad_buffer", "wait_for_host_adam",
                           "correction", "gpu_idle_for_host_grad_buffer", "gpu_idle_for_host_adam"}
    assert phases["host_adam"] > 0 and all(v >= 0 for v in phases.values())
    # the GPU's idle time a host wait caused is part of that wait (launch latency aside)
    assert phases["gpu_idle_for_host_grad_buffer"] <= phases["wait_for_host_grad_buffer"] + 1e-3
    assert phases["gpu_idle_for_host_adam"] <= phases["wait_for_host_adam"] + 1e-3


@pytest.mark.parametrize("placement", ["device", "host"])
def test_plan_predicts_gpu_peak_within_10_percent(placement):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(gpt_config("GPT2small", block_size=512))
    idx = torch.randint(0, 50304, (8, 512), device="cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine = pstar_fx.compile(model, {"device": "cuda", "dtype": "bf16", "placement": placement}, (idx, idx))
    for _ in range(3):
        engine.step(idx, idx)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    predicted = engine.plan.device_peak_bytes
    assert abs(measured - predicted) <= 0.10 * predicted, (measured, predicted)


# ---- the step as a transaction on CUDA: Triton Adam on device chunks, C++ Adam on the worker for host chunks ----

def _mixed(model, inputs, device_chunks=4, extra_bytes=0, **cfg):
    """A CUDA engine with `device_chunks` chunks' state on the GPU and the rest on the host (and `extra_bytes` of
    room beside them)."""
    base = dict(device="cuda", chunk_size=16384, optimizer=dict(OPT), **cfg)
    probe = pstar_fx.plan(model, dict(base, placement="host"), inputs)
    want = probe.device_peak_bytes + device_chunks * 12 * 16384 + extra_bytes   # usable: a 1/64 reserve comes off
    budget = next(b for b in range(want, 2 * want, max(1, want // 4096)) if usable_budget(b, True) >= want)
    engine = pstar_fx.compile(model, dict(base, device_memory=budget), inputs)
    assert "device" in engine.plan.placement and "host" in engine.plan.placement, engine.plan.placement
    return engine


def _mixed_like(model, inputs, placement, **cfg):
    """A CUDA engine whose chunks sit on the tiers of `placement` (another engine's): the Adam of each chunk runs
    on the same tier in both, so two transactions can be compared bit for bit (the Triton and the C++ Adam round
    differently). The smallest budget that gives `placement`, by bisection."""
    base = dict(device="cuda", chunk_size=16384, optimizer=dict(OPT), **cfg)
    n = placement.count("device")
    lo = pstar_fx.plan(model, dict(base, placement="host"), inputs).device_peak_bytes
    hi = 4 * pstar_fx.plan(model, dict(base, placement="device"), inputs).device_peak_bytes
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        if pstar_fx.plan(model, dict(base, device_memory=mid), inputs).placement.count("device") >= n:
            hi = mid
        else:
            lo = mid
    engine = pstar_fx.compile(model, dict(base, device_memory=hi), inputs)
    assert engine.plan.placement == placement, (engine.plan.placement, placement)
    return engine


def _on_gpu(b):
    return tuple(x.cuda() for x in b)


def _run_gpu(engine, batches):
    reports = []
    for b in batches:
        engine.step(*_on_gpu(b))
        reports.append(engine.last_step)
    return reports


def _close_to_reference(engine, reports, ref, ref_out, rel=1e-4):
    """GPU fp32 against the CPU reference: the same arithmetic, other kernels (a few ulps per op)."""
    from test_engine import assert_weights_close
    torch.testing.assert_close(torch.tensor([r.loss for r in reports]), torch.tensor([o[0] for o in ref_out]),
                               rtol=rel, atol=0)
    for r, o in zip(reports, ref_out):
        assert r.skipped == o[2] and r.lr == pytest.approx(o[3]) and r.loss_scale == o[4]
        assert r.skipped or r.grad_norm == pytest.approx(o[1], rel=rel)
    assert_weights_close(engine.state_dict(), ref, rel, per_tensor=False)



@pytest.mark.parametrize("compute", ["traced", pytest.param("inductor", marks=pytest.mark.inductor)])
@pytest.mark.parametrize("transaction", ["kept_grads", "deferred", "replay"])
def test_gpu_clipping_and_schedule_match_torch_fp32(transaction, compute):
    """Chunks on both tiers, clipping that triggers, a cosine schedule: the CPU reference. `inductor`: the regions
    with Inductor's kernels (the others trace them with Dynamo alone)."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    batches = gpt_batches(8)
    _, _, free = reference(model, batches)
    clip = sorted(o[1] for o in free)[4]
    ref, _, ref_out = reference(model, batches, grad_clip=clip, lr_lambda=hf_cosine(2, 8))
    engine = _mixed(model, _on_gpu(batches[0]), grad_clip=clip, transaction=transaction,
                    lr_schedule={"type": "cosine", "warmup_steps": 2, "total_steps": 8})
    assert engine.plan.transaction == transaction
    assert any(n.startswith("compute:") and ("inductor" in n) == (compute == "inductor")
               for n in engine.plan.notes), engine.plan.notes
    reports = _run_gpu(engine, batches)
    _close_to_reference(engine, reports, ref, ref_out)
    assert [r.clip_coef < 1 for r in reports] == [o[1] > clip for o in ref_out]


@pytest.mark.parametrize("transaction", ["replay", "none"])
def test_gpu_spread_host_chunks_match_torch_fp32(monkeypatch, transaction):
    """The host chunks spread among the device chunks (planner.make_plan picks that where the host Adam runs from a
    pool and the estimate prices it lower; forced here): host chunks' gradients cross and wait in the pool between
    device chunks' backward, their compute copies cross between device chunks' reads, and a replay restores and
    reruns such a placement. Against the CPU reference, with clipping that triggers (replay)."""
    from pstar_fx.planning import planner
    make = planner._make_plan
    monkeypatch.setattr(planner, "_make_plan", lambda *a, **kw: make(*a, **{**kw, "host_order": "spread"}))
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    batches = gpt_batches(6)
    _, _, free = reference(model, batches)
    clip = sorted(o[1] for o in free)[3] if transaction == "replay" else None
    ref, _, ref_out = reference(model, batches, grad_clip=clip)
    engine = _mixed(model, _on_gpu(batches[0]), device_chunks=3, grad_clip=clip, transaction=transaction)
    hosts = [c for c, t in enumerate(engine.plan.placement) if t == "host"]
    assert engine.plan.chunks.host_order == "spread"
    assert hosts != list(range(len(engine.plan.placement) - len(hosts), len(engine.plan.placement))), hosts
    reports = _run_gpu(engine, batches)
    _close_to_reference(engine, reports, ref, ref_out)


@pytest.mark.parametrize("kept_here", [0, 1, "in-activations"],
                         ids=["kept-on-host", "one-kept-on-device", "kept-in-activations"])
def test_gpu_speculating_and_deferring_by_turns_match_torch_fp32(monkeypatch, kept_here):
    """Chunks on both tiers, clipping that triggers on some steps; the steps defer and speculate by turns (a
    MayDefer transaction driven by a fixed pattern) on the same kept buffers, with none or one device chunk's kept
    gradient on the GPU (the others' come back from the host on the copy stream for a correction or a deferred
    update; the budget has room for that one beside the four device chunks), or as many as the memory backward
    frees holds (Plan.kept_in_activations: allocated in backward, released at the step's end once the work after the
    verdict that reads them has run): the CPU reference."""
    import pstar_fx.planning.planner as planner_module
    from pstar_fx.runtime.transactions import MayDefer
    if kept_here == "in-activations":
        monkeypatch.setenv("PSTAR_FX_KEPT_IN_ACTIVATIONS", "1")
        monkeypatch.setattr(planner_module, "n_kept_on_device", lambda n, *a: 0)
    else:
        monkeypatch.setattr(planner_module, "n_kept_on_device", lambda n, *a: min(kept_here, n))
        monkeypatch.setattr(planner_module, "n_kept_in_activations", lambda *a, **k: 0)
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    batches = gpt_batches(8)
    _, _, free = reference(model, batches)
    clip = sorted(o[1] for o in free)[3]
    ref, _, ref_out = reference(model, batches, grad_clip=clip, lr_lambda=hf_cosine(2, 8))
    engine = _mixed(model, _on_gpu(batches[0]), extra_bytes=(kept_here == 1) * 4 * 16384, grad_clip=clip,
                    transaction="kept_grads", lr_schedule={"type": "cosine", "warmup_steps": 2, "total_steps": 8})
    if kept_here == "in-activations":
        assert engine.plan.kept_in_activations and engine.plan.kept_on_device > 0
    else:
        assert engine.plan.kept_on_device == kept_here and not engine.plan.kept_in_activations
    engine.stepper.transaction = MayDefer("kept_grads", 0.5)
    pattern = iter([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    monkeypatch.setattr(engine.stepper, "expected_trigger_rate", lambda: next(pattern))
    reports = _run_gpu(engine, batches)
    assert [r.deferred for r in reports] == [True, False, False, True, False, True, True, False]
    _close_to_reference(engine, reports, ref, ref_out)
    assert [r.clip_coef < 1 for r in reports] == [o[1] > clip for o in ref_out]
    assert any(r.clip_coef < 1 and not r.deferred for r in reports)      # some speculated step was corrected


def test_gpu_a_step_that_may_defer_switches_by_its_timed_steps_and_matches_torch_fp32():
    """kept_grads chosen by "auto" with clipping on the CUDA runtime: the step that may defer has a TimedSwitch
    (runtime/timed_switch.py). Given one whose prices are all alike and a clock that makes a deferred step cost half
    a speculated one, with clipping on every step, the run speculates until a steady step is timed, probes
    deferring, and defers from then on, switching on the same kept buffers while host Adams and corrections run
    beside the next forward: the CPU reference."""
    from pstar_fx.runtime.timed_switch import CORRECTED, DEFERRED, MIN_SAMPLES, PROBE, SETTLE, SPECULATED, TimedSwitch
    from pstar_fx.runtime.transactions import MayDefer
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    batches = gpt_batches(SETTLE + MIN_SAMPLES + PROBE + 3)
    _, _, free = reference(model, batches)
    clip = sorted(o[1] for o in free)[0] * 0.5                     # triggers every step
    ref, _, ref_out = reference(model, batches, grad_clip=clip)
    engine = _mixed(model, _on_gpu(batches[0]), grad_clip=clip, transaction="auto")
    assert engine.plan.transaction == "kept_grads"
    assert isinstance(engine.stepper.transaction.switch, TimedSwitch)     # built for the CUDA runtime
    switch = TimedSwitch({SPECULATED: 1.0, CORRECTED: 1.0, DEFERRED: 1.0}, None)
    engine.stepper.transaction = MayDefer("kept_grads", None, switch)
    switch.clock = step_clock(engine, deferred=1.0, speculated=2.0)
    reports = _run_gpu(engine, batches)
    assert [r.deferred for r in reports] == [False] * (SETTLE + MIN_SAMPLES) + [True] * (PROBE + 3)
    assert switch.timed(CORRECTED) == 2.0 and switch.timed(DEFERRED) == 1.0
    _close_to_reference(engine, reports, ref, ref_out)
    assert all(r.clip_coef < 1 for r in reports)


def test_gpu_accumulation_matches_torch_fp32():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    batches = gpt_batches(4, accum=2)
    ref, _, ref_out = reference(model, batches, accum=2)
    engine = _mixed(model, _on_gpu(tuple(x[:2] for x in batches[0])), grad_accum=2)
    _close_to_reference(engine, _run_gpu(engine, batches), ref, ref_out)


@pytest.mark.parametrize("transaction", ["kept_grads", "deferred", "replay"])
@pytest.mark.parametrize("where", ["backward", "host_adam"])
def test_gpu_interrupted_step_leaves_the_state_as_before(monkeypatch, where, transaction):
    from test_transaction import Boom, interrupt, optimizer_state, record_undos
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    batches = gpt_batches(5)
    ref, _, ref_out = reference(model, batches)
    engine = _mixed(model, _on_gpu(batches[0]), transaction=transaction)
    reports = _run_gpu(engine, batches[:2])
    engine.drain()
    state, steps = optimizer_state(engine), engine.steps
    with monkeypatch.context() as m:
        undone = record_undos(m)
        interrupt(m, engine, where, at=3)
        with pytest.raises((Boom, StepRolledBack, RuntimeError)) as err:
            engine.step(*_on_gpu(batches[2]))
            engine.step(*_on_gpu(batches[3]))       # a host Adam failure may surface in the next step
    if err.type is RuntimeError:
        assert "cannot be undone" in str(err.value)
        assert transaction == "replay" or "released at the step's end" in str(err.value), str(err.value)
    if where == "host_adam" and engine.steps != steps:
        # documented: with nothing kept (replay), or device chunks' gradients kept in the memory backward frees
        # (released at the step's end: Plan.kept_in_activations), a host Adam failure found after its step returned
        # cannot be undone; the error says so, and the engine goes on training
        assert transaction == "replay" or engine.plan.kept_in_activations
        assert engine.steps == steps + 1
        engine.step(*_on_gpu(batches[3]))
        assert engine.steps == steps + 2
        return
    # (deferred: an interrupted backward has applied nothing, so nothing needed undoing)
    assert engine.steps == steps and (undone or (transaction == "deferred" and where == "backward"))
    for a, b in zip(optimizer_state(engine), state):  # restored to within rounding (Triton may fuse multiply-adds)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max().clamp_min(1e-30)))
    reports += _run_gpu(engine, batches[2:])
    _close_to_reference(engine, reports, ref, ref_out)


def _deferred_bf16(transaction, batches, like=None):
    """bf16 compute and moments, chunks on both tiers (`like`: on the tiers of that placement), clipping that
    triggers every step."""
    torch.manual_seed(0)
    model, cfg = GPT(gpt_config("tiny")), dict(dtype="bf16", optimizer_state="bf16", grad_clip=0.05,
                                               transaction=transaction)
    engine = (_mixed(model, _on_gpu(batches[0]), **cfg) if like is None else
              _mixed_like(model, _on_gpu(batches[0]), like, **cfg))
    assert engine.plan.transaction == transaction
    assert engine.plan.kept_in_shadow == (transaction == "deferred")
    return engine


def _assert_runs_equal(a, b):
    """Two runs' (reports, engine) gave the same bits: losses, norms, clip coefficients, every chunk's state
    (the message names the chunks that differ, and their tiers)."""
    (ra, ea), (rb, eb) = a, b
    from test_bf16_state import state_of
    sa, sb, store = state_of(ea), state_of(eb), ea.rt.store
    differ = [(i // 3, store.tier(i // 3), ("master", "exp_avg", "exp_avg_sq")[i % 3],
               float((x.float() - y.float()).abs().max()))
              for i, (x, y) in enumerate(zip(sa, sb)) if not torch.equal(x, y)]
    assert [(r.loss, r.grad_norm, r.clip_coef) for r in ra] == [(r.loss, r.grad_norm, r.clip_coef) for r in rb], differ
    assert not differ, differ
    assert all(r.clip_coef < 1 for r in ra)                          # clipping triggered every step


def test_gpu_deferred_bf16_keeps_host_gradients_in_their_shadows():
    """bf16 compute and moments, chunks on both tiers, deferred: each host chunk's gradient crosses into its 16-bit
    shadow, where the host Adam writes the new weights. It equals `two_pass` bit for bit (both update from the same
    gradients after the verdict, each chunk on the same tier in both), and every shadow holds its master's
    weights after a step. (A second deferred run first: the CUDA kernels give the same bits run to run, which
    the comparisons need.)"""
    from test_bf16_state import assert_shadows_are_masters
    batches = gpt_batches(4)
    runs = []
    for transaction in ("deferred", "deferred", "two_pass"):
        engine = _deferred_bf16(transaction, batches, like=runs[0][1].plan.placement if runs else None)
        reports = _run_gpu(engine, batches)
        engine.drain()
        assert_shadows_are_masters(engine)
        runs.append((reports, engine))
    _assert_runs_equal(runs[0], runs[1])
    _assert_runs_equal(runs[0], runs[2])


def test_gpu_corrected_copies_first_change_no_bit(monkeypatch):
    """bf16 compute, fp32 moments, kept_grads, chunks on both tiers, clipping that triggers every step,
    `HostWorker.COPIES_FIRST`: each host chunk's correction writes its 16-bit shadow first (the next forward waits
    for that alone) and its master and moments after, in backward's order. The run equals, bit for bit, one whose
    host corrections are each one pass, and every shadow holds its master's weights."""
    import pstar_fx.runtime.host_worker as host_worker_module
    import pstar_fx.runtime.undo as undo_module
    from test_bf16_state import assert_shadows_are_masters
    from test_transaction import record_correction_parts
    monkeypatch.setattr(host_worker_module.HostWorker, "COPIES_FIRST", True)
    batches = gpt_batches(4)
    parts = record_correction_parts(monkeypatch)
    runs = []
    for first in (True, False):
        with monkeypatch.context() as m:
            if not first:
                m.setattr(host_worker_module.HostWorker, "threaded", property(lambda self: False))
            torch.manual_seed(0)
            model = GPT(gpt_config("tiny"))
            cfg = dict(dtype="bf16", grad_clip=0.05, transaction="kept_grads")
            engine = (_mixed(model, _on_gpu(batches[0]), **cfg) if not runs else
                      _mixed_like(model, _on_gpu(batches[0]), runs[0][1].plan.placement, **cfg))
            assert engine.rt.store.shadow
            reports = _run_gpu(engine, batches)
            engine.drain()
            assert_shadows_are_masters(engine)
            runs.append((reports, engine))
            assert ("copy" in parts) == first
            parts.clear()
    _assert_runs_equal(runs[0], runs[1])


def test_gpu_interrupted_deferred_bf16_step_changes_nothing(monkeypatch):
    """The same, interrupted in backward after some host chunks' gradients landed in their shadows: the state is
    as before and the shadows hold their weights again; the run goes on to equal an uninterrupted one."""
    from test_bf16_state import assert_shadows_are_masters, state_of
    from test_transaction import Boom, interrupt
    batches = gpt_batches(4)
    ref = _deferred_bf16("deferred", batches)
    ref_reports = _run_gpu(ref, batches)
    engine = _deferred_bf16("deferred", batches)
    reports = _run_gpu(engine, batches[:3])
    engine.drain()
    state = state_of(engine)
    with monkeypatch.context() as m:
        interrupt(m, engine, "backward", at=3)
        with pytest.raises(Boom):
            engine.step(*_on_gpu(batches[3]))
    assert engine.steps == 3 and all(torch.equal(a, b) for a, b in zip(state_of(engine), state))
    assert_shadows_are_masters(engine)
    reports += _run_gpu(engine, batches[3:])
    ref.drain()
    engine.drain()
    _assert_runs_equal((ref_reports, ref), (reports, engine))


def test_gpu_host_chunk_copies_start_on_the_worker(monkeypatch):
    """The next step's forward reaches host chunks whose updates still run on the worker: their prefetches return
    at once and the worker queues each copy on the copy stream as the update ends (the compute stream waits for
    it at the fetch). The run equals the CPU reference; a step failing in forward meanwhile cancels the copies
    still waiting, and the step before stands (nothing undone)."""
    import time
    from test_transaction import Boom, before_host_adam, interrupt, record_undos
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    batches = gpt_batches(5)
    ref, _, ref_out = reference(model, batches)
    engine = _mixed(model, _on_gpu(batches[0]))
    before_host_adam(monkeypatch, engine, lambda: time.sleep(0.05))   # backward on the GPU is far quicker
    early, prefetch = [], engine.rt.mover.prefetch

    def watched(c, after=None):
        prefetch(c, after=after)
        if after is not None and not after.done():
            early.append(c)
    monkeypatch.setattr(engine.rt.mover, "prefetch", watched)
    reports = _run_gpu(engine, batches[:2])
    assert early, "no prefetch found its chunk's update running: the test shows nothing"
    with monkeypatch.context() as m:
        undone = record_undos(m)
        interrupt(m, engine, "forward", at=2)
        with pytest.raises(Boom):
            engine.step(*_on_gpu(batches[2]))
    assert engine.steps == 2 and not undone
    reports += _run_gpu(engine, batches[2:])
    _close_to_reference(engine, reports, ref, ref_out)


def test_gpu_fp16_loss_scale_skips_like_grad_scaler():
    from test_transaction import Regression, regression_batches
    torch.manual_seed(0)
    model = Regression()
    overflows = (2, 5)
    batches = regression_batches(8, overflow_at=overflows)
    rules = {"init_scale": 2.0**10, "growth_interval": 2}
    _, _, ref_out = reference(model, batches, scaler_kw=rules)
    engine = pstar_fx.compile(model, {"device": "cuda", "dtype": "fp16", "placement": "host", "chunk_size": 8192,
                                      "optimizer": OPT, "loss_scale": rules}, _on_gpu(batches[0]))
    with pytest.warns(RuntimeWarning, match="skipped"):
        reports = _run_gpu(engine, batches)
    assert [r.skipped for r in reports] == [o[2] for o in ref_out]
    assert [r.loss_scale for r in reports] == [o[4] for o in ref_out]


# ---- the plan's promise for small models, checkpoints through page-locked blocks, HF models on CUDA -----------

_PEAK_CHILD = r"""
import json, sys, torch, pstar_fx
from pstar_fx.models import GPT, Llama, gpt_config, llama_config
family, name, dtype, b, t, compute = *sys.argv[1:4], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
cfg = (gpt_config if family == "gpt" else llama_config)(name, block_size=t)
torch.manual_seed(0)
model = (GPT if family == "gpt" else Llama)(cfg)
idx = torch.randint(0, cfg.vocab_size, (b, t), device="cuda")
base = torch.cuda.memory_allocated()
engine = pstar_fx.compile(model, {"device": "cuda", "dtype": dtype, "compute": compute}, (idx, idx))
# the steps' peak (chunk memory included: it is allocated by now); compile's own transients come before the
# chunks exist (Inductor's autotuning for the regions: benchmark copies, an L2-sized flush buffer)
torch.cuda.reset_peak_memory_stats()
for _ in range(3):
    engine.step(idx, idx)
torch.cuda.synchronize()
print(json.dumps([torch.cuda.max_memory_allocated() - base, engine.plan.device_peak_bytes]))
"""


@pytest.mark.parametrize("case", ["gpt tiny fp32 8 64 eager", "gpt small fp32 8 128 eager",
                                  "gpt small bf16 8 256 eager", "llama small bf16 8 256 eager",
                                  "gpt GPT2small bf16 8 128 eager", "gpt tiny fp32 8 64 inductor",
                                  "gpt small bf16 8 256 inductor", "llama small bf16 8 256 inductor"])
def test_plan_holds_the_gpu_peak_of_small_models(case):
    """Eager compute: measured within [0.85, 1.0] of the plan in a fresh process (its first matmul allocates
    cuBLAS's workspace; the rates are measured in a child so their benchmark tensors never count). Before: 608
    MiB measured against 367 MiB predicted for the small GPT, from the calibration's tensors. Inductor's regions
    allocate less than their ops would eagerly (fused values never exist), so there the plan is a bound."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _PEAK_CHILD, *case.split()], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    measured, predicted = json.loads(out.stdout.strip().splitlines()[-1])
    low = 0.85 if case.endswith("eager") else 0.0
    print(f"{case}: measured {measured} predicted {predicted} ({measured / predicted:.3f})")
    assert low * predicted <= measured <= predicted, (measured, predicted, measured / predicted)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_checkpoint_round_trip_through_blocks(tmp_path, monkeypatch, dtype):
    """Device and host chunks saved and loaded in blocks far smaller than a tensor: every bit comes back."""
    import pstar_fx.checkpoint as ckpt
    monkeypatch.setattr(ckpt.safetensors, "BLOCK_BYTES", 4096)
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    batches = _batches(3)
    engine = _mixed(model, _on_gpu(batches[0]), dtype="bf16")
    _run_gpu(engine, batches[:2])
    engine.save(tmp_path / "c", dtype=dtype)
    sd = engine.state_dict()
    moments = [t for i, t in enumerate(optimizer_state(engine)) if i % 3]      # exp_avg, exp_avg_sq
    fresh = _mixed(GPT(gpt_config("tiny")), _on_gpu(batches[0]), dtype="bf16")
    fresh.load(tmp_path / "c")
    got = fresh.state_dict()
    for k, v in sd.items():
        want = v if dtype == "fp32" else v.to(torch.bfloat16).float()
        assert torch.equal(got[k], want), k
    for a, b in zip([t for i, t in enumerate(optimizer_state(fresh)) if i % 3], moments):
        assert torch.equal(a, b)


def test_gpu_hf_model_with_dropout_is_seeded():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=1,
                                  eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (2, 32), device="cuda")
    runs = []
    for _ in range(2):
        engine = pstar_fx.compile(copy.deepcopy(model), {"device": "cuda", "optimizer": OPT},
                                  {"input_ids": ids, "labels": ids})
        runs.append(([engine.step(input_ids=ids, labels=ids).item() for _ in range(3)], engine.state_dict()))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


@pytest.mark.parametrize("tiers", ["host", "mixed"])
def test_gpu_chunked_ranks_sharing_one_gpu_equal_one_process(tmp_path, tiers):
    """Two chunk-partitioned ranks on the one GPU, over gloo (NCCL refuses two ranks on one device): the CUDA
    runtime's ordering of broadcasts, reduces, copies and the host Adam worker, against torch fp32 on the CPU."""
    from test_dist import _launch, _results
    from test_engine import assert_weights_close
    from test_transaction import tiny_gpt
    env = {"DEVICE": "cuda", "LOCAL_RANK": "0", "PSTAR_FX_DIST_BACKEND": "gloo"}
    if tiers == "mixed":
        local = tuple(x.chunk(2)[0] for x in gpt_batches(1, accum=2)[0])
        on_host = pstar_fx.plan(tiny_gpt(), {"device": "cuda", "placement": "host", "chunk_size": 16384,
                                             "optimizer": OPT, "grad_clip": 0.05}, _on_gpu(local), world=2)
        # one chunk's state more than the all-host plan, the fragmentation reserve (1/64 of it) on top: the
        # compute slots give way to some chunks' state on the device
        env["DEVICE_MEMORY"] = str((on_host.device_peak_bytes + 16384 * 12) * 64 // 63)
    out = str(tmp_path / "run")
    _launch(2, out, 3, 0.05, 1, extra_env=env)
    ref, _, ref_out = reference(tiny_gpt(), gpt_batches(3, accum=2), grad_clip=0.05, accum=2)
    sds, runs = _results(out, 2)
    assert runs[1]["reports"] == runs[0]["reports"]
    if tiers == "mixed":
        assert all({"device", "host"} <= set(run["placement"]) for run in runs), [run["placement"] for run in runs]
    torch.testing.assert_close(torch.tensor([x[0] for x in runs[0]["reports"]]), torch.tensor([o[0] for o in ref_out]),
                               rtol=1e-4, atol=0)
    assert_weights_close(sds[0], ref, 1e-4, per_tensor=False)


def test_gpu_fp32_pieces_cast_on_their_own_stream_change_no_bit(monkeypatch):
    """Host chunks crossing as their fp32 masters, cast on the device from a staging buffer piece by piece (forced:
    pieces of 1000 values for 16384-value chunks): with the casts on the copy stream, and with PSTAR_FX_CAST_STREAM=1
    on a stream of their own from two halves of the buffer (movers.py `copy_in_pieces`), the same bits, the same bytes
    crossing; the losses track the CPU fp32 reference's."""
    from pstar_fx.planning import memory, shipping
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    batches = gpt_batches(4)
    _, _, ref_out = reference(model, batches)
    monkeypatch.setattr(shipping, "fallback_code", lambda itemsize, cuda: "fp32")
    monkeypatch.setattr(memory, "COPY_STAGING_ELEMS", 1000)
    shadows = pstar_fx.plan(model, {"device": "cuda", "dtype": "bf16", "placement": "host", "chunk_size": 16384,
                                    "optimizer": OPT}, _on_gpu(batches[0]))
    hb = shadows.host_breakdown              # no room for shadows or kept gradients: two gradient buffers
    tight = hb["process overhead"] + hb["chunk state"] + 2 * 16384 * 2
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("PSTAR_FX_CAST_STREAM", flag)
        engine = pstar_fx.compile(model, {"device": "cuda", "dtype": "bf16", "placement": "host", "chunk_size": 16384,
                                          "optimizer": OPT, "host_memory": tight}, _on_gpu(batches[0]))
        assert "fp32" in engine.plan.ship, engine.plan.ship
        assert (engine.rt.mover._cast_done is not None) == (flag == "1")
        reports = _run_gpu(engine, batches)
        runs[flag] = ([r.loss for r in reports], engine.state_dict(), engine.memory_stats()["h2d_bytes"])
        torch.testing.assert_close(torch.tensor(runs[flag][0]), torch.tensor([o[0] for o in ref_out]),
                                   rtol=3e-2, atol=0)           # bf16 compute against the fp32 reference
    assert runs["0"][0] == runs["1"][0] and runs["0"][2] == runs["1"][2]
    assert all(torch.equal(runs["0"][1][k], runs["1"][1][k]) for k in runs["0"][1])
