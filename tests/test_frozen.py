"""Frozen parameters (requires_grad=False) at their compute dtype's size: their own chunks, no master, moments,
gradient or update; training equals eager + AdamW over the trainable parameters, and the frozen ones never move."""
import os
import sys

import pytest
import torch
import torch.nn as nn

import pstar_fx
from pstar_fx.capture import CaptureError, capture
from pstar_fx.models import GPT, gpt_config

sys.path.insert(0, os.path.dirname(__file__))
from test_engine import assert_weights_close, batch, reference_run, tight_budget  # noqa: E402
from test_transaction import CHUNK, OPT, REPLAY_REL, assert_run_matches, gpt_batches, reference, run  # noqa: E402

FROZEN = ("wte.", "wpe.", "h.0.")          # the embeddings (tied to the head) and the first block


def frozen_gpt():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(FROZEN))
    return model


def counts(model):
    """(trainable, frozen) parameter elements, each tied parameter once."""
    ps = list(model.parameters())
    return sum(p.numel() for p in ps if p.requires_grad), sum(p.numel() for p in ps if not p.requires_grad)


def chunk_store_bytes(engine):
    """Measured: the bytes of the tensors the chunk store holds for trainable and for frozen chunks."""
    store = engine.rt.store
    trainable = frozen = 0
    for c, ch in enumerate(engine.lowered.layout.chunks):
        tensors = [store.master[c], store.exp_avg[c], store.exp_avg_sq[c]]
        nbytes = sum(t.untyped_storage().nbytes() for t in tensors if t is not None)
        if ch.frozen:
            assert store.exp_avg[c] is None and store.exp_avg_sq[c] is None
            frozen += nbytes
        else:
            trainable += nbytes
    return trainable, frozen


_REFERENCE = {}


def clipped_reference():
    """(batches, clip, torch's run with it): computed once for the transactions below."""
    if not _REFERENCE:
        model, batches = frozen_gpt(), gpt_batches(4)
        _, _, free = reference(model, batches)
        clip = sorted(o[1] for o in free)[1]            # triggers on some steps
        _REFERENCE["run"] = (batches, clip, *reference(model, batches, grad_clip=clip)[::2])
    return _REFERENCE["run"]


@pytest.mark.parametrize("transaction", ["kept_grads", "deferred", "replay", "two_pass"])
def test_frozen_gpt_trains_like_eager_adamw_with_clipping_and_state_on_the_host(transaction):
    model = frozen_gpt()
    batches, clip, ref, ref_out = clipped_reference()
    budget, _ = tight_budget(model, batch(), device_chunks=1, chunk_size=CHUNK)
    engine = pstar_fx.compile(model, {"device": "cpu", "device_memory": budget, "chunk_size": CHUNK,
                                      "optimizer": OPT, "grad_clip": clip, "transaction": transaction},
                              example_inputs=batch())
    layout, plan = engine.lowered.layout, engine.plan
    assert plan.transaction == transaction
    assert plan.placement.count("host") > len(plan.placement) // 2, plan.placement      # most state on the host
    frozen_chunks = [ch for ch in layout.chunks if ch.frozen]
    assert frozen_chunks and any(plan.placement[ch.id] == "host" for ch in frozen_chunks)
    for ch in layout.chunks:                            # a chunk is all trainable or all frozen
        assert {s.param.requires_grad for s in ch.slots} == {not ch.frozen}
    assert not any(ch.frozen for ch in layout.chunks if engine.plan.ship[ch.id] not in ("-", "frozen"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reports = run(engine, batches)
    assert any(r.clip_coef < 1.0 for r in reports)
    # the global norm is over the trainable parameters only, as clip_grad_norm_ over parameters whose grad is None
    assert_run_matches(engine, reports, ref, ref_out, rel=REPLAY_REL if transaction == "replay" else None)
    sd = engine.state_dict()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(sd[name], before[name]), name            # bit-unchanged
    ops = [n for n in engine.graph.graph.nodes if n.op == "call_method"]
    frozen_ids = {ch.id for ch in frozen_chunks}
    assert not any(n.target in ("adam", "offload") and n.args[1] in frozen_ids for n in ops)
    grads_of = {layout.slots[n.args[1]].chunk for n in ops if n.target in ("grad", "grad_mm")}
    assert not grads_of & frozen_ids
    assert "frozen chunks:" in engine.explain() and "frozen param(s)" in engine.explain()


@pytest.mark.parametrize("dtype,itemsize", [("fp32", 4), ("bf16", 2)])
def test_planned_and_measured_bytes_are_12_per_trainable_and_the_compute_size_per_frozen(dtype, itemsize):
    model = frozen_gpt()
    n_trainable, n_frozen = counts(model)
    budget, _ = tight_budget(model, batch(), device_chunks=1, chunk_size=CHUNK, dtype=dtype)
    engine = pstar_fx.compile(model, {"device": "cpu", "device_memory": budget, "chunk_size": CHUNK,
                                      "dtype": dtype, "optimizer": OPT}, example_inputs=batch())
    layout, plan = engine.lowered.layout, engine.plan
    # the layout packs each kind by itself: its chunks hold the kind's parameters, and padding only in the last
    cs = layout.chunk_size
    trainable = [ch for ch in layout.chunks if not ch.frozen]
    frozen = [ch for ch in layout.chunks if ch.frozen]
    assert sum(ch.used_elems for ch in trainable) == n_trainable and sum(ch.used_elems for ch in frozen) == n_frozen
    planned_trainable = plan.device_breakdown["chunk state"] + plan.host_breakdown["chunk state"]
    planned_frozen = plan.device_breakdown.get("frozen chunks", 0) + plan.host_breakdown.get("frozen chunks", 0)
    se = layout.state_elems                     # a trainable chunk's state (here the fullest fills the chunk)
    assert planned_trainable == 12 * se * len(trainable)
    assert planned_frozen == itemsize * cs * len(frozen)
    assert chunk_store_bytes(engine) == (planned_trainable, planned_frozen)
    # per parameter: what the chunks' parameters take of it, padding aside
    assert planned_trainable - 12 * n_trainable == 12 * (se * len(trainable) - n_trainable)
    assert planned_frozen - itemsize * n_frozen == itemsize * (cs * len(frozen) - n_frozen)
    # the same model with nothing frozen: every chunk costs 12 B/param, and none is frozen
    whole = pstar_fx.plan(GPT(gpt_config("tiny")), {"device": "cpu", "chunk_size": CHUNK, "dtype": dtype,
                                                   "optimizer": OPT}, example_inputs=batch())
    assert whole.device_breakdown["chunk state"] + whole.host_breakdown["chunk state"] == 12 * cs * len(
        whole.placement)
    assert "frozen chunks" not in whole.device_breakdown and "frozen chunks" not in whole.host_breakdown
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = gpt_batches(3)
    losses = [engine.step(*b).item() for b in batches]
    assert chunk_store_bytes(engine) == (planned_trainable, planned_frozen)   # the run allocates nothing more
    sd = engine.state_dict()
    for name, p in model.named_parameters():        # frozen weights: as loaded, rounded to the compute dtype
        if not p.requires_grad:
            assert torch.equal(sd[name], before[name].to(engine.lowered.dtype).float()), name
    if dtype == "bf16":                             # and it trains like fp32 within bf16's reach (test_engine's rule)
        ref, ref_losses = reference_run(model, batches, OPT)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)
        assert_weights_close(sd, ref, 2e-2, per_tensor=False)


@pytest.mark.parametrize("dtype,itemsize", [("fp32", 4), ("bf16", 2)])
def test_a_few_trainable_parameters_beside_a_large_frozen_one_take_state_for_what_they_hold(dtype, itemsize):
    """LoRA's shape: the chunk size is set by the largest frozen parameter (the tied embedding here, a 70B model's
    1.05 G-element one), and the trainable parameters fill a small part of one chunk. Their state is sized by the
    fullest trainable chunk (Layout.state_elems, whole 4 KiB), not by the chunk size: planned and allocated bytes
    are 12 per state element of each trainable chunk, and it trains like eager AdamW with most state on the host."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("h.1.attn.c_proj.", "h.1.ln_", "ln_f.")))
    n_trainable, n_frozen = counts(model)
    cfg = {"optimizer": OPT, "dtype": dtype}
    budget, _ = tight_budget(model, batch(), device_chunks=1, **cfg)
    engine = pstar_fx.compile(model, {"device": "cpu", "device_memory": budget, **cfg}, example_inputs=batch())
    layout, plan = engine.lowered.layout, engine.plan
    trainable = [ch for ch in layout.chunks if not ch.frozen]
    frozen = [ch for ch in layout.chunks if ch.frozen]
    se, cs = layout.state_elems, layout.chunk_size
    assert se == -(-max(ch.used_elems for ch in trainable) // 1024) * 1024 and se < cs // 2, (se, cs)
    planned_trainable = plan.device_breakdown["chunk state"] + plan.host_breakdown["chunk state"]
    planned_frozen = plan.device_breakdown.get("frozen chunks", 0) + plan.host_breakdown.get("frozen chunks", 0)
    assert planned_trainable == 12 * se * len(trainable) and planned_frozen == itemsize * cs * len(frozen)
    assert chunk_store_bytes(engine) == (planned_trainable, planned_frozen)
    assert f"trainable chunks' state: {se:,} elements each" in engine.explain()
    _gradient_buffers_hold(engine, se, itemsize)
    (c,) = [ch.id for ch in trainable]
    assert plan.placement[c] == "host"                  # its shorter state crosses (fp32: the master; bf16: shadow)
    on_device = pstar_fx.compile(model, {"device": "cpu", **cfg}, example_inputs=batch())   # room for all
    assert on_device.plan.placement[c] == "device"
    batches = gpt_batches(3)
    ref, ref_losses = reference_run(model, batches, OPT)
    for run in (engine, on_device):
        losses = [run.step(*b).item() for b in batches]
        if dtype == "fp32":
            from test_engine import assert_losses_close
            assert_losses_close(losses, ref_losses, ref.__dict__["float64_truth"][2])
            assert_weights_close(run.state_dict(), ref)
        else:                                       # bf16 within bf16's reach (test_engine's rule)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)
            assert_weights_close(run.state_dict(), ref, 2e-2, per_tensor=False)
    assert chunk_store_bytes(engine) == (planned_trainable, planned_frozen)


def _gradient_buffers_hold(engine, elems: int, itemsize: int) -> None:
    """Every buffer that holds a chunk's gradient (a gradient slot, a kept gradient, a host gradient buffer, an
    accumulator) holds `elems` (a LoRA model's 70B gradient slots held a 1.1 G-element chunk for 207 M adapter
    values), planned so: the gradient slots' and kept gradients' bytes in the plan."""
    plan, mover, kept = engine.plan, engine.rt.mover, engine.rt.updater.kept
    assert plan.device_breakdown["gradient slots"] == plan.grad_slots * elems * itemsize
    slots = [mover.grad_slots.take() for _ in range(mover.grad_slots.size)]
    assert slots and all(s.numel() == elems for s in slots)
    for s in slots:
        mover.grad_slots.give(s)
    own = [g for c, g in kept.grads.items() if c not in kept.in_shadow]
    assert all(g.numel() == elems for g in own) and all(a.numel() == elems for a in kept.acc.values())
    buffers = [kept.host_grads.take() for _ in range(kept.host_grads.size)]
    assert all(b.numel() == elems for b in buffers)
    for b in buffers:
        kept.host_grads.give(b)
    if own:
        planned_kept = plan.host_breakdown.get("kept gradients", 0) + plan.device_breakdown.get("kept gradients", 0)
        assert planned_kept == len(own) * elems * itemsize, (planned_kept, len(own), elems)


@pytest.mark.parametrize("transaction,accum", [("kept_grads", 1), ("deferred", 1), ("kept_grads", 2)])
def test_a_lora_shaped_models_gradient_buffers_hold_what_its_trainable_chunks_hold(transaction, accum):
    """The gradient buffers of a model whose few trainable parameters sit beside large frozen ones are as long as
    its trainable chunks' state, for each transaction that keeps or accumulates gradients, and it trains like
    eager AdamW with clipping, its state on the host."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("h.1.attn.c_proj.", "h.1.ln_", "ln_f.")))
    batches = gpt_batches(3, accum=accum)
    _, _, free = reference(model, batches, accum=accum)
    clip = sorted(o[1] for o in free)[1]                # triggers on some steps
    ref, _, ref_out = reference(model, batches, grad_clip=clip, accum=accum)
    cfg = {"optimizer": OPT, "grad_clip": clip, "transaction": transaction, "grad_accum": accum}
    budget, _ = tight_budget(model, batch(), device_chunks=1, optimizer=OPT)
    engine = pstar_fx.compile(model, {"device": "cpu", "device_memory": budget, **cfg}, example_inputs=batch())
    layout = engine.lowered.layout
    assert layout.state_elems < layout.chunk_size // 2
    assert engine.plan.placement[next(ch.id for ch in layout.chunks if not ch.frozen)] == "host"
    _gradient_buffers_hold(engine, layout.state_elems, 4)
    reports = run(engine, batches)
    assert any(r.clip_coef < 1.0 for r in reports)
    assert_run_matches(engine, reports, ref, ref_out)


def test_the_captured_backward_computes_no_weight_gradient_for_frozen_parameters():
    """x -> a -> b -> loss: freezing a leaves no gradient through a at all; freezing b leaves b's input gradient
    (a is trained) but no weight gradient of b."""
    def matmuls(freeze):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 1, bias=False))
        for i in freeze:
            model[i].weight.requires_grad_(False)

        class Loss(nn.Module):
            def __init__(self):
                super().__init__()
                self.m = model

            def forward(self, x):
                return self.m(x).square().mean()

        cap = capture(Loss(), (torch.randn(4, 8),), torch.device("cpu"), torch.float32)
        mms = [n for n in cap.gm.graph.nodes if n.op == "call_function" and n.target in
               (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
        return len(mms), [p.has_grad for p in cap.params]

    assert matmuls(()) == (2 + 3, [True, True])         # forward 2; backward dW2, dh, dW1
    assert matmuls((0,)) == (2 + 1, [False, True])      # backward dW2 only
    assert matmuls((2,)) == (2 + 2, [True, False])      # backward dh, dW1


def test_all_parameters_frozen_is_a_clear_error():
    model = frozen_gpt()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(CaptureError, match="every parameter of GPT is frozen"):
        pstar_fx.compile(model, {"device": "cpu", "chunk_size": CHUNK}, example_inputs=batch())


def test_checkpoint_round_trip_by_name_with_frozen_chunks(tmp_path):
    model = frozen_gpt()
    batches = gpt_batches(3)
    config = {"device": "cpu", "placement": "host", "chunk_size": CHUNK, "dtype": "bf16", "optimizer": OPT}
    engine = pstar_fx.compile(model, config, example_inputs=batch())
    engine.step(*batches[0])
    engine.save(tmp_path / "ck")
    losses = [engine.step(*b).item() for b in batches[1:]]
    again = pstar_fx.compile(frozen_gpt(), config, example_inputs=batch(), resume=tmp_path / "ck")
    assert [again.step(*b).item() for b in batches[1:]] == losses               # bit-exact resume
    sd, sd2 = engine.state_dict(), again.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)


@pytest.mark.gpu
@pytest.mark.parametrize("transaction", ["kept_grads", "deferred"])
def test_gpu_frozen_chunks_on_both_tiers_match_torch_fp32(transaction):
    """The CUDA runtime: frozen chunks on the GPU (computed on in place) and on the host (copied in, dropped after),
    clipping that triggers; against the CPU reference at the GPU tests' tolerance (other kernels, a few ulps)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from test_gpu import _close_to_reference, _run_gpu
    model = frozen_gpt()
    batches = gpt_batches(5)
    _, _, free = reference(model, batches)
    clip = sorted(o[1] for o in free)[2]
    ref, _, ref_out = reference(model, batches, grad_clip=clip)
    inputs = tuple(x.cuda() for x in batches[0])
    base = {"device": "cuda", "chunk_size": CHUNK, "optimizer": OPT, "grad_clip": clip, "transaction": transaction,
            "compute": "eager"}
    # the smallest budget (in steps of CHUNK bytes) whose plan puts frozen chunks on both tiers (a
    # frozen device chunk needs no compute slot, so the room each takes is not simply its bytes: search, on plans)
    on_host = pstar_fx.plan(model, dict(base, placement="host"), inputs)
    frozen_chunk = [how == "frozen" for how in on_host.ship]         # every chunk on the host: how each crosses
    lo, hi = on_host.device_peak_bytes, pstar_fx.plan(model, dict(base, placement="device"), inputs).device_peak_bytes * 2

    def frozen_tiers(budget):
        plan = pstar_fx.plan(model, dict(base, device_memory=budget), inputs)
        return {plan.placement[c] for c in range(len(plan.placement)) if frozen_chunk[c]}
    budget = next((b for b in range(lo, hi, CHUNK) if frozen_tiers(b) == {"device", "host"}), None)
    assert budget is not None, "no budget puts frozen chunks on both tiers"
    engine = pstar_fx.compile(model, dict(base, device_memory=budget), inputs)
    frozen = [ch.id for ch in engine.lowered.layout.chunks if ch.frozen]
    tiers = {engine.plan.placement[c] for c in frozen}
    assert tiers == {"device", "host"}, engine.plan.placement
    reports = _run_gpu(engine, batches)
    _close_to_reference(engine, reports, ref, ref_out)
    assert [r.clip_coef < 1 for r in reports] == [o[1] > clip for o in ref_out]
    sd = engine.state_dict()
    assert all(torch.equal(sd[n], p.detach()) for n, p in model.named_parameters() if not p.requires_grad)


def test_a_bf16_hugging_face_model_with_frozen_embeddings_saves_what_from_pretrained_reads(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    from test_hf import batches, hf_model
    model = hf_model("gpt2")
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(("transformer.wte.", "transformer.wpe.")))
    data = batches("gpt2")
    engine = pstar_fx.compile(model, {"device": "cpu", "placement": "host", "dtype": "bf16", "chunk_size": CHUNK,
                                      "optimizer": OPT}, example_inputs=data[0])
    assert any(ch.frozen for ch in engine.lowered.layout.chunks)
    for b in data:
        engine.step(**b)
    engine.save(tmp_path / "hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    sd = engine.state_dict()
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), sd[name]), name
    # the frozen embeddings: as loaded, rounded to bf16 (the only copy a bf16 run keeps of them)
    assert torch.equal(sd["transformer.wte.weight"], model.transformer.wte.weight.detach().bfloat16().float())
