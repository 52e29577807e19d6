"""lightning: `Trainer(strategy="pstar_fx")` — a LightningModule's `training_step` loss compiled and run by an engine.

    import pstar_fx.integrations.lightning          # registers strategy="pstar_fx"
    trainer = lightning.Trainer(strategy="pstar_fx", gradient_clip_val=1.0, accumulate_grad_batches=4,
                                precision="bf16-mixed")
    # or, with a budget: strategy=PstarStrategy(Config(device_memory="40GB"))

What the strategy does with Lightning's loop (the shape of DeepSpeedStrategy's, our own code):
  - the engine compiles the module's `training_step(batch, batch_idx)` as the loss of one micro-batch
    (`TrainingStepLoss`), at the first training batch, and runs forward, backward, clipping and AdamW as one
    `engine.step`; Lightning's own backward and optimizer.step never run (`backward` and `optimizer_step` here
    only run the closure), and the strategy handles accumulation: it keeps `accumulate_grad_batches`
    micro-batches and steps the engine on them together, as `Config.grad_accum` does;
  - the Trainer's `gradient_clip_val` (norm clipping), `accumulate_grad_batches` and `precision` ("32-true",
    "bf16-mixed", "16-mixed"), and the AdamW (or Adam) and LR scheduler `configure_optimizers` returns, are read
    into the engine's Config; anything it cannot run exactly is an error naming it, before the first step;
  - checkpoints are the engine's directory (safetensors weights under the module's names, moments, loop state),
    with Lightning's own state (loops, callbacks, hyperparameters) beside them in `lightning_state.pt`;
  - after each step it logs loss, lr, grad_norm, clip_coef, skipped, seconds and the memory peaks through the
    module's `log_dict`, i.e. the Trainer's own loggers;
  - the LightningModule's parameters keep the weights they had at the first step while training runs in chunk
    memory; they are written back before validation, test and predict, and at the end of fit.

Limits (the README's "Lightning" section has them all): one process (no DDP); `training_step` runs only while it is
traced, on fake tensors, so `self.log` inside it logs nothing (it is called without a trainer), it may not read
`self.trainer` or do anything but compute the loss from the batch, and `batch_idx` is 0 there; batches are a
tensor, a tuple/list of tensors or a dict of tensors; manual optimization and `configure_gradient_clipping` are not
supported. Fabric is not supported: its loop calls `backward` and `optimizer.step` itself, which the engine's one
step cannot split.
"""
from __future__ import annotations

import dataclasses
import inspect
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:        # the extra is not installed
    raise ImportError("pstar_fx.integrations.lightning needs Lightning: pip install 'pstar_fx[lightning]'") from e

import pstar_fx
from pstar_fx.config import Config

NAME = "pstar_fx"
LIGHTNING_STATE = "lightning_state.pt"      # Lightning's part of a checkpoint directory: loops, callbacks, hparams
# Trainer(precision=...) -> Config.dtype; the others ("bf16-true", "64-true", ...) change the module's own dtype,
# which the engine does not train
PRECISIONS = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}
OPTIMIZERS = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam"}
# the Config fields the Trainer and configure_optimizers decide: set there, not in the strategy's Config
FROM_TRAINER = {"grad_clip": "Trainer(gradient_clip_val=...)", "grad_accum": "Trainer(accumulate_grad_batches=...)",
                "dtype": "Trainer(precision=...)", "optimizer": "configure_optimizers()",
                "lr_schedule": "configure_optimizers()"}


class TrainingStepLoss(nn.Module):
    """A LightningModule's `training_step` as a model whose forward returns the loss: what the engine compiles.

    It holds the module's own parameters, buffers and submodules under the same names (the very same dicts, not a
    child module), so the engine's state_dict and checkpoints speak the LightningModule's names and `engine.export`
    writes into it. forward takes the batch as the engine's inputs (`batch_kind` says how to rebuild it)."""

    def __init__(self, module: nn.Module, batch_kind: str):
        super().__init__()
        self.__dict__["lightning_module"] = module
        for d in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            self.__dict__[d] = module.__dict__[d]
        self.training = module.training
        self.batch_kind = batch_kind
        params = inspect.signature(module.training_step).parameters
        self.takes_batch_idx = "batch_idx" in params or len(params) >= 2

    def forward(self, *args, **kwargs):
        if self.batch_kind == "dict":
            batch = kwargs
        elif self.batch_kind == "tensor":
            batch = args[0]
        else:
            batch = list(args) if self.batch_kind == "list" else tuple(args)
        step = self.lightning_module.training_step
        with warnings.catch_warnings():
            # traced without a trainer (a copy on fake tensors): its self.log calls log nothing, and say so
            warnings.filterwarnings("ignore", message=".*`self.log\\(\\)` but the `self.trainer` reference")
            return step(batch, 0) if self.takes_batch_idx else step(batch)


def batch_inputs(batch) -> tuple[str, Any]:
    """(kind, the engine's inputs) of a Lightning batch: a tensor, a tuple or list of tensors, or a dict of them."""
    if isinstance(batch, torch.Tensor):
        return "tensor", (batch,)
    if isinstance(batch, Mapping) and all(isinstance(v, torch.Tensor) for v in batch.values()):
        return "dict", dict(batch)
    if isinstance(batch, (tuple, list)) and batch and all(isinstance(v, torch.Tensor) for v in batch):
        return ("list" if isinstance(batch, list) else "tuple"), tuple(batch)
    raise TypeError(f"the pstar_fx strategy takes a batch that is a tensor, a tuple or list of tensors or a dict of "
                    f"tensors; got a {type(batch).__name__}" + ("" if not isinstance(batch, (tuple, list, Mapping))
                                                                 else " holding something else (nested or not a "
                                                                      "tensor)"))


def _concat(micro_batches: list):
    """The engine's inputs of k micro-batches: each tensor concatenated along the batch dimension."""
    kind, first = batch_inputs(micro_batches[0])
    parts = [batch_inputs(b)[1] for b in micro_batches]
    if kind == "dict":
        return {k: torch.cat([p[k] for p in parts]) for k in first}
    return tuple(torch.cat([p[i] for p in parts]) for i in range(len(first)))


def optimizer_config(optimizers: list, scheduler_configs: list, module: nn.Module) -> dict:
    """Config fields `optimizer` and `lr_schedule` of what configure_optimizers returned; anything the engine does not
    run exactly (another optimizer, several parameter groups, a subset of the parameters, AMSGrad, another scheduler
    or a per-epoch one) is an error that names it."""
    where = f"{type(module).__name__}.configure_optimizers()"
    if len(optimizers) != 1:
        raise ValueError(f"{where} returned {len(optimizers)} optimizers; the pstar_fx strategy runs one AdamW (or "
                         "Adam) over all trainable parameters")
    opt = optimizers[0]
    kind = OPTIMIZERS.get(type(opt))
    if kind is None:
        raise TypeError(f"{where} returned a {type(opt).__name__}; the pstar_fx strategy runs AdamW (or Adam) "
                        "itself: return torch.optim.AdamW(self.parameters(), lr=..., betas=..., eps=..., "
                        "weight_decay=...)")
    if len(opt.param_groups) != 1:
        raise ValueError(f"{where}: {type(opt).__name__} has {len(opt.param_groups)} parameter groups; the pstar_fx "
                         "strategy takes one (one lr and weight_decay for every parameter)")
    group = opt.param_groups[0]
    for flag in ("amsgrad", "maximize", "differentiable"):
        if group.get(flag):
            raise ValueError(f"{where}: {type(opt).__name__}({flag}=True) is not supported by the pstar_fx strategy")
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    given = {id(p) for p in group["params"]}
    if given != trainable:
        raise ValueError(f"{where}: the optimizer holds {len(given)} parameter tensor(s), but the module has "
                         f"{len(trainable)} trainable ones; the engine trains every parameter with requires_grad=True: "
                         "give the optimizer self.parameters() (freeze the others with requires_grad_(False))")
    lr = group.get("initial_lr", group["lr"])        # a scheduler has already set lr to its first multiple
    optimizer = {"type": kind, "lr": float(lr), "betas": tuple(float(b) for b in group["betas"]),
                 "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"])}
    return {"optimizer": optimizer, "lr_schedule": _schedule(scheduler_configs, where)}


def _schedule(scheduler_configs: list, where: str):
    """Config.lr_schedule of the LR scheduler configure_optimizers returned (or None)."""
    if not scheduler_configs:
        return None
    if len(scheduler_configs) > 1:
        raise ValueError(f"{where} returned {len(scheduler_configs)} LR schedulers; the pstar_fx strategy takes one")
    c = scheduler_configs[0]
    s = c.scheduler
    if c.interval != "step" or c.frequency != 1:
        raise ValueError(f"{where}: the LR scheduler steps every {c.frequency} {c.interval}(s); the engine's schedule "
                         "advances once per optimizer step: return {'scheduler': scheduler, 'interval': 'step'}")
    if type(s) is torch.optim.lr_scheduler.LambdaLR and len(s.lr_lambdas) == 1:
        return s.lr_lambdas[0]             # step -> multiplier, as Config.lr_schedule takes it
    if type(s) is torch.optim.lr_scheduler.CosineAnnealingLR:
        return {"type": "cosine", "warmup_steps": 0, "total_steps": s.T_max, "min_lr": float(s.eta_min)}
    raise TypeError(f"{where} returned a {type(s).__name__} scheduler; the pstar_fx strategy runs LambdaLR (one "
                    "lambda: step -> multiplier, e.g. transformers' get_cosine_schedule_with_warmup) and "
                    "CosineAnnealingLR (held at eta_min after T_max)")


def _precision_dtype(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"Trainer(precision={precision!r}) is not supported by the pstar_fx strategy; use one of "
                         f"{sorted(set(PRECISIONS) - {'32'})} (the engine keeps fp32 master weights and computes in "
                         "the 16-bit dtype of a '-mixed' precision)")
    return PRECISIONS[precision]


class PstarStrategy(SingleDeviceStrategy):
    """A Lightning strategy whose training step is a compiled pstar_fx engine (see the module's docstring).

    config: the engine's Config (a Config, a dict, a JSON path or None) for everything the Trainer does not set:
    device and host budgets, placement, transaction, seed, ... Its device is the strategy's root device."""

    strategy_name = NAME

    def __init__(self, config: Config | dict | str | None = None, accelerator=None, checkpoint_io=None,
                 precision_plugin=None):
        self.config = Config.coerce(config)
        device = torch.device(self.config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device=device, accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.engine: pstar_fx.Engine | None = None
        self.trainer_fields: dict = {}        # the Config fields read from the Trainer and configure_optimizers
        self._micro_batches: list = []        # the accumulating step's micro-batches so far
        self._resume: Path | None = None      # a checkpoint the engine loads when it compiles
        self._module_stale = False            # the module's parameters lag the engine's weights

    # ---- set-up: the Trainer's settings into the Config -----------------------------------------------------
    @property
    def handles_gradient_accumulation(self) -> bool:
        return True                           # the engine accumulates: Lightning calls optimizer_step every batch

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False                          # the moments and step count come from the engine's checkpoint

    def setup_environment(self) -> None:
        kind = type(self.accelerator).__name__
        if (kind == "CPUAccelerator") != (self.root_device.type == "cpu"):
            raise ValueError(f"the Trainer's accelerator is a {kind}, but the strategy's Config.device is "
                             f"{self.config.device!r}; give the strategy the same device: "
                             "PstarStrategy(Config(device='cpu' or 'cuda', ...))")
        super().setup_environment()

    def model_to_device(self) -> None:
        # The module stays where it was built (the host, usually): the engine holds the trained weights in its own
        # chunk memory, and the module runs only validation, test and predict.
        pass

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        # to the module's device (its eager validation); a training batch the engine moves itself
        module = self.lightning_module
        if device is None and module is not None:
            device = next((p.device for p in module.parameters()), self.root_device)
        return super().batch_to_device(batch, device, dataloader_idx)

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        self.trainer_fields.update(optimizer_config(self.optimizers, self.lr_scheduler_configs, self.lightning_module))
        self.lr_scheduler_configs = []        # the engine runs the schedule: Lightning must not step it too

    def setup(self, trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            if not self.lightning_module.automatic_optimization:
                raise ValueError("the pstar_fx strategy needs automatic optimization: the engine runs backward and "
                                 "the optimizer step (manual optimization's self.manual_backward cannot reach it)")
            algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
            if trainer.gradient_clip_val and algorithm not in (None, "norm"):
                raise ValueError(f"Trainer(gradient_clip_algorithm={algorithm!r}): the pstar_fx strategy clips by the "
                                 "global norm only (gradient_clip_algorithm='norm')")
            clip = float(trainer.gradient_clip_val) if trainer.gradient_clip_val else None     # 0: no clipping
            self.trainer_fields.update(grad_clip=clip, grad_accum=int(trainer.accumulate_grad_batches),
                                       dtype=_precision_dtype(self.precision_plugin.precision))
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.engine_config()              # a field set twice fails now, not at the first batch

    def engine_config(self) -> Config:
        """The strategy's Config with the fields the Trainer and configure_optimizers set."""
        default = Config(device=self.config.device)
        for key, where in FROM_TRAINER.items():
            if getattr(self.config, key) != getattr(default, key):
                raise ValueError(f"PstarStrategy config: {key} is set by {where}; leave it out of the strategy's "
                                 "Config")
        return dataclasses.replace(self.config, **self.trainer_fields)

    # ---- the step --------------------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx: int | None = None, *args, **kwargs):
        """Keep the micro-batch; on the last of `accumulate_grad_batches`, one engine step on them all. Returns the
        step's loss (a tensor without a graph: the backward was the engine's), or None between micro-batches."""
        trainer = self.lightning_module.trainer
        if batch_idx is None:
            batch_idx = trainer.fit_loop.epoch_loop.batch_idx
        k = self.trainer_fields["grad_accum"]
        self._micro_batches.append(batch)
        if (batch_idx + 1) % k:
            if batch_idx + 1 == trainer.num_training_batches:
                raise ValueError(f"the epoch ends after {len(self._micro_batches)} of accumulate_grad_batches={k} "
                                 "micro-batches: the pstar_fx strategy steps on whole accumulations only; make the "
                                 "training batches per epoch a multiple of it (limit_train_batches, drop_last=True)")
            return None
        inputs = _concat(self._micro_batches)
        if self.engine is None:
            self.engine = self._compile(self._micro_batches[0])
        self._micro_batches = []
        t0 = time.perf_counter()
        loss = self.engine.step(inputs) if isinstance(inputs, dict) else self.engine.step(*inputs)
        seconds = time.perf_counter() - t0
        self._module_stale = True
        for group in self.optimizers[0].param_groups:    # what callbacks read (LearningRateMonitor): the next lr
            group["lr"] = self.engine.lr
        self._log(loss, seconds)
        return loss

    def _compile(self, micro_batch) -> pstar_fx.Engine:
        kind, example = batch_inputs(micro_batch)
        model = TrainingStepLoss(self.lightning_module, kind)
        engine = pstar_fx.compile(model, self.engine_config(), example, resume=self._resume)
        self._resume = None
        return engine

    def _log(self, loss: torch.Tensor, seconds: float) -> None:
        """The step's record, with the keys of `pstar-fx train --metrics` (not tokens_per_s and tflops: the strategy
        does not know what a batch's tokens are), through the Trainer's loggers."""
        r = self.engine.last_step
        s = self.engine.memory_stats()
        values = {"lr": r.lr, "clip_coef": r.clip_coef, "skipped": float(r.skipped), "seconds": seconds,
                  "device_peak_bytes": float(s["device_peak_bytes"]), "host_peak_bytes": float(s["host_peak_bytes"])}
        if r.grad_norm is not None:
            values["grad_norm"] = r.grad_norm
        module = self.lightning_module
        module.log("loss", float(loss), on_step=True, on_epoch=False, prog_bar=True)
        module.log_dict(values, on_step=True, on_epoch=False)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args, **kwargs) -> torch.Tensor:
        return closure_loss                   # the engine's step ran the backward

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """Run the closure (training_step, which steps the engine): Lightning's optimizer never steps."""
        with warnings.catch_warnings():       # between micro-batches training_step returns None, on purpose
            warnings.filterwarnings("ignore", message=".*`training_step` returned `None`")
            return closure()

    # ---- the module's weights ----------------------------------------------------------------------------------
    def sync_module(self) -> None:
        """Write the engine's weights into the LightningModule's parameters (and buffers)."""
        if self.engine is not None and self._module_stale:
            self.engine.export(self.lightning_module)         # the engine's names are the module's own
            self._module_stale = False

    def on_validation_start(self) -> None:
        self.sync_module()

    def on_test_start(self) -> None:
        self.sync_module()

    def on_predict_start(self) -> None:
        self.sync_module()

    def on_train_end(self) -> None:
        self.sync_module()

    # ---- checkpoints: the engine's directory, Lightning's state beside its files ----------------------------------
    def lightning_module_state_dict(self) -> dict:
        return {}                             # the weights are the engine checkpoint's

    def optimizer_state(self, optimizer) -> dict:
        return {}                             # the moments too

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("the pstar_fx strategy writes its checkpoint itself: storage_options is not supported")
        if self.engine is None:
            raise RuntimeError("the pstar_fx strategy has no checkpoint to save before the first training step: "
                               "the engine compiles at the first batch")
        if self._micro_batches:
            raise RuntimeError("a checkpoint between the micro-batches of an accumulation would lose them; save at "
                               "an optimizer step")
        self.engine.save(filepath)
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        torch.save(state, Path(filepath) / LIGHTNING_STATE)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        path = Path(checkpoint_path)
        if not (path / LIGHTNING_STATE).is_file():
            raise ValueError(f"{path} is not a checkpoint of the pstar_fx strategy: it has no {LIGHTNING_STATE} (the "
                             "strategy writes a directory: the engine's checkpoint and Lightning's state)")
        checkpoint = torch.load(path / LIGHTNING_STATE, map_location="cpu", weights_only=False)
        from safetensors.torch import load_file
        weights = {}
        for f in sorted(path.glob("model*.safetensors")):
            weights.update(load_file(f))
        checkpoint["state_dict"] = weights
        if self.engine is not None:
            self.engine.load(path)
        else:
            self._resume = path               # moments and step count, when the engine compiles
        return checkpoint

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        module = self.lightning_module
        weights = checkpoint["state_dict"]
        result = module.load_state_dict(weights, strict=False)
        # a tied weight is saved once, under its first name: its other names are not missing
        loaded = {id(t) for name, t in [*module.named_parameters(remove_duplicate=False),
                                        *module.named_buffers(remove_duplicate=False)] if name in weights}
        named = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers())
        missing = [k for k in result.missing_keys if id(named.get(k)) not in loaded]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"the checkpoint does not match {type(module).__name__}: missing {missing[:10]}, "
                               f"unexpected {result.unexpected_keys[:10]}")
        self._module_stale = False

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(NAME, cls, description="pstar_fx: the training step compiled as one graph, "
                                                          "model data in chunks moved between device and host",
                                   override=True)


PstarStrategy.register_strategies(StrategyRegistry)
