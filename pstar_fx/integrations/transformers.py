"""transformers: `PstarTrainer`, a `transformers.Trainer` whose training step is a compiled pstar_fx engine.

The user changes one class name: `Trainer(...)` becomes `PstarTrainer(...)`, and TRL's trainers take it as a mixin
(`class SFT(PstarTrainer, SFTTrainer)`). As accelerate's Megatron-LM integration does, forward, backward and the
update run inside one call, `engine.step`, on an accumulation group's micro-batches put together, and the Trainer's
optimizer is a stand-in whose `step()` does nothing: clipping, the schedule, the update and the step's verdict are
the engine's, and what the Trainer logs (`loss`, `grad_norm`, `learning_rate`) is read from `engine.last_step`.

The engine is compiled on the first training batch, with a `Config` made from the `TrainingArguments`
(`config_from_args`) and `pstar_config=` for what they do not say (budgets, optimizer state, transaction). A field
the engine cannot honour is an error naming it (`check_args`), or a warning where the run still trains as asked
but not as the stock Trainer would (`weight_decay` on every parameter). Checkpoints are the engine's
(`engine.save`: safetensors weights `from_pretrained` reads, the optimizer state, the loop state), written where
the Trainer writes its own, with the Trainer's `trainer_state.json` and RNG state beside them; evaluation is
`engine.evaluate`.
"""
from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch
from transformers import Trainer

import pstar_fx
from pstar_fx.checkpoint import STATE
from pstar_fx.config import Config
from pstar_fx.records import IGNORE_INDEX

log = logging.getLogger("pstar_fx")

# TrainingArguments.optim values whose update is torch.optim.AdamW's, which the engine's is
ADAMW = ("adamw_torch", "adamw_torch_fused")
# the Trainer's methods PstarTrainer replaces, which the loop calls as its own (transformers 5: earlier loops clip
# and read the norm inline, where the engine's could not be handed over)
HOOKS = ("_clip_grad_norm", "_get_grad_norm", "_get_learning_rate", "_build_accelerator_args",
         "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler", "_load_from_checkpoint", "prediction_step")
# Config fields made from the TrainingArguments: set them there, not in pstar_config
DERIVED = ("optimizer", "grad_clip", "grad_accum", "lr_schedule", "dtype", "seed", "device")


def _name(value) -> str:
    """An enum field of TrainingArguments (optim, lr_scheduler_type) as the string a user writes."""
    return str(getattr(value, "value", value))


def check_args(args) -> None:
    """Raise for a TrainingArguments field the engine cannot honour, naming it; warn where it trains otherwise than
    the stock Trainer would, and for gradient checkpointing, which it switches off in `args`."""
    problems = []
    if _name(args.optim) not in ADAMW:
        problems.append(f"optim={_name(args.optim)!r}: the engine's optimizer is AdamW, fused into backward chunk by "
                        f"chunk; use one of {list(ADAMW)} (the same update)")
    if args.optim_args:
        problems.append(f"optim_args={args.optim_args!r}: the engine's AdamW takes adam_beta1/2, adam_epsilon and "
                        "weight_decay only")
    if args.torch_compile:
        problems.append("torch_compile=True: pstar_fx compiles the step itself (Config.compute: Inductor on CUDA)")
    if args.label_smoothing_factor:
        problems.append(f"label_smoothing_factor={args.label_smoothing_factor}: the step's loss is the model's own")
    if args.neftune_noise_alpha is not None:
        problems.append("neftune_noise_alpha: NEFTune's embedding hook is not part of the compiled step")
    if getattr(args, "use_liger_kernel", False):
        problems.append("use_liger_kernel=True: the engine captures the model's own ops")
    if args.deepspeed or args.fsdp:
        problems.append("deepspeed / fsdp: the engine places the model's data itself")
    if args.world_size > 1:
        problems.append(f"world_size={args.world_size}: PstarTrainer runs one process for now (the engine's own data "
                        "parallelism is `torchrun` with pstar_fx.compile, or `pstar-fx train --nproc`)")
    if args.load_best_model_at_end:
        problems.append("load_best_model_at_end=True: not supported yet (the best checkpoint would have to be "
                        "loaded into the engine)")
    if args.fp16_full_eval or args.bf16_full_eval:
        problems.append("fp16_full_eval / bf16_full_eval: evaluation runs engine.evaluate in the training's "
                        "compute dtype")
    if problems:
        raise ValueError("PstarTrainer cannot honour these TrainingArguments:\n  " + "\n  ".join(problems))
    checkpointing = [k for k in ("gradient_checkpointing", "activation_checkpointing") if getattr(args, k, False)]
    if checkpointing:
        # TRL's configs turn it on by default, so it is switched off here rather than refused
        for k in checkpointing:
            setattr(args, k, False)
        warnings.warn(f"{checkpointing[0]}=True is switched off: the planner decides what to recompute, from the "
                      "memory budgets (pstar_config's device_memory)", UserWarning, stacklevel=3)
    if args.weight_decay:
        warnings.warn(f"weight_decay={args.weight_decay}: the engine's AdamW decays every parameter, biases and "
                      "norm weights included; the stock Trainer exempts those (get_decay_parameter_names)",
                      UserWarning, stacklevel=3)


def lr_schedule_of(args, max_steps: int):
    """Config.lr_schedule for the TrainingArguments' scheduler over `max_steps` updates. The formulas are Hugging
    Face's (pstar_fx/optim/lr.py), and update k (from 0) uses multiplier(k), as the Trainer's LambdaLR does."""
    kind = _name(args.lr_scheduler_type)
    kwargs = dict(args.lr_scheduler_kwargs or {})
    warmup = args.get_warmup_steps(max_steps)
    cycles = kwargs.pop("num_cycles", 0.5)
    if kind in ("cosine", "cosine_with_min_lr") and cycles != 0.5:
        raise ValueError(f"lr_scheduler_kwargs num_cycles={cycles}: the engine's cosine is one half-cycle (0.5)")
    spec = None
    if kind in ("linear", "cosine", "cosine_with_min_lr") and warmup >= max_steps:
        spec = {"type": "constant", "warmup_steps": warmup}   # every update runs under warm-up: the same rates
    elif kind == "constant":
        spec = None                                   # HF's get_constant_schedule has no warm-up either
    elif kind == "constant_with_warmup":
        spec = {"type": "constant", "warmup_steps": warmup}
    elif kind in ("linear", "cosine"):
        spec = {"type": kind, "warmup_steps": warmup, "total_steps": max_steps}
    elif kind == "cosine_with_min_lr":
        if ("min_lr" in kwargs) == ("min_lr_rate" in kwargs):
            raise ValueError("lr_scheduler_type='cosine_with_min_lr' needs one of min_lr or min_lr_rate in "
                             "lr_scheduler_kwargs")
        min_lr = kwargs.pop("min_lr", None)
        if min_lr is None:
            min_lr = kwargs.pop("min_lr_rate") * args.learning_rate
        spec = {"type": "cosine", "warmup_steps": warmup, "total_steps": max_steps, "min_lr": min_lr}
    else:
        raise ValueError(f"lr_scheduler_type={kind!r}: the engine's schedules are linear, cosine, cosine_with_min_lr, "
                         "constant and constant_with_warmup")
    if kwargs:
        raise ValueError(f"lr_scheduler_kwargs {sorted(kwargs)}: not part of the engine's {kind} schedule")
    return spec


def config_from_args(args, max_steps: int, pstar_config: Config | dict | None = None) -> Config:
    """The engine's Config for these TrainingArguments: max_grad_norm -> grad_clip (exact), the scheduler and
    warm-up -> lr_schedule, gradient_accumulation_steps -> grad_accum, bf16/fp16 -> dtype, AdamW's fields ->
    optimizer, seed, and the device; `pstar_config` (a Config or a dict of its fields) gives the rest."""
    extra = _extra_fields(pstar_config)
    device = args.device
    fields = dict(
        device="cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}",
        dtype="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        optimizer={"type": "adamw", "lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
                   "eps": args.adam_epsilon, "weight_decay": args.weight_decay},
        grad_clip=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None,
        grad_accum=args.gradient_accumulation_steps,
        lr_schedule=lr_schedule_of(args, max_steps),
        seed=args.seed)
    return Config(**fields, **extra)


def _extra_fields(pstar_config: Config | dict | None) -> dict:
    """pstar_config's fields, refusing the ones the TrainingArguments set (a Config's fields where they differ
    from the defaults)."""
    if pstar_config is None:
        return {}
    if isinstance(pstar_config, Config):
        default = Config(device=pstar_config.device)
        extra = {k: getattr(pstar_config, k) for k in pstar_config.__dataclass_fields__
                 if k != "device" and getattr(pstar_config, k) != getattr(default, k)}
        if pstar_config.device != Config().device:
            extra["device"] = pstar_config.device
    elif isinstance(pstar_config, dict):
        extra = dict(pstar_config)
        Config.from_dict(extra)                               # unknown keys and bad values: named now
    else:
        raise TypeError(f"pstar_config: expected a pstar_fx.Config or a dict, got {type(pstar_config).__name__}")
    where = {"optimizer": "learning_rate, adam_beta1/2, adam_epsilon, weight_decay", "grad_clip": "max_grad_norm",
             "grad_accum": "gradient_accumulation_steps", "lr_schedule": "lr_scheduler_type, warmup_steps",
             "dtype": "bf16 / fp16", "seed": "seed", "device": "use_cpu (or the visible GPUs)"}
    taken = [k for k in DERIVED if k in extra]
    if taken:
        raise ValueError("pstar_config: " + "; ".join(f"{k} comes from TrainingArguments {where[k]}" for k in taken))
    return extra


class EngineOptimizer(torch.optim.Optimizer):
    """The Trainer's optimizer while the engine trains: a stand-in whose `step()` does nothing, since the update
    ran inside `engine.step`. It holds one placeholder parameter so that the Trainer's scheduler has a group."""

    def __init__(self, lr: float):
        super().__init__([torch.nn.Parameter(torch.zeros(()))], {"lr": lr})

    def step(self, closure=None):
        return None


class PstarTrainer(Trainer):
    """`transformers.Trainer` with the training step compiled by pstar_fx: change the class name, keep the rest.
    `pstar_config` (a `pstar_fx.Config` or a dict of its fields) gives what the TrainingArguments do not say:
    `device_memory`, `host_memory`, `optimizer_state`, `transaction`, ... `self.engine` is the engine once the
    first batch has compiled it; when `train()` returns, `self.model` holds the trained weights."""

    def __init__(self, *args, pstar_config: Config | dict | None = None, **kwargs):
        missing = [h for h in HOOKS if not hasattr(Trainer, h)]
        if missing:
            import transformers
            raise ImportError(f"PstarTrainer needs transformers 5 or later (this is {transformers.__version__}: its "
                              f"Trainer has no {missing})")
        self.pstar_config = pstar_config
        self.engine: pstar_fx.Engine | None = None
        self._resume_from: str | None = None       # a checkpoint to compile with (resume_from_checkpoint)
        self._micro: list[dict] = []               # the accumulation group's micro-batches so far
        self._said_token_weighting = False
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        if given is not None:
            check_args(given)     # before the Trainer (or TRL's) __init__ acts on gradient checkpointing
        super().__init__(*args, **kwargs)
        if given is None:
            check_args(self.args)
        _extra_fields(pstar_config)                 # its errors now, not at the first batch
        if self.optimizer is not None or self.lr_scheduler is not None or self.optimizer_cls_and_kwargs is not None:
            raise ValueError("optimizers= / optimizer_cls_and_kwargs=: the engine's AdamW and schedule replace them; "
                             "set learning_rate, adam_*, weight_decay and lr_scheduler_type in TrainingArguments")
        if self.compute_loss_func is not None:
            raise ValueError("compute_loss_func=: the compiled step's loss is the model's own (pass labels)")
        if self.compute_metrics is not None or self.preprocess_logits_for_metrics is not None:
            raise ValueError("compute_metrics= / preprocess_logits_for_metrics=: evaluation is engine.evaluate, "
                             "which gives the loss only")

    # ---- the model stays where it is: the engine places its data in chunks on its tiers ------------------
    def _move_model_to_device(self, model, device):
        pass                          # a model larger than the GPU cannot go there whole

    def _build_accelerator_args(self, **kwargs):
        args = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"   # the engine casts (Config.dtype): no autocast or scaler of accelerate's
        return args

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.device_placement = False     # prepare() must not move the model to the GPU either

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = EngineOptimizer(self.args.learning_rate)
        return self.optimizer

    # ---- the step ----------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Collect the accumulation group's micro-batches; on its last, run them as one engine step. Returns the
        step's loss on the last micro-batch and 0 on the others, so the Trainer's sum over a step is the step's
        loss (the mean of its micro-batches' losses, each the model's own mean)."""
        # train mode, as the stock step sets it: an evaluation between steps left the model in eval mode, and the
        # engine would say at each step that the mode changed after compile
        model.train()
        self._micro.append(_tensors(inputs))
        if not self.accelerator.gradient_state.sync_gradients:
            return torch.zeros((), device=self.args.device)
        micro, self._micro = self._micro, []
        if self.engine is None:
            self._compile(micro[0])
        self._check_token_weighting(micro)
        pad_id = getattr(self.processing_class, "pad_token_id", None)
        self.engine.step(_concat(micro, self.args.gradient_accumulation_steps, pad_id or 0))
        return torch.tensor(self.engine.last_step.loss, device=self.args.device)

    def _compile(self, example: dict) -> None:
        config = config_from_args(self.args, self.state.max_steps, self.pstar_config)
        model = self.accelerator.unwrap_model(self.model)
        model.train()                                 # the step is captured in the mode the model is in
        resume, self._resume_from = self._resume_from, None
        # TRL's SFTTrainer replaces forward on the instance (a fused LM head, used only when asked for, around the
        # original forward bound to this very model): a copy of the model would still call the original's weights.
        # The class's own forward, which that wrapper calls anyway, is captured; the wrapper is put back after.
        patched = model.__dict__.pop("forward", None)
        try:
            self.engine = pstar_fx.compile(model, config, example_inputs=example, resume=resume)
        finally:
            if patched is not None:
                model.forward = patched
        log.info("PstarTrainer: compiled; %s", self.engine.plan.summary().splitlines()[0])

    def _check_token_weighting(self, micro: list[dict]) -> None:
        """Say once when the micro-batches train different numbers of tokens: the stock Trainer then weighs each
        token alike over the group (num_items_in_batch), the engine each micro-batch alike."""
        if len(micro) < 2 or self._said_token_weighting or "labels" not in micro[0]:
            return
        counts = {int((m["labels"][..., 1:] != -100).sum()) for m in micro}
        if len(counts) > 1:
            self._said_token_weighting = True
            warnings.warn("the micro-batches of a step train different numbers of tokens: the engine's loss is the "
                          "mean of their means (each micro-batch weighs alike), while the stock Trainer divides the "
                          "sum over the step's tokens by their count (num_items_in_batch)", UserWarning, stacklevel=3)

    def _clip_grad_norm(self, model):
        return self._engine_grad_norm()

    def _get_grad_norm(self, model, grad_norm=None):
        return self._engine_grad_norm()

    def _engine_grad_norm(self):
        r = self.engine.last_step if self.engine is not None else None
        return None if r is None else r.grad_norm

    def _get_learning_rate(self):
        if self.engine is not None and self.engine.last_step is not None:
            return self.engine.last_step.lr               # the rate the last update used
        return super()._get_learning_rate()

    def train(self, *args, **kwargs):
        out = super().train(*args, **kwargs)
        if self.engine is not None:
            model = self.accelerator.unwrap_model(self.model)
            if not any(p.is_meta for p in model.parameters()):
                self.engine.export(model)                 # trainer.model is the trained model, as after Trainer
        return out

    # ---- evaluation ---------------------------------------------------------------------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if self.engine is None:                           # nothing trained yet: the model's own weights
            where = next(self.accelerator.unwrap_model(model).parameters()).device
            if where != self.args.device:
                raise RuntimeError(f"evaluation before the first training step runs the model itself, which is on "
                                   f"{where} (PstarTrainer leaves it where it is) and not on {self.args.device}; "
                                   "evaluate after training starts, or move the model there first")
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        loss = self.engine.evaluate(_tensors(inputs))
        return loss.to(self.args.device), None, None

    # ---- checkpoints: the engine's, where the Trainer writes its own ----------------------------------------
    def _save(self, output_dir=None, state_dict=None):
        if self.engine is None:
            return super()._save(output_dir, state_dict=state_dict)
        output_dir = Path(output_dir if output_dir is not None else self.args.output_dir)
        if not self.args.should_save:
            return
        _save_engine(self.engine, output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, output_dir / "training_args.bin")

    def _save_optimizer_and_scheduler(self, output_dir):
        if self.engine is None:
            super()._save_optimizer_and_scheduler(output_dir)
        # else: the engine's checkpoint holds the moments and the step count, which is the schedule's position

    def _save_scaler(self, output_dir):
        if self.engine is None:
            super()._save_scaler(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not (Path(resume_from_checkpoint) / STATE).exists():
            raise ValueError(f"resume_from_checkpoint={str(resume_from_checkpoint)!r}: not a PstarTrainer checkpoint "
                             f"(no {STATE}); a stock Trainer's optimizer state cannot be read into the engine")
        if self.engine is not None:
            self.engine.load(resume_from_checkpoint)
        else:
            self._resume_from = str(resume_from_checkpoint)   # compiled with it at the first batch

    def _load_optimizer_and_scheduler(self, checkpoint):
        pass                                      # in the engine's checkpoint, loaded with the weights

    def _load_scaler(self, checkpoint):
        pass


def _tensors(inputs: dict) -> dict:
    """A batch as the engine takes it: its tensors by name (None values dropped, other values refused)."""
    out = {}
    for k, v in inputs.items():
        if v is None:
            continue
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"batch key {k!r}: a {type(v).__name__}; the compiled step takes tensors only")
        out[k] = v
    return out


# what right-padding fills each key with: masked out of attention, ignored by the loss (the pad id is the
# tokenizer's where it has one)
PAD_VALUES = {"labels": IGNORE_INDEX, "attention_mask": 0}


def _concat(micro: list[dict], k: int, pad_id: int = 0) -> dict:
    """The accumulation group's micro-batches as one batch, which the engine splits into its `k` micro-batches
    again. Micro-batches padded to different lengths (a collator that pads to the longest row) are right-padded to
    the longest when they carry an attention_mask: the padding is masked out of attention and its labels are -100,
    so every micro-batch's loss and gradients are its own. A short last group of an epoch (fewer micro-batches, or
    a short last batch) splits into k smaller ones when its rows divide by k: each then holds as many rows."""
    if len(micro) == 1 and k == 1:
        return micro[0]
    first = micro[0]
    if any(m.keys() != first.keys() for m in micro):
        raise ValueError(f"gradient_accumulation_steps={k}: the step's micro-batches hold different keys "
                         f"({[sorted(m) for m in micro]})")
    longest = max((m[n].shape[1] for m in micro for n in ("input_ids", "labels", "attention_mask")
                   if n in m and m[n].dim() == 2), default=0)
    batch = {}
    for n in first:
        parts = [m[n] for m in micro]
        if any(p.shape[1:] != parts[0].shape[1:] for p in parts):
            ragged_ok = ("attention_mask" in first and n in ("input_ids", "labels", "attention_mask")
                         and all(p.dim() == 2 for p in parts))
            if not ragged_ok:
                shapes = [{key: tuple(t.shape) for key, t in m.items()} for m in micro]
                raise ValueError(f"gradient_accumulation_steps={k}: the step's micro-batches differ in the shape of "
                                 f"{n!r} ({shapes}) and cannot be padded to one length here (that needs an "
                                 "attention_mask, and only input_ids, labels and attention_mask vary); pad every "
                                 "batch to one length (e.g. the collator's padding='max_length')")
            value = PAD_VALUES.get(n, pad_id)
            parts = [torch.nn.functional.pad(p, (0, longest - p.shape[1]), value=value) for p in parts]
        batch[n] = torch.cat(parts)
    rows = next(iter(batch.values())).shape[0]
    if rows % k:
        raise ValueError(f"gradient_accumulation_steps={k}: this step has {rows} rows, which do not split into {k} "
                         "equal micro-batches (the epoch's last, short step); set dataloader_drop_last=True or give "
                         "a dataset whose size divides by per_device_train_batch_size x gradient_accumulation_steps")
    return batch


def _save_engine(engine, output_dir: Path) -> None:
    """engine.save into `output_dir`. It replaces its directory whole, and the Trainer's output_dir may hold other
    things (checkpoint-N folders): there it writes into a folder inside and moves the files up, replacing the
    previous save's own files (a stale shard index would mislead from_pretrained)."""
    if not output_dir.exists() or not any(output_dir.iterdir()):
        engine.save(output_dir)
        return
    inner = output_dir / ".pstar_fx-save"
    engine.save(inner)
    for old in output_dir.iterdir():
        if old.is_file() and (old.name.startswith(("model", "optimizer", "adapter_model")) and ".safetensors" in
                              old.name or old.name in (STATE, "adapter_config.json")):
            old.unlink()
    for f in inner.iterdir():
        os.replace(f, output_dir / f.name)
    inner.rmdir()
