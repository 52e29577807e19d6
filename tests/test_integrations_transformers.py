"""PstarTrainer (pstar_fx.integrations.transformers) against the stock transformers Trainer with torch's AdamW, on
the same data, seed and arguments: clipping at 1.0, warm-up + cosine, 2 micro-batches a step, fp32, most chunks'
state on the host. Its output directory loads with from_pretrained, resume_from_checkpoint goes on bit for bit,
fields it cannot honour are named, and TRL's SFTTrainer takes it as a mixin. Tiny models made in the test."""
import copy
import math
import warnings

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (the Trainer needs it: pip install -e '.[hf]')")

import torch  # noqa: E402

import pstar_fx  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from pstar_fx.integrations.transformers import HOOKS, PstarTrainer, config_from_args  # noqa: E402
from test_engine import rounding_tolerance  # noqa: E402
from test_hf import VOCAB, hf_model  # noqa: E402

if not all(hasattr(Trainer, h) for h in HOOKS):
    pytest.skip(f"transformers {transformers.__version__} is older than PstarTrainer needs (5)",
                allow_module_level=True)

SEQ, BATCH, ACCUM, STEPS = 16, 2, 2, 6
ROWS = BATCH * ACCUM * STEPS                      # one epoch is the whole run


def dataset(rows=ROWS, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


def arguments(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
                gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=3e-3, lr_scheduler_type="cosine",
                warmup_steps=2, max_grad_norm=1.0, optim="adamw_torch", weight_decay=0.0, seed=0, use_cpu=True,
                report_to="none", dataloader_num_workers=0, logging_steps=1, save_strategy="no", disable_tqdm=True)
    return TrainingArguments(**(base | kw))


def steps_logged(trainer):
    return [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]


def _batch(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_matches_the_stock_trainer(kind, tmp_path):
    model = hf_model(kind)
    # transformers 5.24 gives GPT2LMHeadModel no loss_type (its class name is not "...ForCausalLM"), and the stock
    # Trainer then counts num_items_in_batch over labels[..., :] rather than the shifted labels[..., 1:] the loss
    # sums: its loss and gradients come out (SEQ - 1) / SEQ of the model's own mean. Naming the loss the model uses
    # anyway (the fallback is ForCausalLM) makes the stock Trainer count as it does for Llama.
    model.loss_type = "ForCausalLM"
    data = dataset()
    stock = Trainer(model=copy.deepcopy(model), args=arguments(tmp_path / "stock"), train_dataset=data)
    stock.train()
    # the float64 twin of the stock run: how far fp32 rounding alone takes it (test_engine.rounding_tolerance)
    truth = Trainer(model=copy.deepcopy(model).double(), args=arguments(tmp_path / "truth"), train_dataset=data)
    truth.train()
    # every chunk's fp32 state on the host: chunks move every step
    ours = PstarTrainer(model=copy.deepcopy(model), args=arguments(tmp_path / "ours"), train_dataset=data,
                        pstar_config={"placement": "host", "chunk_size": 16384})
    before = ours.evaluate(eval_dataset=data[:BATCH])["eval_loss"]    # nothing compiled yet: the model itself
    with torch.no_grad():
        assert before == pytest.approx(copy.deepcopy(model).eval()(**_batch(data[:BATCH])).loss.item(), rel=1e-6)
    ours.train()
    engine = ours.engine
    assert set(engine.plan.placement) == {"host"} and len(engine.plan.placement) > 1, engine.plan.placement
    assert engine.memory_stats()["h2d_bytes"] > 0
    assert engine.steps == STEPS and engine.config.grad_accum == ACCUM and engine.config.grad_clip == 1.0

    a, s, t = steps_logged(ours), steps_logged(stock), steps_logged(truth)
    assert len(a) == len(s) == STEPS
    for k, (x, y, z) in enumerate(zip(a, s, t)):
        # the schedule: HF's formulas, update k at multiplier(k) (0 at the first update, under warm-up)
        assert x["learning_rate"] == y["learning_rate"], (k, x["learning_rate"], y["learning_rate"])
        for key in ("loss", "grad_norm"):
            tol = rounding_tolerance(y[key], z[key], k + 1)
            assert abs(x[key] - y[key]) <= tol * abs(y[key]), f"step {k} {key}: {x[key]} vs stock {y[key]}"
    assert a[0]["learning_rate"] == 0.0 and max(r["grad_norm"] for r in a) > 1.0   # warm-up; clipping triggered
    assert engine.last_step.lr == s[-1]["learning_rate"]

    # trainer.model is the trained model, as after Trainer.train; weights within the rounding reach
    start = dict(model.named_parameters())
    exact = dict(truth.model.named_parameters())
    got = dict(ours.model.named_parameters())
    for name, p in stock.model.named_parameters():
        # an element whose true gradient is zero (GPT-2's key bias under softmax) gets rounding noise as gradient,
        # which Adam turns into lr-sized steps: the float64 run leaves it where it started, so it is left out
        moved = (exact[name].detach() - start[name].detach().double()).abs() > 1e-12
        r, w, e = p.detach()[moved], got[name].detach()[moved], exact[name].detach()[moved]
        err = ((w - r).norm() / r.norm()).item()
        assert err <= rounding_tolerance(r, e, STEPS), f"{name}: relative error {err:.2e}"

    # its output directory: the engine's checkpoint, which from_pretrained reads
    ours.save_model()
    back = type(model).from_pretrained(tmp_path / "ours").eval()
    trained = ours.model.eval()
    batch = _batch(data[:BATCH])
    with torch.no_grad():
        assert torch.equal(back(**batch).logits, trained(**batch).logits)
        want = trained(**batch).loss.item()
    # evaluation is engine.evaluate: the eval-mode loss of the trained weights
    metrics = ours.evaluate(eval_dataset=data[:BATCH])
    assert metrics["eval_loss"] == pytest.approx(want, rel=1e-6)


def test_bf16_stays_close_to_the_stock_trainer(tmp_path):
    """bf16=True: the engine computes in bf16 (Config.dtype; accelerate's autocast is not used), the stock Trainer
    under CPU autocast: the losses step by step and the weights as a whole within bf16's reach, as
    test_engine.test_16bit_stays_close_to_fp32 holds the engine to fp32."""
    model = hf_model("llama")
    data = dataset()
    stock = Trainer(model=copy.deepcopy(model), args=arguments(tmp_path / "stock", bf16=True), train_dataset=data)
    stock.train()
    ours = PstarTrainer(model=copy.deepcopy(model), args=arguments(tmp_path / "ours", bf16=True), train_dataset=data)
    ours.train()
    assert ours.engine.config.dtype == "bf16" and ours.engine.dtype == torch.bfloat16
    a, s = steps_logged(ours), steps_logged(stock)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in a]), torch.tensor([r["loss"] for r in s]),
                               rtol=2e-2, atol=0)
    assert [r["learning_rate"] for r in a] == [r["learning_rate"] for r in s]
    got, want = ours.model.state_dict(), stock.model.state_dict()
    diff = torch.sqrt(sum(((got[k] - want[k]) ** 2).sum() for k in want))
    assert diff <= 2e-2 * torch.sqrt(sum((v ** 2).sum() for v in want.values()))


def test_resume_from_checkpoint_continues_bit_for_bit(tmp_path):
    model = hf_model("llama")
    data = dataset()
    held = dataset(rows=2 * BATCH, seed=1)
    whole = PstarTrainer(model=copy.deepcopy(model), args=arguments(tmp_path / "whole", save_strategy="steps",
                                                                    save_steps=3, eval_strategy="steps",
                                                                    eval_steps=3),
                         train_dataset=data, eval_dataset=held)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        whole.train()
    assert not [w for w in caught if "mode" in str(w.message)]     # evaluating between steps is no mode change
    evals = [h for h in whole.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [3, 6]
    with torch.no_grad():      # the last one is the trained model's eval-mode loss, the mean over the eval batches
        trained = whole.model.eval()
        want = sum(trained(**_batch(held[i:i + BATCH])).loss.item() for i in range(0, len(held), BATCH)) / 2
    assert evals[-1]["eval_loss"] == pytest.approx(want, rel=1e-6)
    ckpt = tmp_path / "whole" / "checkpoint-3"
    assert (ckpt / "trainer_state.json").exists() and (ckpt / "optimizer.safetensors").exists()
    # a checkpoint folder is an HF model folder too
    back = type(model).from_pretrained(ckpt)
    assert sum(p.numel() for p in back.parameters()) == sum(p.numel() for p in model.parameters())

    resumed = PstarTrainer(model=copy.deepcopy(model), args=arguments(tmp_path / "whole"), train_dataset=data)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.engine.steps == STEPS
    # the resumed history holds the checkpoint's steps 1-3, then its own 4-6: the same as one run's, bit for bit
    a, b = steps_logged(whole), steps_logged(resumed)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert [(r["step"], r["loss"], r["grad_norm"], r["learning_rate"]) for r in b] == \
           [(r["step"], r["loss"], r["grad_norm"], r["learning_rate"]) for r in a]
    sa, sb = whole.engine.state_dict(), resumed.engine.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    # save_model() into the output directory, beside its checkpoint folders, which stay
    resumed.save_model()
    out = tmp_path / "whole"
    assert (out / "checkpoint-3" / "trainer_state.json").exists() and (out / "checkpoint-6").is_dir()
    final = type(model).from_pretrained(out)
    assert all(torch.equal(final.state_dict()[k], v) for k, v in resumed.model.state_dict().items())


def test_config_from_arguments(tmp_path):
    args = arguments(tmp_path, bf16=True, lr_scheduler_type="cosine_with_min_lr",
                     lr_scheduler_kwargs={"min_lr_rate": 0.1}, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6,
                     weight_decay=0.1, seed=7, max_grad_norm=0.0)
    cfg = config_from_args(args, 100, {"optimizer_state": "bf16", "device_memory": "64MiB"})
    assert cfg.dtype == "bf16" and cfg.seed == 7 and cfg.grad_clip is None and cfg.grad_accum == ACCUM
    assert cfg.optimizer == {"type": "adamw", "lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    assert cfg.lr_schedule == {"type": "cosine", "warmup_steps": 2, "total_steps": 100,
                               "min_lr": pytest.approx(3e-4)}
    assert cfg.optimizer_state == "bf16" and cfg.device_memory == 64 * 2**20 and cfg.device == "cpu"
    # a Config works as well as a dict: its fields that differ from the defaults
    same = config_from_args(args, 100, pstar_fx.Config(optimizer_state="bf16", device_memory="64MiB"))
    assert same == cfg
    with pytest.raises(ValueError, match="dtype comes from TrainingArguments bf16 / fp16"):
        config_from_args(args, 100, pstar_fx.Config(dtype="fp16"))
    ratio = config_from_args(arguments(tmp_path, warmup_steps=0.1, lr_scheduler_type="linear"), 50)
    assert ratio.lr_schedule == {"type": "linear", "warmup_steps": 5, "total_steps": 50, "min_lr": 0.0}
    assert config_from_args(arguments(tmp_path, lr_scheduler_type="constant"), 50).lr_schedule is None


@pytest.mark.parametrize("kw, message", [
    ({"optim": "sgd"}, "optim='sgd'"),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"}, "load_best_model_at_end"),
])
def test_fields_it_cannot_honour_are_named(kw, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        PstarTrainer(model=hf_model("gpt2"), args=arguments(tmp_path, **kw), train_dataset=dataset(),
                     eval_dataset=dataset(rows=BATCH))


def test_other_refusals_and_the_weight_decay_warning(tmp_path):
    model, data = hf_model("gpt2"), dataset()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizers="):
        PstarTrainer(model=model, args=arguments(tmp_path), train_dataset=data, optimizers=(opt, None))
    with pytest.raises(ValueError, match="compute_metrics="):
        PstarTrainer(model=model, args=arguments(tmp_path), train_dataset=data, compute_metrics=lambda p: {})
    with pytest.raises(ValueError, match="grad_clip comes from TrainingArguments max_grad_norm"):
        PstarTrainer(model=model, args=arguments(tmp_path), train_dataset=data, pstar_config={"grad_clip": 2.0})
    with pytest.raises(ValueError, match="device_memroy.*did you mean device_memory"):
        PstarTrainer(model=model, args=arguments(tmp_path), train_dataset=data, pstar_config={"device_memroy": 1})
    with pytest.raises(ValueError, match="lr_scheduler_type='polynomial'"):
        config_from_args(arguments(tmp_path, lr_scheduler_type="polynomial"), 10)
    with pytest.warns(UserWarning, match="weight_decay=0.1: the engine's AdamW decays every parameter"):
        PstarTrainer(model=model, args=arguments(tmp_path, weight_decay=0.1), train_dataset=data)
    with pytest.warns(UserWarning, match="gradient_checkpointing=True is switched off: the planner decides"):
        t = PstarTrainer(model=model, args=arguments(tmp_path, gradient_checkpointing=True), train_dataset=data)
    assert not t.args.gradient_checkpointing and not getattr(t.args, "activation_checkpointing", False)
    # a step of 3 rows does not split into 2 equal micro-batches: said, with what to do
    short = PstarTrainer(model=model, args=arguments(tmp_path, max_steps=-1, num_train_epochs=1),
                         train_dataset=dataset(rows=BATCH * ACCUM + 1))
    with pytest.raises(ValueError, match="dataloader_drop_last=True"):
        short.train()


@pytest.mark.parametrize("accum", [1, 2])
def test_sft_trainer_takes_it_as_a_mixin(accum, tmp_path):
    """One epoch of a tiny chat dataset, padded per batch to its longest row; with 2 micro-batches a step, those of
    one step are right-padded to one length (masked, labels -100), so each keeps its own loss."""
    pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[trl]')")
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (trl needs it)")
    from trl import SFTConfig, SFTTrainer
    from test_records import chat_tokenizer, sentence, tiny_llama
    import random

    seen = []

    class PstarSFTTrainer(PstarTrainer, SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append({k: v.clone() for k, v in inputs.items()})
            return super().training_step(model, inputs, num_items_in_batch)

    rng = random.Random(0)
    chats = [{"messages": [{"role": "user", "content": sentence(rng)},
                           {"role": "assistant", "content": sentence(rng)}]} for _ in range(8)]
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=accum,
                     num_train_epochs=1, learning_rate=1e-2, use_cpu=True, report_to="none", dataloader_num_workers=0,
                     logging_steps=1, save_strategy="no", disable_tqdm=True, max_length=32, packing=False,
                     optim="adamw_torch", bf16=False)
    # (SFTConfig's own defaults: bf16=True, which PstarTrainer honours as Config.dtype "bf16", and
    # gradient_checkpointing=True, which it switches off with a warning; fp32 here, to compare with the model's own)
    with pytest.warns(UserWarning, match="gradient_checkpointing=True is switched off"):
        trainer = PstarSFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(chats),
                                  processing_class=chat_tokenizer())
    trainer.train()
    steps = 4 // accum
    logged = steps_logged(trainer)
    assert trainer.engine.steps == steps and len(logged) == steps
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in logged)
    assert [r["learning_rate"] for r in logged] == [1e-2 * (1 - k / steps) for k in range(steps)]   # linear, no warm-up
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    lengths = [b["input_ids"].shape[1] for b in seen]
    assert len(set(lengths)) > 1                                        # padded to several lengths: several graphs
    if accum == 2:
        assert any(lengths[i] != lengths[i + 1] for i in range(0, len(lengths), 2))   # padded within a step
    # the first step's loss and gradient norm are the plain model's own on its micro-batches, unpadded (TRL's fused
    # LM head is not used: the engine captures the model's forward): the loss the mean of theirs, the norm within
    # fp32's rounding reach of float64's
    norms = []
    for dtype in (torch.float32, torch.float64):
        m = tiny_llama().to(dtype)
        losses = [m(**b).loss for b in seen[:accum]]
        (sum(losses) / accum).backward()
        norms.append(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in m.parameters())).item())
        if dtype == torch.float32:
            assert logged[0]["loss"] == pytest.approx(sum(x.item() for x in losses) / accum, rel=1e-6)
    assert abs(logged[0]["grad_norm"] - norms[0]) <= rounding_tolerance(norms[0], norms[1], 1) * norms[0]


@pytest.mark.parametrize("kind", ["linear", "cosine", "cosine_with_min_lr", "constant_with_warmup", "constant"])
def test_schedules_give_the_stock_rates_bit_for_bit(kind, tmp_path):
    """Each update's rate from the engine's schedule (Config.lr_schedule, made from the arguments) equals the stock
    Trainer's scheduler (transformers.get_scheduler on its optimizer) at every step, warm-up given as steps or as a
    ratio, over runs that do not divide evenly."""
    from pstar_fx.optim.lr import LrSchedule
    for lr, warmup, total in ((3e-3, 0, 40), (7e-4, 10, 137), (2e-5, 0.06, 250)):
        # (min_lr_rate becomes min_lr = rate x lr, whose quotient by lr may be an ulp off the rate: min_lr is exact)
        kwargs = {"min_lr": lr / 7} if kind == "cosine_with_min_lr" else {}
        args = arguments(tmp_path, learning_rate=lr, warmup_steps=warmup, lr_scheduler_type=kind,
                         lr_scheduler_kwargs=kwargs)
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.AdamW([p], lr=lr)
        stock = transformers.get_scheduler(kind, opt, num_warmup_steps=args.get_warmup_steps(total),
                                           num_training_steps=total, scheduler_specific_kwargs=kwargs)
        ours = LrSchedule(config_from_args(args, total).lr_schedule, lr)
        for k in range(total):
            assert ours.lr(k) == opt.param_groups[0]["lr"], (kind, lr, warmup, total, k)
            opt.step()
            stock.step()


@pytest.fixture
def on_gpu(monkeypatch):
    """Config.compute "auto" is Inductor on CUDA: the regions traced by Dynamo alone instead, as tests/test_gpu.py
    does (the same ops, fast to build; bench/hf_trainer_bench.py runs Inductor's). torch's deterministic mode, which
    a Lightning test in the same process may have left on, is off for the test."""
    import sys
    import pstar_fx.passes.compile_regions  # noqa: F401
    monkeypatch.setattr(sys.modules["pstar_fx.passes.compile_regions"], "BACKEND", "eager")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(was)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["device", "host"])
def test_gpu_matches_the_stock_trainer_on_cpu(placement, tmp_path, on_gpu):
    """use_cpu=False: the Trainer's device is the GPU, so the engine's (Config.device); the model stays on the host.
    fp32, clipping at 1.0, warm-up + cosine, 2 micro-batches a step, every chunk on the GPU or every chunk's state
    on the host: the stock Trainer with torch's AdamW on the CPU, within tests/test_gpu.py's tolerance for CUDA fp32
    against a CPU reference (rel 1e-4: the same arithmetic, other kernels) for the losses, the gradient norms and
    the weights over the whole model; the rates bit for bit."""
    rel = 1e-4
    model = hf_model("llama")
    data = dataset()
    args = arguments(tmp_path / "ours", use_cpu=False)
    if args.n_gpu > 1:
        pytest.skip(f"{args.n_gpu} visible GPUs: the Trainer would batch per_device_train_batch_size x n_gpu rows; "
                    "run it with one (CUDA_VISIBLE_DEVICES=0)")
    stock = Trainer(model=copy.deepcopy(model), args=arguments(tmp_path / "stock"), train_dataset=data)
    stock.train()
    ours = PstarTrainer(model=copy.deepcopy(model), args=args, train_dataset=data,
                        pstar_config={"placement": placement, "chunk_size": 16384})
    ours.train()
    engine = ours.engine
    assert engine.config.device.startswith("cuda") and engine.config.dtype == "fp32"
    assert set(engine.plan.placement) == {placement} and len(engine.plan.placement) > 1, engine.plan.placement
    if placement == "host":
        assert engine.memory_stats()["h2d_bytes"] > 0
    assert engine.steps == STEPS and engine.config.grad_accum == ACCUM and engine.config.grad_clip == 1.0
    assert all(p.device.type == "cpu" for p in ours.model.parameters())    # not moved; the trained weights exported

    a, s = steps_logged(ours), steps_logged(stock)
    assert len(a) == len(s) == STEPS
    assert [x["learning_rate"] for x in a] == [x["learning_rate"] for x in s]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([x[key] for x in a]), torch.tensor([x[key] for x in s]),
                                   rtol=rel, atol=0, msg=lambda m: f"{key}: {m}")
    assert max(x["grad_norm"] for x in s) > 1.0                          # clipping triggered
    got, want = ours.model.state_dict(), stock.model.state_dict()
    diff = torch.sqrt(sum(((got[k] - want[k]) ** 2).sum() for k in want))
    assert diff <= rel * torch.sqrt(sum((v ** 2).sum() for v in want.values())), diff
