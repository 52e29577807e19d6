"""Any sequence length on one chunk memory (pipeline/shapes.py): steps at several input shapes in one run, each
against eager PyTorch (clip_grad_norm_ + torch.optim.AdamW) on the same batches, no chunk memory allocated after
the first step, Config.seq_buckets, a length that cannot fit, and a checkpoint resumed across shapes."""
import copy
import math
import re

import pytest
import torch
from test_engine import (assert_losses_close, assert_weights_close, attach_gradient_reach, attach_truth,
                         gradient_summands, rounding_tolerance, tight_budget)

import pstar_fx
from pstar_fx.models import GPT, gpt_config

CHUNK = 16384
OPT = {"type": "adamw", "lr": 3e-3, "weight_decay": 0.1}
VOCAB = 256


def tiny_gpt():
    torch.manual_seed(0)
    return GPT(gpt_config("tiny"))


def tiny_hf_llama():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, head_dim=16,
                                   attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def gpt_batch(t, seed, b=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (b, t), generator=g), torch.randint(0, VOCAB, (b, t), generator=g))


def hf_batch(t, seed, b=2):
    ids = torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def call(model, batch):
    """A batch as the model takes it: positional (our GPT) or by keyword (Hugging Face, whose output has .loss)."""
    return model(**batch).loss if isinstance(batch, dict) else model(*batch)


def reference(model, batches, grad_clip, dtype=torch.float32, twin=True, lr_lambda=None):
    """Eager `model` + clip_grad_norm_ + torch.optim.AdamW (+ LambdaLR) over `batches` of any shapes; per step (loss,
    norm, lr). The fp32 run keeps its float64 twin beside it (test_engine's tolerance rule measures the rounding
    reach on it); `twin=False`: not (the norms alone are wanted)."""
    ref = copy.deepcopy(model).to(dtype)
    opt = torch.optim.AdamW(ref.parameters(), **{k: v for k, v in OPT.items() if k != "type"})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    out, record = [], []
    smallest = {p: None for p in ref.parameters()}
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        lr = opt.param_groups[0]["lr"]
        with gradient_summands(ref) as terms:       # each gradient's summands' magnitude (the rounding rule)
            loss = call(ref, batch)
            loss.backward()
        magnitude = {p: p.grad.abs() for p in ref.parameters() if p.grad is not None}
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), grad_clip))
        coef = min(1.0, grad_clip / (norm + 1e-6))                         # clip_grad_norm_'s factor
        record.append((lr, {p: (p.grad.clone(), terms[p] * coef, magnitude[p] * coef) for p in magnitude}))
        for p in magnitude:
            smallest[p] = p.grad.abs() if smallest[p] is None else torch.minimum(smallest[p], p.grad.abs())
        opt.step()
        if sched:
            sched.step()
        out.append((loss.item(), norm, lr))
    for p, g in smallest.items():       # assert_weights_close leaves out elements whose gradient was ever ~0
        p.grad = g
    ref.__dict__["adam_record"] = record
    if dtype == torch.float32 and twin:
        truth, truth_out = reference(model, batches, grad_clip, torch.float64, lr_lambda=lr_lambda)
        attach_truth(ref, truth, truth_out, steps=len(batches))
        attach_gradient_reach(ref, truth, model, OPT, accum=1)
    return ref, out


def chunk_memory(engine):
    """What the runtime has allocated: bytes per tier through the store, and the store's buffers."""
    s = engine.rt.stats
    return s.device_bytes, s.host_bytes, len(engine.rt.store._ptrs)


def compile_host_heavy(model, example, **cfg):
    """fp32, a device budget holding the working set at `example`'s shapes plus one chunk: most state on the host."""
    budget, n_chunks = tight_budget(model, example, device_chunks=1, chunk_size=CHUNK)
    engine = pstar_fx.compile(model, pstar_fx.Config(device="cpu", device_memory=budget, chunk_size=CHUNK,
                                                     optimizer=OPT, **cfg), example_inputs=example)
    assert engine.plan.placement.count("host") > n_chunks // 2, engine.plan.placement
    return engine


@pytest.mark.parametrize("kind", ["gpt", "hf_llama"])
def test_three_lengths_in_one_run_equal_eager_adamw_with_clipping_and_warmup(kind):
    model, make = (tiny_gpt(), gpt_batch) if kind == "gpt" else (tiny_hf_llama(), hf_batch)
    lengths = [16, 32, 24, 16]
    batches = [make(t, seed=s) for s, t in enumerate(lengths)]
    warmup = lambda step: step / 3 if step < 3 else 1.0   # noqa: E731  (get_constant_schedule_with_warmup's, 3 steps)
    _, free = reference(model, batches, grad_clip=math.inf, twin=False, lr_lambda=warmup)
    norms = sorted(n for _, n, _ in free)
    clip = (norms[1] + norms[2]) / 2        # clipping triggers on some steps, not all (none sits at the threshold)
    ref, ref_out = reference(model, batches, grad_clip=clip, lr_lambda=warmup)
    engine = compile_host_heavy(model, make(32, seed=99), grad_clip=clip,
                                lr_schedule={"type": "constant", "warmup_steps": 3})
    reports, memory = [], []
    for b in batches:
        engine.step(**b) if isinstance(b, dict) else engine.step(*b)
        reports.append(engine.last_step)
        memory.append(chunk_memory(engine))
    truth_out = ref.__dict__["float64_truth"][2]
    assert_losses_close([r.loss for r in reports], [o[0] for o in ref_out], [o[0] for o in truth_out])
    for t, (r, (_, norm, lr)) in enumerate(zip(reports, ref_out)):
        assert r.lr == pytest.approx(lr, rel=1e-12, abs=0)        # one schedule across the graphs
        tol = rounding_tolerance(norm, truth_out[t][1], t + 1)
        assert r.grad_norm == pytest.approx(norm, rel=tol, abs=0), f"step {t}: grad norm, tolerance {tol:.2e}"
    clipped = [r.clip_coef < 1.0 for r in reports]
    assert clipped == [n > clip for _, n, _ in ref_out] and any(clipped) and not all(clipped)
    assert_weights_close(engine.state_dict(), ref)
    assert engine.steps == len(batches)                  # one Adam step count and schedule across the graphs
    assert "input shapes on this chunk memory: 3" in engine.explain()
    # three graphs, every one on the compiled runtime's slots and transaction; nothing allocated after step one
    assert sorted(s[0][0][1] for s in engine.shapes.shapes) == [16, 24, 32]
    compiled = engine.plan
    for plan in engine.shapes.plans.values():
        assert (plan.placement, plan.slots, plan.grad_slots, plan.host_grad_buffers, plan.ship, plan.transaction,
                plan.kept_on_device, plan.kept_in_shadow) == \
            (compiled.placement, compiled.slots, compiled.grad_slots, compiled.host_grad_buffers, compiled.ship,
             compiled.transaction, compiled.kept_on_device, compiled.kept_in_shadow)
    assert all(m == memory[0] for m in memory), memory
    assert engine.memory_stats()["device_peak_bytes"] <= engine.config.device_memory


@pytest.mark.parametrize("in_activations", [False, True], ids=["beside-the-peak", "in-activations"])
def test_shorter_lengths_on_a_plan_keeping_a_device_chunks_gradient_on_the_device(monkeypatch, in_activations):
    """Every chunk on the device, room for one kept gradient beside the peak at length 32 (plan.kept_on_device 1,
    the others' kept on the host), or for more in the memory backward frees (plan.kept_in_activations): the graphs
    of shorter lengths keep that split, which the runtime's kept buffers were allocated for, and train equal to
    eager with clipping on every step."""
    import pstar_fx.planning.planner as planner_module
    monkeypatch.setenv("PSTAR_FX_KEPT_IN_ACTIVATIONS", "1" if in_activations else "0")
    if not in_activations:
        monkeypatch.setattr(planner_module, "n_kept_in_activations", lambda *a, **k: 0)
    model = tiny_gpt()
    batches = [gpt_batch(t, seed=s) for s, t in enumerate([16, 24, 32])]
    _, free = reference(model, batches, grad_clip=math.inf, twin=False)
    clip = min(n for _, n, _ in free) * 0.5
    ref, ref_out = reference(model, batches, grad_clip=clip)
    cfg = {"device": "cpu", "placement": "device", "chunk_size": CHUNK, "optimizer": OPT, "grad_clip": clip,
           "transaction": "kept_grads"}
    roomy = pstar_fx.plan(model, cfg, gpt_batch(32, 9))
    n, chunk_bytes = len(roomy.placement), roomy.device_breakdown["kept gradients"] // len(roomy.placement)
    budget = roomy.memory.device_peak_bytes - (n - 1) * chunk_bytes + chunk_bytes // 2
    engine = pstar_fx.compile(model, dict(cfg, device_memory=budget), example_inputs=gpt_batch(32, 9))
    k = engine.plan.kept_on_device
    assert (k > 1 if in_activations else k == 1) and set(engine.plan.placement) == {"device"}
    assert engine.plan.kept_in_activations == in_activations
    losses = [engine.step(*b).item() for b in batches]
    assert all((plan.kept_on_device, plan.kept_in_activations) == (k, in_activations)
               for plan in engine.shapes.plans.values())
    assert len(engine.shapes) == 3 and engine.rt.store.stats.host_bytes == (n - k) * chunk_bytes
    assert_losses_close(losses, [o[0] for o in ref_out], [o[0] for o in ref.__dict__["float64_truth"][2]])
    assert_weights_close(engine.state_dict(), ref)


def test_seq_buckets_plan_for_the_largest_and_padding_keeps_the_loss():
    model = tiny_gpt()
    buckets = [8, 16, 32]
    with pytest.raises(ValueError, match=r"sequence length 16.*largest bucket.*32"):
        pstar_fx.compile(model, pstar_fx.Config(device="cpu", seq_buckets=buckets), example_inputs=gpt_batch(16, 0))
    with pytest.raises(ValueError, match="seq_buckets: a length appears twice"):
        pstar_fx.Config(seq_buckets=[8, 8])
    with pytest.raises(ValueError, match="seq_buckets: expected None or a list of positive"):
        pstar_fx.Config(seq_buckets=[0, 8])
    assert pstar_fx.Config(seq_buckets=[32, 8, 16]).seq_buckets == (8, 16, 32)
    with pytest.raises(ValueError, match=r"sequence length 16.*largest bucket.*32"):      # pstar_fx.plan alike
        pstar_fx.plan(model, pstar_fx.Config(device="cpu", seq_buckets=buckets), example_inputs=gpt_batch(16, 0))
    # a batch of length 20, padded up to its bucket with labels -100 (ignored by cross_entropy), has the loss and
    # gradients of the unpadded batch: one step from the same weights lands where eager lands without padding
    batch = gpt_batch(20, seed=5)
    padded = (pstar_fx.pad_to_bucket(batch[0], buckets, 0), pstar_fx.pad_to_bucket(batch[1], buckets, -100))
    assert padded[0].shape == (2, 32) and bool((padded[1][:, 20:] == -100).all())
    ref, ref_out = reference(model, [batch], grad_clip=math.inf)
    engine = compile_host_heavy(model, gpt_batch(32, 0), seq_buckets=buckets)
    assert sorted(key[0][0] for key in engine.shapes.shapes) == [(2, 8), (2, 16), (2, 32)]   # lowered at compile
    assert all(plan.fits for plan in engine.shapes.plans.values())
    before = chunk_memory(engine)
    with pytest.raises(ValueError, match=r"sequence length 20 is not one of seq_buckets \[8, 16, 32\]: pad the "
                                         r"batch up to 32"):
        engine.step(*batch)
    loss = engine.step(*padded).item()
    assert_losses_close([loss], [ref_out[0][0]], [ref.__dict__["float64_truth"][2][0][0]])
    assert_weights_close(engine.state_dict(), ref)
    # every bucket runs under the budget sized at the largest (the CPU runner enforces device_memory)
    for t in buckets[:2]:
        engine.step(*gpt_batch(t, seed=t))
    assert len(engine.shapes) == 3 and engine.memory_stats()["device_peak_bytes"] <= engine.config.device_memory
    assert chunk_memory(engine) == before
    with pytest.raises(ValueError, match="longer than the largest"):
        pstar_fx.pad_to_bucket(torch.zeros(2, 40), buckets, 0)


def test_a_length_the_chunk_memory_cannot_serve_is_a_budget_error_naming_it():
    model = tiny_gpt()
    engine = compile_host_heavy(model, gpt_batch(8, 0))
    before = chunk_memory(engine)
    with pytest.raises(pstar_fx.BudgetError, match=r"sequence length 64 \(input shapes \[\(2, 64\), \(2, 64\)\]\) "
                                                   r"cannot run on the chunk memory compiled for .*missing"):
        engine.step(*gpt_batch(64, 1))
    assert engine.steps == 0 and chunk_memory(engine) == before and len(engine.shapes) == 1
    with pytest.raises(TypeError, match=r"input 0: dtype torch.int32, but the step was compiled for torch.int64"):
        engine.step(*(x.int() for x in gpt_batch(16, 3)))   # another shape gets a graph; another dtype does not
    engine.step(*gpt_batch(8, 2))                      # the engine still trains at the compiled shape
    engine.step(*(x[:, :16] for x in gpt_batch(32, 4)))  # and at one that fits, from strided (non-contiguous) views
    assert engine.steps == 2 and len(engine.shapes) == 2


def test_checkpoint_resumes_across_shapes(tmp_path):
    model = tiny_gpt()
    first, then = [gpt_batch(16, 0), gpt_batch(32, 1)], [gpt_batch(24, 2), gpt_batch(16, 3)]
    a = compile_host_heavy(copy.deepcopy(model), gpt_batch(32, 9), grad_clip=1.0)
    for b in first:
        a.step(*b)
    a.save(tmp_path / "ck")
    losses_a = [a.step(*b).item() for b in then]
    b_engine = compile_host_heavy(copy.deepcopy(model), gpt_batch(32, 9), grad_clip=1.0)
    b_engine.load(tmp_path / "ck")
    assert b_engine.steps == 2
    losses_b = [b_engine.step(*b).item() for b in then]
    assert losses_b == losses_a                       # bit-exact: the same graphs on the same state
    sa, sb = a.state_dict(), b_engine.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.steps == b_engine.steps == 4


def test_cli_trains_the_buckets_in_turn_and_resumes_exactly(tmp_path, capsys):
    from safetensors.torch import load_file

    from pstar_fx.cli import main
    flags = ["train", "--model", "tiny", "--seq-buckets", "16,32", "--log-every", "1", "--grad-clip", "0.5"]
    assert main([*flags, "--steps", "4", "--save", str(tmp_path / "whole")]) == 0
    out = capsys.readouterr().out
    assert "batch 8 x seq 32" in out and "at length 32, fewer at lengths 16 in turn" in out
    assert re.search(r"a new input shape \[\(8, 16\), \(8, 16\)\] \(sequence length 16\)", out)
    assert out.index("sequence length 16") < out.index("step     1")          # lowered at compile
    assert main([*flags, "--steps", "3", "--save", str(tmp_path / "half")]) == 0
    capsys.readouterr()
    # the resumed run goes on with the length the next step had: 3 + 1 steps equal 4
    assert main([*flags, "--steps", "1", "--resume", str(tmp_path / "half"), "--save", str(tmp_path / "half")]) == 0
    a, b = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("half", "whole"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(SystemExit):
        main([*flags, "--seq", "16", "--steps", "1"])
    assert "with --seq-buckets the step is compiled at the largest bucket, 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--model", "tiny", "--seq-buckets", "16,16"])
    assert "a length appears twice" in capsys.readouterr().err
