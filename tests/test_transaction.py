"""The step as a transaction, against plain PyTorch: clip_grad_norm_ + AdamW + LambdaLR (+ GradScaler), with
accumulation as summed `loss / k` backward calls — and a step interrupted anywhere leaves the state as it was."""
import contextlib
import copy
import math
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_engine import assert_losses_close, assert_weights_close, attach_gradient_reach, attach_truth, batch, \
    gradient_summands, in_dtype, rounding_tolerance, tight_budget

import pstar_fx
import pstar_fx.optim.adam as adam_module
import pstar_fx.runtime as runtime_module
import pstar_fx.runtime.chunk_ops as chunk_ops_module
import pstar_fx.runtime.undo as undo_module
from pstar_fx.runtime.host_worker import HostWorker
from pstar_fx.models import GPT, gpt_config
from pstar_fx.optim import LrSchedule

CHUNK = 16384
OPT = {"type": "adamw", "lr": 3e-3, "weight_decay": 0.1}


def hf_cosine(warmup, total, min_rate=0.0):
    """Hugging Face's cosine-with-warm-up multiplier, held at its end past `total` (written out here, not ours)."""
    def f(step):
        if step < warmup:
            return step / max(1, warmup)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return max(0.0, (0.5 * (1.0 + math.cos(math.pi * progress))) * (1 - min_rate) + min_rate)
    return f


def reference(model, batches, *, grad_clip=None, accum=1, lr_lambda=None, scaler_kw=None, autocast=None,
              dtype=torch.float32):
    """Plain PyTorch with the same recipe; per step (loss, grad norm, skipped, lr, loss scale). An fp32 run
    without loss scaling keeps its float64 twin beside it: the truth that test_engine's tolerances measure
    the rounding reach against."""
    ref = copy.deepcopy(model).to(dtype)
    opt = torch.optim.AdamW(ref.parameters(), **{k: v for k, v in OPT.items() if k != "type"})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    scaler = torch.amp.GradScaler("cpu", **scaler_kw) if scaler_kw is not None else None
    out = []
    smallest = {p: None for p in ref.parameters()}
    record = []              # per step: (lr, {param: (gradient as applied, its summands' magnitude over the
    #                          micro-batches (test_engine.gradient_summands), Σ_j |micro-batch gradient|, alike)})
    for whole in batches:
        opt.zero_grad(set_to_none=True)
        lr, scale = opt.param_groups[0]["lr"], (scaler.get_scale() if scaler else 1.0)
        total = 0.0
        magnitude, summands = {}, {}
        for mb in zip(*(x.chunk(accum) for x in whole)):
            before = {p: p.grad.clone() for p in ref.parameters() if p.grad is not None}
            with gradient_summands(ref) as terms:
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    loss = ref(*in_dtype(mb, dtype))
                (scaler.scale(loss / accum) if scaler else loss / accum).backward()
            total += loss.item()
            for p in ref.parameters():
                if p.grad is not None:
                    part = (p.grad - before[p] if p in before else p.grad).abs()
                    magnitude[p] = magnitude[p] + part if p in magnitude else part
                    summands[p] = summands[p] + terms[p] if p in summands else terms[p]
        if scaler:
            scaler.unscale_(opt)
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), grad_clip or float("inf")))
        if math.isfinite(norm):
            coef = min(1.0, grad_clip / (norm + 1e-6)) if grad_clip else 1.0      # clip_grad_norm_'s factor
            record.append((lr, {p: (p.grad.clone(), summands[p] * coef, magnitude[p] * coef)
                                for p in ref.parameters() if p.grad is not None}))
            for p in ref.parameters():
                if p.grad is not None:
                    smallest[p] = p.grad.abs() if smallest[p] is None else torch.minimum(smallest[p], p.grad.abs())
        if scaler:
            scaler.step(opt)
            scaler.update()
            skipped = scaler.get_scale() < scale
        else:
            opt.step()
            skipped = False
        if sched and not skipped:
            sched.step()
        out.append((total / accum, norm, skipped, lr, scale))
    # Elements whose gradient was within rounding of zero at some step (the key part of a qkv bias, whose
    # true gradient is zero; a sum of micro-batch gradients that cancel) get noise as gradient, which Adam
    # turns into lr-sized steps: assert_weights_close leaves out elements by their `.grad`, so hand it the
    # smallest magnitude each element had over the run.
    for p, g in smallest.items():
        p.grad = g
    ref.__dict__["adam_record"] = record
    if dtype == torch.float32 and scaler_kw is None and autocast is None:
        truth, _, truth_out = reference(model, batches, grad_clip=grad_clip, accum=accum, lr_lambda=lr_lambda,
                                        dtype=torch.float64)
        attach_truth(ref, truth, truth_out, steps=len(batches))
        # how far gradient rounding reaches through Adam, element by element (test_engine's comment above FP32_U)
        attach_gradient_reach(ref, truth, model, OPT, accum)
    return ref, opt, out


def gpt_batches(n, accum=1, seed=0):
    return [tuple(torch.cat(parts) for parts in zip(*(batch(seed=100 * s + j) for j in range(accum))))
            for s in range(seed, seed + n)]


def compile_gpt(model, **cfg):
    budget, _ = tight_budget(model, batch(), device_chunks=1, chunk_size=CHUNK)
    config = dict({"device": "cpu", "device_memory": budget, "chunk_size": CHUNK, "optimizer": OPT}, **cfg)
    engine = pstar_fx.compile(model, config, example_inputs=batch())
    placement = engine.plan.placement
    assert placement.count("host") > len(placement) // 2, placement       # most state lives on the host
    return engine


def run(engine, batches):
    reports = []
    for b in batches:
        engine.step(*b)
        reports.append(engine.last_step)
    return reports


def assert_run_matches(engine, reports, ref, ref_out, rel=None):
    """Losses, norms and weights equal torch's within `rel`, or (None) within the rounding reach measured
    against the float64 twin (test_engine.rounding_tolerance)."""
    truth_out = ref.__dict__["float64_truth"][2] if rel is None else None
    assert_losses_close([r.loss for r in reports], [o[0] for o in ref_out],
                        rel if rel is not None else [o[0] for o in truth_out])
    for t, (r, (_, norm, skipped, lr, scale)) in enumerate(zip(reports, ref_out)):
        assert r.skipped == skipped and r.lr == pytest.approx(lr, rel=1e-12, abs=0) and r.loss_scale == scale
        if not skipped:
            tol = rel if rel is not None else rounding_tolerance(norm, truth_out[t][1], t + 1)
            assert r.grad_norm == pytest.approx(norm, rel=tol, abs=0), f"step {t}: grad norm, tolerance {tol:.2e}"
    assert_weights_close(engine.state_dict(), ref, rel)


# A replay recomputes the step's gradients at the restored masters, an ulp or two from the originals, so the
# moments it restores carry that gradient's difference (relative 1e-6..1e-5 where a gradient is a sum that
# cancels): fp32 results then hold to 1e-4, not 1e-5. (In bf16 the restored masters round to the same
# compute copy almost always.) kept_grads, the planner's choice whenever the host holds the gradients,
# restores from the kept gradient itself.
REPLAY_REL = 1e-4


def tiny_gpt():
    torch.manual_seed(0)
    return GPT(gpt_config("tiny"))


# ---- clipping ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("transaction", ["kept_grads", "deferred", "replay", "two_pass"])
@pytest.mark.parametrize("when", ["every", "some", "never"])
def test_clipping_equals_clip_grad_norm(when, transaction):
    model = tiny_gpt()
    batches = gpt_batches(5)
    _, _, free = reference(model, batches)                        # the norms without clipping
    norms = sorted(o[1] for o in free)
    # thresholds from the unclipped norms; once clipping starts, later norms change, so "some" is checked below
    clip = {"every": norms[0] * 0.5, "some": norms[len(norms) // 2], "never": norms[-1] * 4}[when]
    ref, _, ref_out = reference(model, batches, grad_clip=clip)
    engine = compile_gpt(model, grad_clip=clip, transaction=transaction)
    assert engine.plan.transaction == transaction
    reports = run(engine, batches)
    assert_run_matches(engine, reports, ref, ref_out, rel=REPLAY_REL if transaction == "replay" else None)
    clipped = [r.clip_coef < 1.0 for r in reports]
    assert clipped == [o[1] > clip for o in ref_out]
    assert {"every": all(clipped), "never": not any(clipped), "some": any(clipped) and not all(clipped)}[when]
    if when == "never":
        assert engine.rt.telemetry.seconds["correction"] == 0.0   # nothing to correct when it does not trigger
    if transaction == "replay":
        assert engine.plan.host_breakdown["kept gradients"] == 0


@pytest.mark.parametrize("accum", [1, 2, 4])
def test_gradient_accumulation_equals_summed_micro_batch_backwards(accum):
    model = tiny_gpt()
    batches = gpt_batches(3, accum=accum)
    ref, _, ref_out = reference(model, batches, accum=accum)
    engine = compile_gpt(model, grad_accum=accum)
    reports = run(engine, batches)
    assert_run_matches(engine, reports, ref, ref_out)
    if accum > 1:
        assert engine.plan.transaction == "accumulate"
        assert "accumulators" in engine.explain()
    if accum > 1:              # the step takes the whole batch: k micro-batches along its leading dimension
        with pytest.raises(ValueError, match=rf"shape \({2 * accum + 1}, 32\): its leading dimension must be a "
                                             rf"multiple of grad_accum={accum}"):
            engine.step(*(torch.cat([x, x[:1]]) for x in gpt_batches(1, accum=accum)[0]))


def test_warmup_cosine_over_30_steps():
    model = tiny_gpt()
    batches = gpt_batches(30)
    schedule = {"type": "cosine", "warmup_steps": 5, "total_steps": 25, "min_lr": 3e-4}
    ref, _, ref_out = reference(model, batches, lr_lambda=hf_cosine(5, 25, 3e-4 / OPT["lr"]))
    engine = compile_gpt(model, lr_schedule=schedule)
    assert engine.lr == 0.0                                        # the first update uses multiplier 0
    reports = run(engine, batches)
    assert_run_matches(engine, reports, ref, ref_out)
    assert reports[0].lr == 0.0 and reports[5].lr == pytest.approx(OPT["lr"])
    assert reports[-1].lr == pytest.approx(3e-4) and engine.lr == pytest.approx(3e-4)   # past total_steps: min_lr


def test_clipping_accumulation_and_schedule_together():
    model = tiny_gpt()
    batches = gpt_batches(8, accum=2)
    _, _, free = reference(model, batches, accum=2)
    clip = sorted(o[1] for o in free)[3]
    ref, _, ref_out = reference(model, batches, grad_clip=clip, accum=2, lr_lambda=hf_cosine(2, 8))
    engine = compile_gpt(model, grad_clip=clip, grad_accum=2,
                         lr_schedule={"type": "cosine", "warmup_steps": 2, "total_steps": 8})
    reports = run(engine, batches)
    assert_run_matches(engine, reports, ref, ref_out)
    assert any(r.clip_coef < 1 for r in reports) and any(r.clip_coef == 1 for r in reports)


def test_a_user_schedule_function_is_lambda_lr():
    model = tiny_gpt()
    batches = gpt_batches(4)

    def halving(step):
        return 0.5 ** step

    ref, _, ref_out = reference(model, batches, lr_lambda=halving)
    engine = compile_gpt(model, lr_schedule=halving)
    assert_run_matches(engine, run(engine, batches), ref, ref_out)


# ---- loss scaling and skipped steps -------------------------------------------------------------------------

class Regression(nn.Module):
    """An inf in the input gives non-finite gradients on the step we choose."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, x, y):
        return F.mse_loss(self.net(x).squeeze(-1), y)


def regression_batches(n, overflow_at=()):
    g = torch.Generator().manual_seed(3)
    out = []
    for s in range(n):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
        if s in overflow_at:
            x[0, 0] = float("inf")
        out.append((x, y))
    return out


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_dynamic_loss_scale_follows_grad_scaler(dtype):
    torch.manual_seed(0)
    model = Regression()
    overflows = (2, 3, 7)
    batches = regression_batches(10, overflow_at=overflows)
    rules = {"init_scale": 2.0**10, "growth_interval": 2}          # GradScaler's rules, made quick to see
    ref, _, ref_out = reference(model, batches, scaler_kw=rules,
                                autocast=torch.float16 if dtype == "fp16" else None, grad_clip=5.0)
    engine = pstar_fx.compile(model, {"device": "cpu", "placement": "host", "chunk_size": 8192, "dtype": dtype,
                                      "optimizer": OPT, "loss_scale": rules, "grad_clip": 5.0}, batches[0])
    with pytest.warns(RuntimeWarning, match="non-finite gradients; the step was skipped"):
        reports = run(engine, batches)
    assert [r.skipped for r in reports] == [s in overflows for s in range(10)] == [o[2] for o in ref_out]
    assert [r.loss_scale for r in reports] == [o[4] for o in ref_out]   # the same scale, step for step
    assert engine.steps == 10 - len(overflows)
    rel = 1e-5 if dtype == "fp32" else 2e-3                             # fp16 compute: autocast's rounding
    assert_weights_close(engine.state_dict(), ref, rel, per_tensor=dtype == "fp32")


def assert_state_equal(engine, weights, state):
    after = engine.state_dict()
    assert all(torch.equal(after[k], weights[k]) for k in weights)
    assert all(torch.equal(a, b) for a, b in zip(optimizer_state(engine), state))


@pytest.mark.parametrize("transaction", ["auto", "two_pass"])
def test_a_skipped_step_changes_nothing_whatever_the_dtype(transaction):
    """Unclipped and unscaled, "two_pass" has nothing to measure and runs one pass: its skip rolls back as
    replay's does (it used to leave the chunks updated before the non-finite one, as "none")."""
    torch.manual_seed(0)
    model = Regression()
    batches = regression_batches(3, overflow_at=(1,))
    engine = pstar_fx.compile(model, {"device": "cpu", "placement": "host", "chunk_size": 8192, "optimizer": OPT,
                                      "lr_schedule": {"type": "linear", "warmup_steps": 1, "total_steps": 5},
                                      "transaction": transaction}, batches[0])
    engine.step(*batches[0])
    before, state, lr = engine.state_dict(), optimizer_state(engine), engine.lr
    with pytest.warns(RuntimeWarning, match="skipped"):
        engine.step(*batches[1])
    assert engine.last_step.skipped and engine.steps == 1 and engine.lr == lr
    assert_state_equal(engine, before, state)


def test_two_pass_that_cannot_replay_measures_first(monkeypatch):
    """Nothing to measure (unclipped, unscaled, fp32) but a random op left unseeded, so a step cannot be run again
    alike: "two_pass" then measures first, and a skipped step changes nothing (it used to run one pass as "none"
    does, warn, and leave the chunks updated before the non-finite gradient)."""
    import warnings
    import pstar_fx.passes.seed_random as seed_random

    class Dropped(Regression):
        def __init__(self):
            super().__init__()
            self.net.insert(1, nn.Dropout(0.25))
    monkeypatch.setattr(seed_random, "seed_random_ops", lambda gm: gm)      # dropout draws anew each time it runs
    torch.manual_seed(0)
    batches = regression_batches(3, overflow_at=(1,))
    engine = pstar_fx.compile(Dropped(), {"device": "cpu", "placement": "host", "chunk_size": 4096,
                                          "optimizer": OPT, "transaction": "two_pass"}, batches[0])
    assert not engine.plan.replayable and engine.plan.two_passes, engine.plan.transaction_cost
    assert "cannot be replayed" in engine.plan.transaction_cost
    engine.step(*batches[0])
    before, state = engine.state_dict(), optimizer_state(engine)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine.step(*batches[1])
    assert [str(w.message) for w in seen if "none" in str(w.message)] == []
    assert any("skipped" in str(w.message) for w in seen)
    assert engine.last_step.skipped and engine.steps == 1
    assert_state_equal(engine, before, state)
    engine.step(*batches[2])
    assert engine.steps == 2 and not engine.last_step.skipped


@pytest.mark.parametrize("transaction", ["two_pass", "kept_grads", "replay"])
def test_a_gradient_non_finite_in_the_last_chunk_rolls_back_the_chunks_before_it(monkeypatch, transaction):
    """Unclipped, unscaled, fp32: a NaN in the gradient of chunk 0, the last backward completes, comes after the
    other chunks were updated inside backward; the skip restores them (two_pass with nothing to measure runs one
    pass and rolls back as replay does; it used to leave them updated, as "none")."""
    model = tiny_gpt()
    batches = gpt_batches(3)
    engine = pstar_fx.compile(model, {"device": "cpu", "placement": "device", "chunk_size": CHUNK, "optimizer": OPT,
                                      "transaction": transaction}, batch())
    assert len(engine.plan.placement) > 2
    engine.step(*batches[0])
    state = optimizer_state(engine)
    real = engine.rt.mover.hand_over

    def hand_over(c):
        grad = real(c)
        if c == 0 and not poisoned:
            grad[0] = float("nan")
            poisoned.append(c)
        return grad
    poisoned = []
    with monkeypatch.context() as m:
        undone = record_undos(m)
        m.setattr(engine.rt.mover, "hand_over", hand_over)
        with pytest.warns(RuntimeWarning, match="skipped"):
            engine.step(*batches[1])
    assert poisoned and engine.last_step.skipped and engine.steps == 1
    assert len(undone) == len(engine.plan.placement) - 1       # every chunk but 0 had been updated, and undone
    assert_state_restored(engine, state, undone, replayed=transaction != "kept_grads")


# ---- failure atomicity --------------------------------------------------------------------------------------

def optimizer_state(engine):
    store = engine.rt.store
    return [t.clone() for c in range(len(store.master))
            for t in (store.master[c], store.exp_avg[c], store.exp_avg_sq[c])]


def record_undos(monkeypatch):
    """What each undo started from (the state after the update it undoes), by the master's address."""
    seen = {}
    real = undo_module.chunk_undo

    def chunk_undo(master, grad, exp_avg, exp_avg_sq, *a, **k):
        if master.data_ptr() not in seen:         # the first undo of a chunk starts from its updated state
            seen[master.data_ptr()] = [t.clone() for t in (master, exp_avg, exp_avg_sq)]
        return real(master, grad, exp_avg, exp_avg_sq, *a, **k)
    monkeypatch.setattr(undo_module, "chunk_undo", chunk_undo)
    return seen


def assert_state_restored(engine, state, undone, replayed=False):
    """Every chunk's master and moments as before the step: bit for bit where nothing was undone; where an
    update was undone, within two ulps of the value before and of the value the undo started from (the
    undo cannot recover what rounding took from the updated value, which a large gradient can make many
    times the old one)."""
    store = engine.rt.store
    after = optimizer_state(engine)
    for c in range(len(store.master)):
        for j in range(3):
            a, b = after[3 * c + j], state[3 * c + j]
            start = undone.get(store.master[c].data_ptr())
            if start is None:
                assert torch.equal(a, b), (c, j)
            elif replayed and j > 0:    # moments from a recomputed gradient (see REPLAY_REL)
                torch.testing.assert_close(a, b, rtol=REPLAY_REL, atol=REPLAY_REL * float(b.abs().max()))
            else:
                bound = 2.0**-22 * (start[j].abs() + b.abs()) + 1e-30
                assert bool(((a - b).abs() <= bound).all()), (c, j, float(((a - b).abs() / bound).max()))


class Boom(Exception):
    pass


def interrupt(monkeypatch, engine, where, at):
    """Make the step raise Boom at the `at`-th event of kind `where`."""
    calls = []

    def fail_on_call(fn):
        def wrapped(*a, **k):
            calls.append(1)
            if len(calls) == at:
                raise Boom(where)
            return fn(*a, **k)
        return wrapped

    if where == "forward":                    # a chunk fetch: the first ones are forward's
        monkeypatch.setattr(engine.rt, "fetch", fail_on_call(engine.rt.fetch))
    elif where == "backward":                 # after `at - 1` chunks were updated
        monkeypatch.setattr(engine.rt, "adam", fail_on_call(engine.rt.adam))
    else:                                     # inside the host Adam, on a host chunk's master
        def count():
            calls.append(1)
            if len(calls) == at:
                raise Boom(where)
        before_host_adam(monkeypatch, engine, count)


def before_host_adam(monkeypatch, engine, hook):
    """Call `hook()` before each host Adam pass over a host chunk's master (on the worker where there is one)."""
    store = engine.rt.store
    host = [(m.data_ptr(), m.data_ptr() + m.nbytes) for c, m in enumerate(store.master) if store.tier(c) == "host"]
    real = adam_module.adam_step

    def adam_step(param, *a, **k):
        if any(lo <= param.data_ptr() < hi for lo, hi in host):
            hook()
        return real(param, *a, **k)
    monkeypatch.setattr(adam_module, "adam_step", adam_step)


@pytest.mark.parametrize("transaction,clip", [(t, c) for t in ("kept_grads", "deferred", "replay")
                                              for c in (None, 0.05)]
                         + [("two_pass", None)])    # two_pass unclipped: one pass, rolled back as replay's
@pytest.mark.parametrize("where", ["forward", "backward", "host_adam"])
def test_an_interrupted_step_leaves_the_state_as_before(monkeypatch, where, clip, transaction):
    model = tiny_gpt()
    batches = gpt_batches(5)
    schedule = {"type": "linear", "warmup_steps": 1, "total_steps": 10}
    ref, _, ref_out = reference(model, batches, grad_clip=clip, lr_lambda=LrSchedule(schedule, OPT["lr"]).multiplier)
    engine = compile_gpt(model, grad_clip=clip, lr_schedule=schedule, transaction=transaction)
    reports = run(engine, batches[:2])
    state, steps, lr = optimizer_state(engine), engine.steps, engine.lr
    with monkeypatch.context() as m:
        undone = record_undos(m)
        interrupt(m, engine, where, at=3)
        with pytest.raises(Boom):
            engine.step(*batches[2])
    assert engine.steps == steps and engine.lr == lr and (where != "forward" or not undone)
    replayed = transaction in ("replay", "two_pass")
    assert_state_restored(engine, state, undone, replayed=replayed)
    reports += run(engine, batches[2:])               # and the next steps equal an uninterrupted run
    assert_run_matches(engine, reports, ref, ref_out, rel=REPLAY_REL if replayed else None)


@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_host_adam_failure_after_the_step_returned_rolls_that_step_back(monkeypatch, clip):
    """With the device chunk's kept gradient on the host (none fits in the memory backward frees here: patched),
    everything a failed host update's step did can be undone, even after that step returned."""
    import pstar_fx.planning.planner as planner_module
    monkeypatch.setattr(planner_module, "n_kept_in_activations", lambda *a, **k: 0)
    monkeypatch.setattr(chunk_ops_module, "HOST_WORKER_ON_CPU", True)   # host Adam on its worker thread, as on CUDA
    model = tiny_gpt()
    batches = gpt_batches(5)
    ref, _, ref_out = reference(model, batches, grad_clip=clip)
    engine = compile_gpt(model, grad_clip=clip)           # with clipping, corrections run on the worker too
    assert engine.rt.updater.worker is not None and engine.plan.kept_on_device == 0
    reports = run(engine, batches[:2])
    engine.drain()
    state, steps = optimizer_state(engine), engine.steps
    with monkeypatch.context() as m:
        undone = record_undos(m)
        interrupt(m, engine, "host_adam", at=2)
        with pytest.raises((Boom, runtime_module.StepRolledBack)):
            engine.step(*batches[2])          # the failure surfaces here, or once the next step waits for it
            engine.step(*batches[3])
    assert engine.steps == steps and undone
    assert_state_restored(engine, state, undone)
    reports += run(engine, batches[2:])
    assert_run_matches(engine, reports, ref, ref_out)


@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_host_adam_failure_after_a_step_released_its_kept_gradients_says_it_cannot_be_undone(monkeypatch, clip):
    """The device chunk's gradient kept in the memory backward frees (Plan.kept_in_activations) goes back at the
    step's end. A host update of that step failing before the step returned rolls it back as ever; failing after,
    it cannot be undone: the error says so and why, the step stands but for the failed chunk, the run goes on."""
    monkeypatch.setenv("PSTAR_FX_KEPT_IN_ACTIVATIONS", "1")
    monkeypatch.setattr(chunk_ops_module, "HOST_WORKER_ON_CPU", True)
    model = tiny_gpt()
    batches = gpt_batches(5)
    ref, _, ref_out = reference(model, batches[:2], grad_clip=clip)
    engine = compile_gpt(model, grad_clip=clip)
    assert engine.plan.kept_in_activations and engine.plan.kept_on_device == 1
    assert "released at the step's end" in engine.plan.transaction_cost
    reports = run(engine, batches[:2])
    assert_run_matches(engine, reports, ref, ref_out)          # exact so far, clipping or not
    engine.drain()
    state, steps = optimizer_state(engine), engine.steps
    with monkeypatch.context() as m:
        undone = record_undos(m)
        interrupt(m, engine, "host_adam", at=2)
        with pytest.raises((Boom, runtime_module.StepRolledBack, RuntimeError)) as err:
            engine.step(*batches[2])
            engine.step(*batches[3])
    if err.type is RuntimeError:
        assert "released at the step's end" in str(err.value) and "cannot be undone" in str(err.value)
        assert engine.steps == steps + 1           # the step that returned stands (but for the failed chunk)
    else:
        assert engine.steps == steps and undone
        assert_state_restored(engine, state, undone)
    losses = [engine.step(*b).item() for b in batches[3:]]
    assert all(math.isfinite(x) for x in losses) and engine.steps == steps + (3 if err.type is RuntimeError else 2)


def test_a_host_chunks_prefetch_does_not_wait_for_its_update(monkeypatch):
    """The next step's forward reaches a host chunk whose update still runs on the worker: its prefetch returns at
    once (the copy is started on the worker as the update ends) and its fetch waits for the update. The run
    equals torch's; so does one whose step fails in forward while such copies wait and the step before is still
    settling (that step stands: before, its updates were undone while it still counted as applied)."""
    monkeypatch.setattr(chunk_ops_module, "HOST_WORKER_ON_CPU", True)
    model = tiny_gpt()
    batches = gpt_batches(5)
    ref, _, ref_out = reference(model, batches)
    engine = compile_gpt(model)
    rt = engine.rt
    before_host_adam(monkeypatch, engine, lambda: time.sleep(0.05))   # the next step finds the updates running
    early, n_early, prefetch, fetch = {}, [], rt.mover.prefetch, rt.mover.fetch

    def watched_prefetch(c, after=None):
        prefetch(c, after=after)
        if after is not None and not after.done():
            early[c] = after                          # returned while chunk c's update still ran
            n_early.append(c)

    def watched_fetch(c):
        fetch(c)
        assert c not in early or early.pop(c).done(), c   # the compute reads c only after its update
    monkeypatch.setattr(rt.mover, "prefetch", watched_prefetch)
    monkeypatch.setattr(rt.mover, "fetch", watched_fetch)
    reports = run(engine, batches[:2])
    assert n_early and not early, "no prefetch found its chunk's update running: the test shows nothing"
    assert rt.telemetry.seconds["wait_for_host_adam"] > 0          # the fetches waited instead
    with monkeypatch.context() as m:
        undone = record_undos(m)
        interrupt(m, engine, "forward", at=2)          # copies queued behind running updates are given up
        with pytest.raises(Boom):
            engine.step(*batches[2])
    assert early, "the failed step left no copy waiting for its update: the test shows nothing"
    # the step before returned: its updates still running stood (nothing undone), and it still counts
    assert engine.steps == 2 and not undone
    reports += run(engine, batches[2:])
    assert_run_matches(engine, reports, ref, ref_out)


# ---- configuration and what the plan says --------------------------------------------------------------------

def test_config_checks_the_new_fields():
    with pytest.raises(ValueError, match="grad_clip"):
        pstar_fx.Config(grad_clip=0)
    with pytest.raises(ValueError, match="grad_accum"):
        pstar_fx.Config(grad_accum=0)
    with pytest.raises(ValueError, match="lr_schedule.type.*'step'"):
        pstar_fx.Config(lr_schedule={"type": "step"})
    with pytest.raises(ValueError, match="lr_schedule: unknown key.*warmup"):
        pstar_fx.Config(lr_schedule={"type": "cosine", "total_steps": 5, "warmup": 1})
    with pytest.raises(ValueError, match="lr_schedule.total_steps: required"):
        pstar_fx.Config(lr_schedule={"type": "linear"})
    with pytest.raises(ValueError, match="loss_scale: unknown key.*growth"):
        pstar_fx.Config(loss_scale={"growth": 2})
    with pytest.raises(ValueError, match="loss_scale"):
        pstar_fx.Config(loss_scale=-1.0)
    with pytest.raises(ValueError, match="transaction: 'none' cannot clip"):
        pstar_fx.Config(grad_clip=1.0, transaction="none")
    assert pstar_fx.Config(dtype="fp16").loss_scaler_spec["init_scale"] == 2.0**16
    assert pstar_fx.Config(dtype="bf16").loss_scaler_spec is None
    cfg = pstar_fx.Config.from_dict({"grad_clip": 1, "lr_schedule": {"type": "constant", "warmup_steps": 3}})
    assert cfg.grad_clip == 1.0


def test_schedule_formulas():
    s = LrSchedule({"type": "linear", "warmup_steps": 2, "total_steps": 6}, 1.0)
    assert [s.multiplier(k) for k in range(8)] == [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    c = LrSchedule({"type": "constant", "warmup_steps": 4}, 2.0)
    assert [c.lr(k) for k in (0, 2, 4, 100)] == [0.0, 1.0, 2.0, 2.0]
    m = LrSchedule({"type": "cosine", "warmup_steps": 0, "total_steps": 10, "min_lr": 0.1}, 1.0)
    assert m.lr(0) == 1.0 and m.lr(5) == pytest.approx(0.55) and m.lr(10) == m.lr(50) == pytest.approx(0.1)


def test_explain_says_what_the_transaction_costs():
    model = tiny_gpt()
    roomy = pstar_fx.plan(model, {"device": "cpu", "placement": "host", "grad_clip": 1.0}, batch())
    assert roomy.transaction == "kept_grads" and "smaller" in roomy.transaction_cost
    assert "step transaction: kept_grads" in roomy.summary()
    state = roomy.host_breakdown["chunk state"] + roomy.host_breakdown["16-bit shadows"]
    tight = pstar_fx.plan(model, {"device": "cpu", "placement": "host", "grad_clip": 1.0,
                                  "host_memory": state + 4 * 2**20 // 16}, batch())
    assert tight.transaction == "replay" and tight.host_breakdown["kept gradients"] == 0
    assert "runs forward and backward again" in tight.transaction_cost
    two = pstar_fx.plan(model, {"device": "cpu", "placement": "host", "grad_clip": 1.0, "transaction": "two_pass"},
                        batch())
    assert two.estimated_step_seconds > roomy.estimated_step_seconds
    accum = pstar_fx.plan(model, {"device": "cpu", "placement": "host", "grad_accum": 2}, batch())
    assert accum.host_breakdown["gradient accumulators"] == 4 * len(accum.placement) * accum_chunk(accum, model)


def accum_chunk(plan, model):
    return plan.host_breakdown["chunk state"] // (12 * len(plan.placement))


def test_an_engine_is_freed_without_a_gc_cycle():
    """Its parts hold no reference cycle: dropping the engine frees its chunk memory at once (a cycle kept
    a previous engine's GPU memory alive until the collector ran)."""
    import gc
    import weakref
    gc.disable()
    try:
        engine = compile_gpt(tiny_gpt(), grad_clip=1.0)
        engine.step(*batch())
        alive = [weakref.ref(x) for x in (engine, engine.rt, engine.rt.store, engine.rt.updater, engine.stepper)]
        del engine
        assert [r() is None for r in alive] == [True] * len(alive)
    finally:
        gc.enable()


class Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 1)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(F.dropout(torch.tanh(self.fc1(x)), 0.1)).squeeze(-1), y)


def test_a_step_with_dropout_replays_its_masks():
    """Dropout's masks are seeded per step (passes.seed_random): a replayed step redraws the same ones, so the
    planner may choose replay for it, and a replay that triggers (clipping) equals the exact two passes."""
    x, y = regression_batches(1)[0]
    cfg = {"device": "cpu", "placement": "host", "chunk_size": 1024, "grad_clip": 1e-3}
    torch.manual_seed(0)
    model = Dropout()
    roomy = pstar_fx.plan(model, cfg, (x, y))
    h = roomy.host_breakdown
    assert roomy.transaction == "kept_grads" and len(roomy.placement) == 2, roomy.summary()
    # a byte short of the state and the kept gradients, with room for a replay's gradient buffer
    tight = pstar_fx.plan(model, dict(cfg, host_memory=h["chunk state"] + h["kept gradients"] - 1), (x, y))
    assert tight.transaction == "replay" and not tight.why, tight.summary()
    runs = {}
    for transaction in ("replay", "two_pass"):
        engine = pstar_fx.compile(copy.deepcopy(model), dict(cfg, transaction=transaction), (x, y))
        runs[transaction] = ([engine.step(x, y).item() for _ in range(3)], engine.state_dict(), engine.last_step)
    (l1, sd1, r1), (l2, sd2, r2) = runs["replay"], runs["two_pass"]
    assert r1.clip_coef < 1 and r2.clip_coef < 1
    assert l1[0] == l2[0]             # the first step, before any replay: the same masks, the same loss
    # later steps start from masters a replay restored from the moments: within REPLAY_REL (other masks
    # would move the loss by far more)
    torch.testing.assert_close(torch.tensor(l1), torch.tensor(l2), rtol=REPLAY_REL, atol=0)
    for k in sd2:   # the replay restores the masters from the moments: within REPLAY_REL of exact
        torch.testing.assert_close(sd1[k], sd2[k], rtol=REPLAY_REL, atol=1e-7)


@pytest.mark.parametrize("transaction", ["kept_grads", "deferred", "replay", "two_pass"])
def test_batchnorm_statistics_move_once_per_step_whatever_the_transaction(transaction):
    """A replay and a two-pass step run forward twice; BatchNorm's running statistics must still move once."""
    from test_engine import WithBuffers, regression_batches as bn_batches
    torch.manual_seed(0)
    model = WithBuffers()
    batches = bn_batches(4)
    _, _, free = reference(model, batches)
    clip = sorted(o[1] for o in free)[0] / 2                      # triggers on every step
    ref, _, ref_out = reference(model, batches, grad_clip=clip)
    engine = pstar_fx.compile(model, {"device": "cpu", "placement": "host", "chunk_size": 1024, "optimizer": OPT,
                                      "grad_clip": clip, "transaction": transaction}, batches[0])
    reports = run(engine, batches)
    assert all(r.clip_coef < 1 for r in reports)
    rel = REPLAY_REL if transaction == "replay" else None
    assert_run_matches(engine, reports, ref, ref_out, rel=rel)
    running = engine._buffers[engine.lowered.capture.buffers.index("bn.running_mean")]
    truth = ref.__dict__["float64_truth"][0].bn.running_mean
    torch.testing.assert_close(running, ref.bn.running_mean, atol=1e-7,
                               rtol=rel if rel is not None else rounding_tolerance(ref.bn.running_mean, truth, 4))


def test_bf16_with_16bit_shadows_corrects_like_two_passes():
    """bf16 compute, host chunks shipping 16-bit shadows the host Adam writes: a correction (kept_grads) and a
    replay must leave the shadows equal to the masters they correct. Two passes never correct anything; the
    three agree within bf16's rounding."""
    model = tiny_gpt()
    batches = gpt_batches(4)
    common = {"device": "cpu", "placement": "host", "chunk_size": CHUNK, "dtype": "bf16", "optimizer": OPT,
              "grad_clip": 0.05}
    runs = {}
    for transaction in ("two_pass", "kept_grads", "replay"):
        engine = pstar_fx.compile(model, dict(common, transaction=transaction), batch())
        assert set(engine.plan.ship) == {"shadow"}
        reports = run(engine, batches)
        assert all(r.clip_coef < 1 for r in reports)
        store = engine.rt.store
        for c, shadow in store.shadow.items():              # every shadow is its master, rounded
            assert torch.equal(shadow, store.master[c].to(torch.bfloat16)), c
        runs[transaction] = (reports, engine.state_dict())
    ref_reports, ref_sd = runs["two_pass"]
    for transaction in ("kept_grads", "replay"):
        reports, sd = runs[transaction]
        assert [r.loss for r in reports] == pytest.approx([r.loss for r in ref_reports], rel=1e-3)
        ours, theirs = torch.cat([_real(k, sd[k]) for k in sd]), torch.cat([_real(k, ref_sd[k]) for k in sd])
        # masters an ulp apart round to different bf16 compute copies here and there, and those gradients
        # differ by up to bf16's unit roundoff (2**-9): the runs agree within that, not fp32's
        assert float((ours - theirs).norm() / theirs.norm()) < 2.0**-9, transaction


@pytest.mark.parametrize("clip", [0.05, None], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("transaction", ["kept_grads", "replay", "two_pass", "deferred"])
def test_device_chunks_compute_on_16bit_copies_their_updates_keep(monkeypatch, transaction, clip):
    """bf16, every chunk on the device with a slot of its own: each device chunk's bf16 compute copy stays from
    step to step, written by its Adam, undo and correction (plan.keeps_compute_copies), instead of cast from
    the master at each step's fetch. Clipped, clipping triggers every step (a correction, or a replay);
    unclipped, every update stands as applied. Step 2 is non-finite (skipped). The run equals, bit for bit, the
    same run casting at every fetch, and every copy is its master rounded."""
    import pstar_fx.planning.planner as planner_module
    torch.manual_seed(0)
    model = Regression()
    batches = regression_batches(5, overflow_at=(2,))
    config = {"device": "cpu", "placement": "device", "chunk_size": 4096, "dtype": "bf16", "optimizer": OPT,
              "grad_clip": clip, "transaction": transaction}
    runs = []
    for keep in (True, False):
        monkeypatch.setattr(planner_module, "keeps_compute_copies", lambda *args, keep=keep: keep)
        engine = pstar_fx.compile(model, config, batches[0])
        mover, store = engine.rt.mover, engine.rt.store
        n = len(engine.plan.placement)
        assert n > 1 and set(engine.plan.placement) == {"device"} and engine.plan.slots == n
        assert mover.slots.size == (0 if keep else n) and len(store.shadow) == (n if keep else 0)
        with pytest.warns(RuntimeWarning, match="skipped"):
            reports = run(engine, batches)
        assert [r.skipped for r in reports] == [False, False, True, False, False]
        assert all((r.clip_coef < 1) == (clip is not None) for r in reports if not r.skipped)
        for c, copy16 in store.shadow.items():
            assert torch.equal(copy16, store.master[c].to(torch.bfloat16)), c
        runs.append(([r.loss for r in reports], engine.state_dict(), optimizer_state(engine)))
    (loss_a, sd_a, st_a), (loss_b, sd_b, st_b) = runs
    assert loss_a[:2] == loss_b[:2] and loss_a[3:] == loss_b[3:]       # (step 2's loss is NaN in both)
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert all(torch.equal(a, b) for a, b in zip(st_a, st_b))


def _real(name, w):
    """The weights whose gradient is not rounding noise: the key part of a qkv bias has a true gradient of
    zero (softmax ignores a per-query constant), which Adam turns into lr-sized steps of noise."""
    w = w.flatten()
    if name.endswith("attn.c_attn.bias"):
        d = w.numel() // 3
        w = torch.cat([w[:d], w[2 * d:]])
    return w


def test_host_adam_trusts_the_device_check(monkeypatch):
    """A host chunk's gradient is measured on the device before it leaves (the norm): its finiteness crosses with
    it, so the host Adam runs without its own non-finite pass; a non-finite gradient is not applied at all."""
    import pstar_fx.runtime.updater as updater_module
    calls = []
    real = updater_module.chunk_update

    def spy(*args, check_finite=True, **kw):
        calls.append(check_finite)
        return real(*args, check_finite=check_finite, **kw)

    monkeypatch.setattr(updater_module, "chunk_update", spy)
    torch.manual_seed(0)
    batches = regression_batches(3, overflow_at=(1,))
    engine = pstar_fx.compile(Regression(), {"device": "cpu", "placement": "host", "chunk_size": 4096,
                                             "optimizer": OPT}, batches[0])
    n_chunks = len(engine.lowered.layout.chunks)
    assert n_chunks > 1 and set(engine.plan.placement) == {"host"}
    with pytest.warns(RuntimeWarning, match="skipped"):
        for b in batches:
            calls.clear()
            before = engine.state_dict()
            engine.step(*b)
            assert not any(calls), calls                       # every host update ran without the host check
            if not engine.last_step.skipped:
                assert len(calls) == n_chunks
            else:                                              # the first layer's gradient is not finite: its
                assert len(calls) < n_chunks                   # chunk was never updated, the others rolled back
                after = engine.state_dict()                     # (an undo is exact up to fp32 rounding: far
                for k in before:                                # below one update of lr 3e-3)
                    torch.testing.assert_close(after[k], before[k], rtol=0, atol=1e-5)
    assert engine.steps == 2


# ---- speculate or defer, step by step ---------------------------------------------------------------------

def test_a_switch_between_speculating_and_deferring_mid_run_changes_no_result(monkeypatch):
    """kept_grads chosen by "auto" with clipping may defer (plan.defer_above; on the CPU runtime deferring costs
    what speculating does, so any expected trigger rate above 0 defers). Driving the expected rate step by step
    (1, 0, 0, 1, 0, 1), the steps defer and speculate in that pattern on the same kept buffers, the speculated
    steps whose clipping triggers are corrected, and the run equals clip_grad_norm_ + AdamW."""
    model = tiny_gpt()
    batches = gpt_batches(6)
    _, _, free = reference(model, batches)
    clip = sorted(o[1] for o in free)[0] * 0.5                     # triggers every step
    ref, _, ref_out = reference(model, batches, grad_clip=clip)
    engine = compile_gpt(model, grad_clip=clip, transaction="auto")
    assert engine.plan.transaction == "kept_grads" and engine.plan.defer_above == 0.0
    rates = iter([1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    monkeypatch.setattr(engine.stepper, "expected_trigger_rate", lambda: next(rates))
    reports = run(engine, batches)
    assert [r.deferred for r in reports] == [True, False, False, True, False, True]
    assert all(r.clip_coef < 1.0 for r in reports)
    assert engine.rt.telemetry.seconds["correction"] > 0.0       # the speculated steps were corrected
    assert_run_matches(engine, reports, ref, ref_out)


def test_the_expected_trigger_rate_is_measured_over_the_last_steps_or_fixed():
    """None: the share of the last 8 steps whose clipping triggered, the steps not yet run counted as triggering
    (a run's first steps defer); it survives a checkpoint's loop state. A Config number fixes it: 0 always
    speculates, 1 defers (the CPU runtime's break-even is 0)."""
    from pstar_fx.runtime.step import TRIGGER_WINDOW
    model = tiny_gpt()
    batches = gpt_batches(3)
    never = compile_gpt(model, grad_clip=1e9, transaction="auto")  # clipping never triggers
    assert never.stepper.expected_trigger_rate() == 1.0
    reports = run(never, batches)
    assert [r.deferred for r in reports] == [True] * 3
    assert never.stepper.expected_trigger_rate() == (TRIGGER_WINDOW - 3) / TRIGGER_WINDOW
    state = never.stepper.state_dict()
    assert state["recent_clips"] == [False] * 3
    never.stepper.load_state_dict({"step": 3})                    # an older checkpoint: nothing measured yet
    assert never.stepper.expected_trigger_rate() == 1.0
    never.stepper.load_state_dict(state)
    assert never.stepper.expected_trigger_rate() == (TRIGGER_WINDOW - 3) / TRIGGER_WINDOW
    for rate, deferred in ((0.0, False), (1.0, True)):
        engine = compile_gpt(model, grad_clip=1e9, transaction="auto", expected_trigger_rate=rate)
        assert [r.deferred for r in run(engine, batches[:2])] == [deferred] * 2
    for bad in (-0.1, 1.5, "often", True):
        with pytest.raises(ValueError, match="expected_trigger_rate"):
            pstar_fx.Config(expected_trigger_rate=bad)


def test_a_timed_switch_chooses_by_the_plan_until_it_has_timed_steady_steps():
    """timed_switch.TimedSwitch: with nothing timed, the plan's break-even (None: never defer); a step is timed for
    its kind only after the run's first SETTLE steps and after a step of the same kind (the one before spilled into
    it); a kind never timed is priced at its estimate scaled by how the timed kinds came out against theirs; a
    failed step makes the next one unsteady; each input shape is timed on its own."""
    from pstar_fx.runtime.timed_switch import CORRECTED, DEFERRED, MIN_SAMPLES, SETTLE, SPECULATED, TimedSwitch
    assert MIN_SAMPLES == 2
    est = {SPECULATED: 1.0, CORRECTED: 2.0, DEFERRED: 1.6}
    never = TimedSwitch(est, None)
    assert not never.defer(1.0) and not never.defer(0.0)
    switch = TimedSwitch(est, 0.6)
    assert switch.defer(0.7) and not switch.defer(0.5)
    for _ in range(SETTLE):
        switch.record(CORRECTED, 9.0)                 # the run's first steps: not timed
    switch.record(DEFERRED, 9.0)                      # after a corrected step: not steady
    assert not any(switch.now.samples.values())
    switch.record(DEFERRED, 2.3)
    assert list(switch.now.samples[DEFERRED]) == [2.3] and switch.timed(DEFERRED) is None     # one: not yet timed
    assert switch.seconds(DEFERRED) == 1.6 and switch.defer(0.7) and not switch.defer(0.5)  # the plan's, still
    switch.record(DEFERRED, 2.5)
    assert switch.timed(DEFERRED) == pytest.approx(2.4)
    # the others at their estimates x 1.5 (2.4 / 1.6): corrected 3.0, speculated 1.5
    assert switch.seconds(CORRECTED) == pytest.approx(3.0) and switch.seconds(SPECULATED) == pytest.approx(1.5)
    assert switch.cost(False, 0.5) == pytest.approx(2.25) and switch.cost(True, 0.5) == pytest.approx(2.4)
    switch.forget_last()
    switch.record(DEFERRED, 5.0)                      # after a failed step: not steady
    assert list(switch.now.samples[DEFERRED]) == [2.3, 2.5]
    switch.record(None, 1.0)                          # a skipped step times nothing
    switch.record(None, 1.0)
    assert [len(s) for s in switch.now.samples.values()] == [0, 0, 2]
    # another input shape is timed on its own: nothing yet, the plan's break-even (a step after a deferred one of
    # the first shape is steady all the same)
    assert switch.defer(0.7, shape=(8, 512)) and not switch.defer(0.5, shape=(8, 512))
    switch.record(DEFERRED, 1.2)
    switch.record(DEFERRED, 1.1)
    assert list(switch.now.samples[DEFERRED]) == [1.1]
    switch.defer(0.5)
    assert list(switch.now.samples[DEFERRED]) == [2.3, 2.5]


def test_a_timed_switch_probes_a_way_never_timed_once_where_it_is_priced_close():
    """Where clipping is expected on most steps and the way not taken has never been timed and is priced within
    MARGIN of the way taken, it runs PROBE steps, once; then the timed costs choose, whatever the plan's break-even
    said. A way priced further off is not tried, nor one at a low expected rate."""
    from pstar_fx.runtime.timed_switch import (CORRECTED, DEFERRED, MARGIN, MIN_SAMPLES, PROBE, PROBE_RATE, SETTLE,
                                               SPECULATED, TimedSwitch)

    def steps(switch, rate, seconds, n):
        ways = []
        for _ in range(n):
            defer = switch.defer(rate)
            ways.append(defer)
            switch.record(DEFERRED if defer else CORRECTED, seconds[defer])
        return ways
    # the plan says speculate at any rate (deferring priced above a corrected step); the box defers faster
    est = {SPECULATED: 1.62, CORRECTED: 2.15, DEFERRED: 2.19}
    switch = TimedSwitch(est, None)
    timing = SETTLE + MIN_SAMPLES            # the steps before the way taken is timed
    ways = steps(switch, 1.0, {False: 2.17, True: 1.83}, timing + PROBE + 3)
    assert ways == [False] * timing + [True] * PROBE + [True] * 3
    assert switch.timed(DEFERRED) == pytest.approx(1.83) and switch.timed(CORRECTED) == pytest.approx(2.17)
    assert "deferred 1.83 s timed over" in switch.summary()
    # ... and where the probe finds it dearer, back to speculating; never probed again
    switch = TimedSwitch(est, None)
    ways = steps(switch, 1.0, {False: 2.17, True: 2.40}, timing + PROBE + 6)
    assert ways == [False] * timing + [True] * PROBE + [False] * 6
    # a way priced beyond MARGIN of the timed one is not tried
    far = {SPECULATED: 1.0, CORRECTED: 2.0, DEFERRED: 2.0 * MARGIN * 1.01}
    switch = TimedSwitch(far, None)
    assert steps(switch, 1.0, {False: 2.0, True: 1.0}, 10) == [False] * 10
    # nor where clipping is expected on fewer than PROBE_RATE of the steps (speculated steps weigh most)
    switch = TimedSwitch(est, None)
    assert steps(switch, PROBE_RATE - 0.01, {False: 2.17, True: 1.83}, 10) == [False] * 10


def step_clock(engine, *, deferred: float, speculated: float):
    """A clock for a TimedSwitch (MayDefer reads it as a step starts and ends) under which each step of `engine`
    takes `deferred` or `speculated` seconds, by the way it ran."""
    now = [0.0, False]                                            # (the time, whether the next reading ends a step)

    def clock():
        if now[1]:
            now[0] += deferred if engine.stepper.transaction.deferring else speculated
        now[1] = not now[1]
        return now[0]
    return clock


def test_a_step_that_may_defer_chooses_by_its_timed_steps_and_still_equals_torch():
    """MayDefer with a TimedSwitch (on the CUDA runtime of one process by default; here given one on the CPU, with
    a clock that makes a deferred step cost 2 s and a speculated one 1 s): clipping triggers every step and the
    plan's prices say defer; the run defers until it has timed a deferred step, probes speculating, finds it
    cheaper and speculates from then on, and the run equals clip_grad_norm_ + AdamW. A step that fails is not
    followed by a steady one."""
    from pstar_fx.runtime.timed_switch import CORRECTED, DEFERRED, MIN_SAMPLES, PROBE, SETTLE, SPECULATED, TimedSwitch
    from pstar_fx.runtime.transactions import MayDefer
    model = tiny_gpt()
    batches = gpt_batches(SETTLE + MIN_SAMPLES + PROBE + 2)
    _, _, free = reference(model, batches)
    clip = sorted(o[1] for o in free)[0] * 0.5                     # triggers every step
    ref, _, ref_out = reference(model, batches, grad_clip=clip)
    engine = compile_gpt(model, grad_clip=clip, transaction="auto")
    assert engine.plan.transaction == "kept_grads"
    assert engine.stepper.transaction.switch is None              # the CPU runtime: the plan's break-even alone
    switch = TimedSwitch({SPECULATED: 1.0, CORRECTED: 1.6, DEFERRED: 1.5}, 0.5)
    engine.stepper.transaction = MayDefer("kept_grads", 0.5, switch)
    switch.clock = step_clock(engine, deferred=2.0, speculated=1.0)
    reports = run(engine, batches)
    assert [r.deferred for r in reports] == [True] * (SETTLE + MIN_SAMPLES) + [False] * (PROBE + 2)
    assert switch.timed(DEFERRED) == 2.0 and switch.timed(CORRECTED) == 1.0
    assert all(r.clip_coef < 1.0 for r in reports)
    assert_run_matches(engine, reports, ref, ref_out)
    with pytest.MonkeyPatch.context() as m:               # a step that fails: the next one is not steady
        m.setattr(engine.stepper, "run_pass", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            engine.step(*batches[0])
    assert switch.last_kind is None and engine.steps == len(batches)


def test_the_timed_switch_takes_0_or_1():
    """PSTAR_FX_TIMED_SWITCH: "1" (the default) or "0"; anything else a clear error naming it."""
    from pstar_fx.runtime.timed_switch import timed_switch_on
    assert timed_switch_on() is True
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PSTAR_FX_TIMED_SWITCH", "0")
        assert timed_switch_on() is False
        mp.setenv("PSTAR_FX_TIMED_SWITCH", "yes")
        with pytest.raises(ValueError, match="PSTAR_FX_TIMED_SWITCH: expected 0 or 1"):
            timed_switch_on()


def _clipped_every_step_on_the_device(transaction: str) -> tuple:
    """The tiny GPT, 4 batches, torch's run with a threshold that clips every step, the config with every chunk on
    the device under `transaction`, and its plan with no device budget (every kept gradient beside the peak)."""
    model = tiny_gpt()
    batches = gpt_batches(4)
    _, _, free = reference(model, batches)
    clip = sorted(o[1] for o in free)[0] * 0.5
    ref, _, ref_out = reference(model, batches, grad_clip=clip)
    cfg = {"device": "cpu", "placement": "device", "chunk_size": CHUNK, "optimizer": OPT, "grad_clip": clip,
           "transaction": transaction}
    return model, batches, ref, ref_out, cfg, pstar_fx.plan(model, cfg, batch())


def test_device_chunks_keeping_some_gradients_on_the_device_train_exactly(monkeypatch):
    """Every chunk on the device, room beside the peak for one kept gradient (and none counted in what backward
    frees: patched): that chunk's stays on the device, the others' go to the host and come back for the correction.
    Clipping triggers every step; the run equals clip_grad_norm_ + AdamW."""
    import pstar_fx.planning.planner as planner_module
    monkeypatch.setattr(planner_module, "n_kept_in_activations", lambda *a, **k: 0)
    model, batches, ref, ref_out, cfg, roomy = _clipped_every_step_on_the_device("kept_grads")
    n, chunk_bytes = len(roomy.placement), roomy.device_breakdown["kept gradients"] // len(roomy.placement)
    budget = roomy.memory.device_peak_bytes - (n - 1) * chunk_bytes + chunk_bytes // 2
    engine = pstar_fx.compile(model, dict(cfg, device_memory=budget), example_inputs=batch())
    assert engine.plan.kept_on_device == 1 and set(engine.plan.placement) == {"device"}
    assert engine.rt.store.stats.host_bytes == (n - 1) * chunk_bytes     # the others' kept gradients, no more
    reports = run(engine, batches)
    assert all(r.clip_coef < 1.0 for r in reports)
    assert_run_matches(engine, reports, ref, ref_out)


@pytest.mark.parametrize("transaction", ["kept_grads", "deferred"])
def test_device_chunks_keeping_gradients_in_what_backward_frees_train_exactly(monkeypatch, transaction):
    """A device budget with no room beside the peak for any kept gradient: the device chunks the next forward reads
    first keep theirs in the memory backward has freed by the time it completes them (Plan.kept_in_activations:
    allocated then, released at the step's end), the others' go to the host. Clipping triggers every step; the
    run equals clip_grad_norm_ + AdamW, and the host holds the others' kept gradients alone."""
    monkeypatch.setenv("PSTAR_FX_KEPT_IN_ACTIVATIONS", "1")
    model, batches, ref, ref_out, cfg, roomy = _clipped_every_step_on_the_device(transaction)
    n, chunk_bytes = len(roomy.placement), roomy.memory.grad_chunk_bytes
    assert roomy.kept_on_device == n and not roomy.kept_in_activations
    budget = roomy.memory.device_peak_bytes - n * chunk_bytes + chunk_bytes // 2   # none fits beside the peak
    monkeypatch.setenv("PSTAR_FX_KEPT_IN_ACTIVATIONS", "0")                           # (the default)
    off = pstar_fx.plan(model, dict(cfg, device_memory=budget), batch())
    assert off.kept_on_device == 0 and not off.kept_in_activations
    said = [m for m in off.notes if "PSTAR_FX_KEPT_IN_ACTIVATIONS=1" in m]        # what turning it on would keep
    assert len(said) == 1 and f"of the {n} device chunks' kept gradients would stay" in said[0], off.notes
    monkeypatch.setenv("PSTAR_FX_KEPT_IN_ACTIVATIONS", "1")
    engine = pstar_fx.compile(model, dict(cfg, device_memory=budget), example_inputs=batch())
    k = engine.plan.kept_on_device
    assert engine.plan.kept_in_activations and 0 < k and set(engine.plan.placement) == {"device"}
    assert engine.plan.device_peak_bytes <= budget and "in the memory backward frees" in engine.plan.transaction_cost
    assert said[0].startswith(f"{k} of the {n} ") and not any("KEPT_IN_ACTIVATIONS" in m for m in engine.plan.notes)
    assert engine.rt.store.stats.host_bytes == (n - k) * chunk_bytes
    slots, kept = engine.rt.mover.grad_slots, engine.rt.updater.kept
    # (a gradient kept beside the peak trades buffers with the slot that held it: no copy, no new buffer)
    allocated = {b.data_ptr() for b in [*slots._free, *kept.grads.values()]}
    reports = run(engine, batches)
    assert all(r.clip_coef < 1.0 for r in reports)
    assert not kept.grads.keys() & kept.in_activations                                  # released each step
    # each gradient kept in activations was copied out of its slot: the pool holds only buffers allocated at compile
    # (a slot kept and a new one allocated in its place moved the pool into the activations' memory: RESULTS,
    # session 39)
    assert slots.free == slots.size and {b.data_ptr() for b in slots._free} <= allocated
    assert_run_matches(engine, reports, ref, ref_out)


class StreamLog:
    """The CPU runtime's copies (each runs at once), recording what a CUDA runtime would order: which stream is
    current, the events each stream records and the events each waits for — the ordering contract, on CPU."""

    def __init__(self):
        self.current, self.log, self.n = "compute", [], 0

    @contextlib.contextmanager
    def on(self, stream: str):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def record(self):
        self.n += 1
        self.log.append(("record", self.current, self.n))
        return (self.current, self.n)

    def wait(self, event) -> None:
        if event is not None:
            self.log.append(("wait", self.current, event))

    def compute_waits(self, event) -> None:
        if event is not None:
            self.log.append(("wait", "compute", event))

    def host_waits(self, event) -> None:
        pass

    def back_after_copies_out(self) -> None:
        self.log.append(("wait", "back", "d2h"))

    def start_step(self) -> None:
        self.log.append(("wait", "h2d", "compute"))

    def sync(self) -> None:
        self.log.append(("sync",))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("transaction", ["kept_grads", "deferred"])
def test_device_work_after_the_verdict_runs_beside_the_next_forward(monkeypatch, transaction, dtype):
    """The device chunks' corrections (kept_grads, clipping every step) or updates (deferred) after the verdict are
    queued on a stream of their own, after the compute stream's work; every reader of such a chunk in the next step
    (fp32: the compute stream's view of its master; bf16: its copy in, a cast on the copy stream) waits for that
    chunk's own kernel, and backward's first gradient for all of them (movers.py `Mover.after_verdict`). Recorded
    on the CPU runtime by a stand-in for the CUDA streams; the run still equals clip_grad_norm_ + AdamW."""
    from pstar_fx.runtime.movers import Mover
    from pstar_fx.runtime.updater import Updater
    model = tiny_gpt()
    batches = gpt_batches(3)
    _, _, free = reference(model, batches)
    clip = sorted(o[1] for o in free)[0] * 0.5                     # triggers every step
    streams = StreamLog()
    monkeypatch.setattr(chunk_ops_module, "CpuCopies", lambda: streams)
    log = streams.log
    for cls, name, chunk_at in ((undo_module.Undo, "_correct_one", 1), (Updater, "_update_device", 0)):
        def kernel(self, *args, _f=getattr(cls, name), _at=chunk_at, **kw):
            log.append(("kernel", streams.current, args[_at]))
            return _f(self, *args, **kw)
        monkeypatch.setattr(cls, name, kernel)

    def reads(name, chunk_of):
        def read(self, *args, _f=getattr(Mover, name)):
            out = _f(self, *args)
            log.append(("read", streams.current, chunk_of(self, *args)))
            return out
        monkeypatch.setattr(Mover, name, read)
    reads("param", lambda self, i: self.layout.slots[i].chunk)
    reads("_copy_in", lambda self, c, dst: c)
    reads("_grad_span", lambda self, i: ("grad", self.layout.slots[i].chunk))
    cfg = {"device": "cpu", "placement": "device", "chunk_size": CHUNK, "optimizer": OPT, "grad_clip": clip,
           "transaction": transaction, "dtype": dtype}
    engine = pstar_fx.compile(model, cfg, example_inputs=batch())
    device_chunks = [c for c, t in enumerate(engine.plan.placement) if t == "device"]
    del log[:]
    reports = run(engine, batches)
    assert all(r.clip_coef < 1.0 for r in reports)

    late = [i for i, e in enumerate(log) if e[0] == "kernel" and e[1] == "late"]
    # every device chunk's, once a step (the last step's only run after its own verdict: not read here)
    assert sorted(log[i][2] for i in late) == sorted(device_chunks * len(batches))
    if transaction == "deferred":                        # (kept_grads updates inside backward, on the compute stream)
        assert not [e for e in log if e[0] == "kernel" and e[1] != "late"]
    late_kernels = {c: [i for i in late if log[i][2] == c] for c in device_chunks}
    for c, at in late_kernels.items():
        for i in at[:-1]:                                # corrected (or updated) after step k's verdict ...
            event = next(e[2] for e in log[i:] if e[0] == "record" and e[1] == "late")
            # ... and read by step k + 1: the reading stream has waited for that kernel (or a later one) first
            j = next(j for j in range(i, len(log)) if log[j][0] == "read" and log[j][2] == c)
            assert any(e[0] == "wait" and e[1] == log[j][1] and e[2][0] == "late" and e[2][1] >= event
                       for e in log[i:j]), (c, log[i:j + 1])
    # backward's first gradient waits for every kernel queued after the last verdict
    grads = [j for j, e in enumerate(log) if e[0] == "read" and isinstance(e[2], tuple)]
    for i in {max(i for i in late if i < g) for g in grads if any(i < g for i in late)}:
        g = next(g for g in grads if g > i)
        done = max(e[2] for e in log[:g] if e[0] == "record" and e[1] == "late")
        assert ("wait", "compute", ("late", done)) in log[i:g], log[i:g + 1]
    if dtype == "fp32":                 # (bf16 against torch: test_bf16_with_16bit_shadows_corrects_like_two_passes)
        ref, _, ref_out = reference(model, batches, grad_clip=clip)
        assert_run_matches(engine, reports, ref, ref_out)


def test_a_replay_plan_measures_first_while_clipping_is_expected(monkeypatch):
    """A host budget without room for kept gradients: "auto" picks replay, and with clipping a step may instead
    measure first (as two_pass: no buffer a replay lacks) when triggering is expected, the break-even between a
    replayed step and one more pass. By turns, the run equals clip_grad_norm_ + AdamW (a replay's rounding)."""
    model = tiny_gpt()
    batches = gpt_batches(4)
    _, _, free = reference(model, batches)
    clip = sorted(o[1] for o in free)[0] * 0.5
    ref, _, ref_out = reference(model, batches, grad_clip=clip)
    cfg = {"device": "cpu", "placement": "host", "chunk_size": CHUNK, "optimizer": OPT, "grad_clip": clip}
    roomy = pstar_fx.plan(model, cfg, batch())
    state = roomy.host_breakdown["chunk state"] + roomy.host_breakdown["16-bit shadows"]
    engine = pstar_fx.compile(model, dict(cfg, host_memory=state + 4 * 2**20 // 16), example_inputs=batch())
    est = engine.plan.estimate
    assert engine.plan.transaction == "replay" and 0 < engine.plan.defer_above < 1
    assert est.step_seconds < est.deferred_step_seconds < est.triggered_step_seconds
    assert "measures first instead" in engine.plan.transaction_cost
    rates = iter([1.0, 0.0, 1.0, 0.0])
    monkeypatch.setattr(engine.stepper, "expected_trigger_rate", lambda: next(rates))
    reports = run(engine, batches)
    assert [r.deferred for r in reports] == [True, False, True, False]
    assert all(r.clip_coef < 1.0 for r in reports)
    assert_run_matches(engine, reports, ref, ref_out, rel=REPLAY_REL)


def test_a_host_update_not_started_at_a_correction_applies_the_verdict_directly(monkeypatch):
    """kept_grads with host updates on a worker that is behind (each host Adam pass sleeps first): when clipping
    triggers, the host updates not yet started apply the verdict's coefficient themselves and are not undone and
    redone; the others are corrected. Clipping triggers every step; the run equals clip_grad_norm_ + AdamW."""
    monkeypatch.setattr(chunk_ops_module, "HOST_WORKER_ON_CPU", True)
    model = tiny_gpt()
    batches = gpt_batches(4)
    _, _, free = reference(model, batches)
    clip = sorted(o[1] for o in free)[0] * 0.5
    ref, _, ref_out = reference(model, batches, grad_clip=clip)
    engine = compile_gpt(model, grad_clip=clip, transaction="kept_grads")
    store = engine.rt.store
    n_host = sum(store.tier(c) == "host" for c in range(len(store.master)))
    before_host_adam(monkeypatch, engine, lambda: time.sleep(0.05))
    host_masters = {store.master[c].data_ptr() for c in range(len(store.master)) if store.tier(c) == "host"}
    corrected = []                                  # each correction's chunk tier
    real = undo_module.chunk_rescale

    def chunk_rescale(master, *a, **k):
        corrected.append("host" if master.data_ptr() in host_masters else "device")
        return real(master, *a, **k)
    monkeypatch.setattr(undo_module, "chunk_rescale", chunk_rescale)
    reports = run(engine, batches)
    assert all(r.clip_coef < 1.0 for r in reports)
    assert_run_matches(engine, reports, ref, ref_out)
    # every step's guess (the last step's coefficient) is wrong, so every step is corrected: each device chunk is
    # corrected, but the worker, 50 ms a host chunk behind, had not reached most host updates
    n_device = len(store.master) - n_host
    assert corrected.count("device") == len(batches) * n_device
    assert corrected.count("host") < len(batches) * n_host / 2, (corrected.count("host"), n_host)


def record_correction_parts(monkeypatch) -> list[str]:
    """The parts of the host corrections as they run ("all", or "copy" then "state": `HostWorker.COPIES_FIRST`),
    with every correction waiting for all of its step's host updates first: none applies the verdict itself (late
    binding, whose rounding differs from a correction's, and depends on timing)."""
    parts = []
    real, real_correct = undo_module.Undo._correct_host, undo_module.Undo.correct

    def correct_host(self, log, c, updates, speculated, hyper, part="all"):
        parts.append(part)
        return real(self, log, c, updates, speculated, hyper, part)

    def correct(self, log, hyper):
        for f in list(log.host.values()):
            if hasattr(f, "result"):
                f.result()
        return real_correct(self, log, hyper)
    monkeypatch.setattr(undo_module.Undo, "_correct_host", correct_host)
    monkeypatch.setattr(undo_module.Undo, "correct", correct)
    return parts


def _inline_and_split(monkeypatch, parts: list[str], clip: float, **compile_kw) -> int:
    """The same 4 clipped steps with the host jobs inline, then on the worker with `HostWorker.COPIES_FIRST`: each
    master, moment and shadow bit-equal, and every job after a verdict split into a "copy" and a "state" job on the
    worker (one "all" job inline: `parts` records them). Returns how many chunks' jobs were split a step."""
    monkeypatch.setattr(HostWorker, "COPIES_FIRST", True)
    model, batches = tiny_gpt(), gpt_batches(4)
    runs = {}
    for threaded in (False, True):
        monkeypatch.setattr(chunk_ops_module, "HOST_WORKER_ON_CPU", threaded)
        engine = compile_gpt(model, grad_clip=clip, dtype="bf16", **compile_kw)
        store, kept = engine.rt.store, engine.rt.updater.kept
        split = [c for c in store.shadow if store.tier(c) == "host" and c not in kept.in_shadow]
        assert split and (engine.rt.updater.worker is not None) == threaded
        reports = run(engine, batches)
        engine.drain()
        assert all(r.clip_coef < 1.0 for r in reports)
        runs[threaded] = ([r.loss for r in reports], [r.deferred for r in reports],
                          [t.clone() for c in range(len(store.master))
                           for t in (store.master[c], store.exp_avg[c], store.exp_avg_sq[c])]
                          + [store.shadow[c].clone() for c in sorted(store.shadow)])
        if not threaded:
            assert set(parts) == {"all"}
            parts.clear()
    assert parts.count("copy") == parts.count("state") == len(batches) * len(split), parts
    assert runs[True][:2] == runs[False][:2]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][2], runs[False][2]))
    return runs[True][1]


def test_a_host_chunks_corrected_copy_comes_first_and_changes_no_bit(monkeypatch):
    """bf16 compute, kept_grads, clipping on every step, host Adam on its worker, `HostWorker.COPIES_FIRST`: each
    correction of a host chunk that ships its 16-bit shadow writes that shadow first (chunk_rescale's copy alone),
    for the next forward, which waits for it alone, and corrects the master and moments after it, in backward's
    order. Every master, moment and shadow equals, bit for bit, the same run with the host jobs inline (one
    correction pass a chunk), which equals torch within bf16's reach (the other clipping tests)."""
    _, _, free = reference(tiny_gpt(), gpt_batches(4))
    clip = sorted(o[1] for o in free)[0] * 0.5                     # triggers on every step
    deferred = _inline_and_split(monkeypatch, record_correction_parts(monkeypatch), clip, transaction="kept_grads")
    assert not any(deferred)


def test_a_deferred_steps_host_copies_come_first_and_change_no_bit(monkeypatch):
    """bf16 compute, a kept_grads plan whose steps defer (expected trigger rate 1: the rate-aware plan of a run
    that clips on every step), host Adam on its worker, `HostWorker.COPIES_FIRST`: each host chunk gets its new
    16-bit shadow first (adam_step's copy alone), then its master and moments, in backward's order. Every master,
    moment and shadow equals, bit for bit, the same run with the host jobs inline (one update a chunk). (A
    "deferred" plan keeps 16-bit host chunks' gradients in their shadows: nothing to split there.)"""
    import pstar_fx.runtime.updater as updater_module
    parts, real = [], updater_module.Updater._apply_host

    def apply_host(self, c, log, grad, check, part="all"):
        parts.append(part)
        return real(self, c, log, grad, check, part)
    monkeypatch.setattr(updater_module.Updater, "_apply_host", apply_host)
    _, _, free = reference(tiny_gpt(), gpt_batches(4))
    clip = sorted(o[1] for o in free)[0] * 0.5
    deferred = _inline_and_split(monkeypatch, parts, clip, transaction="auto", expected_trigger_rate=1.0)
    assert all(deferred)


@pytest.mark.parametrize("transaction", ["deferred", "kept_grads"])
def test_a_host_job_runs_as_the_pass_that_queued_it(monkeypatch, transaction):
    """Host jobs on a worker that is behind (each waits 50 ms for its gradient): a deferred step's backward jobs
    run after its verdict has opened the updates, and must still only keep their gradients (read at run time,
    the pass said "update", and each host chunk was updated twice: a race CPU runs hit now and then, and a CUDA
    run whenever the worker trailed backward). The run equals clip_grad_norm_ + AdamW."""
    monkeypatch.setattr(chunk_ops_module, "HOST_WORKER_ON_CPU", True)
    model = tiny_gpt()
    batches = gpt_batches(3)
    ref, _, ref_out = reference(model, batches, grad_clip=0.05)
    engine = compile_gpt(model, grad_clip=0.05, transaction=transaction)
    monkeypatch.setattr(engine.rt.updater.copies, "host_waits", lambda ready: time.sleep(0.05))
    reports = run(engine, batches)
    assert_run_matches(engine, reports, ref, ref_out)
