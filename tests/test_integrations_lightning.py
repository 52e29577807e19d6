"""The Lightning strategy against Lightning's default strategy: a LightningModule wrapping the tiny GPT, clipped and
accumulated, trains to the same weights; fit, checkpoint and resume equal one fit; metrics reach the Trainer's
logger."""
import copy
import csv

import pytest
import torch

L = pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[lightning]')")
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from pstar_fx import Config  # noqa: E402
from pstar_fx.integrations.lightning import PstarStrategy  # noqa: E402
from pstar_fx.models import GPT, gpt_config  # noqa: E402
from test_engine import assert_weights_close, tight_budget  # noqa: E402

ACCUM = 2
BATCHES = 4                        # per epoch: 2 optimizer steps


class GPTModule(L.LightningModule):
    def __init__(self, seed=0, optimizer="adamw"):
        super().__init__()
        torch.manual_seed(seed)
        self.model = GPT(gpt_config("tiny"))
        self.optimizer = optimizer
        self.val_losses = []

    def validation_step(self, batch, batch_idx):
        loss = self.model(*batch)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        loss = self.model(idx, targets)
        self.log("train_loss", loss)          # Lightning's default strategy logs it; traced, it logs nothing
        return loss

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def loader(seed=0):
    g = torch.Generator().manual_seed(seed)
    n = BATCHES * 2
    data = TensorDataset(torch.randint(0, 256, (n, 32), generator=g), torch.randint(0, 256, (n, 32), generator=g))
    return DataLoader(data, batch_size=2, shuffle=False)


def trainer(strategy="auto", epochs=1, precision="32-true", **kw):
    kw = {"logger": False, "enable_checkpointing": False, "accelerator": "cpu", "deterministic": True, **kw}
    return L.Trainer(strategy=strategy, devices=1, max_epochs=epochs, precision=precision,
                     gradient_clip_val=1.0, accumulate_grad_batches=ACCUM, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, **kw)


def pstar(budget=None):
    return PstarStrategy(Config(device="cpu", device_memory=budget, seed=0))


@pytest.fixture(scope="module")
def budget():
    """A device budget that keeps all but one chunk's fp32 state on the host: chunks move every step."""
    micro = next(iter(loader()))
    return tight_budget(GPTModule().model, tuple(micro), device_chunks=1)[0]


def test_equals_default_strategy(budget):
    """gradient_clip_val=1.0, accumulate_grad_batches=2 and a warm-up LambdaLR, two epochs: the weights equal those
    of Lightning's default strategy within the fp32 rounding reach measured against its float64 run."""
    module = GPTModule()
    ref, truth = copy.deepcopy(module), copy.deepcopy(module)
    trainer(epochs=2).fit(ref, loader())
    trainer(epochs=2, precision="64-true").fit(truth, loader())
    ours = trainer(pstar(budget), epochs=2)
    ours.fit(module, loader(), loader(seed=1))
    engine = ours.strategy.engine
    assert engine.steps == 2 * BATCHES // ACCUM
    assert engine.plan.placement.count("host") > 0                 # the budget moved chunks
    assert engine.last_step.clip_coef < 1.0                        # clipping triggered (norms start far above 1)
    ref.__dict__["float64_truth"] = (truth, engine.steps, None)
    # the module holds the engine's weights after fit, under its own names
    assert_weights_close(module.state_dict(), ref)
    # and held them at the last validation, which ran after the last step: its losses are the final weights'
    module.eval()
    with torch.no_grad():
        assert module.val_losses[-BATCHES:] == [module.model(*b).item() for b in loader(seed=1)]


def test_fit_checkpoint_resume(tmp_path, budget):
    """One epoch, trainer.save_checkpoint, then a new Trainer resumes a freshly built module from it for a second
    epoch: bit-equal to two epochs in one fit (the checkpoint carries the weights, moments and loop state), and the
    step's metrics reach the Trainer's logger."""
    from lightning.pytorch.loggers import CSVLogger
    whole = GPTModule()
    trainer(pstar(budget), epochs=2).fit(whole, loader())

    first = GPTModule()
    t1 = trainer(pstar(budget), epochs=1)
    t1.fit(first, loader())
    ckpt = tmp_path / "epoch1.ckpt"
    t1.save_checkpoint(ckpt)
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "optimizer.safetensors").is_file()

    resumed = GPTModule(seed=1)                 # other weights: the checkpoint's must replace them
    logger = CSVLogger(tmp_path / "logs", name="run")
    t2 = trainer(pstar(budget), epochs=2, logger=logger, log_every_n_steps=1)
    t2.fit(resumed, loader(), ckpt_path=ckpt)
    assert t2.global_step == 2 * BATCHES // ACCUM
    assert t2.strategy.engine.steps == 2 * BATCHES // ACCUM
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name

    with open(logger.log_dir + "/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    assert [int(r["step"]) for r in rows] == [2, 3]                # the resumed epoch's two steps
    for key in ("loss", "lr", "grad_norm", "clip_coef", "skipped", "seconds", "device_peak_bytes", "host_peak_bytes"):
        assert all(r[key] != "" for r in rows), key
    assert float(rows[-1]["lr"]) == pytest.approx(3e-3)            # warm-up over: the LambdaLR's multiplier 1
    assert t2.optimizers[0].param_groups[0]["lr"] == t2.strategy.engine.lr      # what LearningRateMonitor reads


def test_registered_and_refuses_what_it_cannot_run():
    """strategy="pstar_fx" is the strategy; an optimizer other than AdamW / Adam, clipping by value, a Config field
    the Trainer sets, or a precision that changes the module's dtype: an error naming it, before any step."""
    assert isinstance(L.Trainer(strategy="pstar_fx", logger=False).strategy, PstarStrategy)
    with pytest.raises(TypeError, match="returned a SGD"):
        trainer(pstar()).fit(GPTModule(optimizer="sgd"), loader())
    with pytest.raises(ValueError, match="gradient_clip_algorithm='value'"):
        trainer(pstar(), gradient_clip_algorithm="value").fit(GPTModule(), loader())
    with pytest.raises(ValueError, match="grad_clip is set by Trainer"):
        trainer(PstarStrategy(Config(device="cpu", grad_clip=2.0))).fit(GPTModule(), loader())
    with pytest.raises(ValueError, match="bf16-true"):
        trainer(pstar(), precision="bf16-true").fit(GPTModule(), loader())


def test_bf16_mixed_is_the_engines_compute_dtype():
    """precision="bf16-mixed" compiles the step in bf16 (fp32 masters); the engine's bf16 arithmetic itself is
    tested against torch's autocast in test_engine."""
    t = trainer(pstar(), precision="bf16-mixed", limit_train_batches=ACCUM)
    t.fit(GPTModule(), loader())
    engine = t.strategy.engine
    assert engine.config.dtype == "bf16" and engine.dtype == torch.bfloat16 and engine.steps == 1
    assert engine.state_dict()["model.wte.weight"].dtype == torch.float32


@pytest.fixture
def regions_traced(monkeypatch):
    """Config.compute "auto" is Inductor on CUDA: the regions traced by Dynamo alone instead, as tests/test_gpu.py
    does (the same ops, fast to build); bench/hf_trainer_bench.py runs Inductor's."""
    import sys
    import pstar_fx.passes.compile_regions  # noqa: F401
    monkeypatch.setattr(sys.modules["pstar_fx.passes.compile_regions"], "BACKEND", "eager")


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["auto", "host"])
def test_gpu_equals_default_strategy_on_cpu(placement, regions_traced):
    """accelerator="gpu" with PstarStrategy(Config(device="cuda")): the module stays on the host, its batches go to
    the engine as they are, the engine trains on the GPU (every chunk there, or every chunk's state on the host):
    gradient_clip_val=1.0, accumulate_grad_batches=2 and a warm-up LambdaLR for two epochs in fp32 give the weights
    of Lightning's default strategy on the CPU within tests/test_gpu.py's tolerance for CUDA fp32 against a CPU
    reference (rel 1e-4 over the whole model: the same arithmetic, other kernels). deterministic=False on both:
    Lightning's deterministic mode is torch's global switch, not the engine's business."""
    module = GPTModule()
    ref = copy.deepcopy(module)
    trainer(epochs=2, deterministic=False).fit(ref, loader())
    ours = trainer(PstarStrategy(Config(device="cuda", placement=placement, seed=0)), epochs=2, accelerator="gpu",
                   deterministic=False)
    ours.fit(module, loader())
    engine = ours.strategy.engine
    assert ours.strategy.root_device.type == "cuda" and engine.config.device.startswith("cuda")
    assert engine.steps == 2 * BATCHES // ACCUM and engine.config.grad_accum == ACCUM
    assert engine.last_step.clip_coef < 1.0                        # clipping triggered
    if placement == "host":
        assert set(engine.plan.placement) == {"host"} and engine.memory_stats()["h2d_bytes"] > 0
    assert all(p.device.type == "cpu" for p in module.parameters())    # the module was not moved
    assert_weights_close(module.state_dict(), ref, 1e-4, per_tensor=False)
