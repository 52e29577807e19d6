"""The host Adam's rate as training runs it, against its plan's, and what a later plan on the same machine learns
from it (runtime/host_rate.py, planning/costs.py `learn_host_rate`)."""
import dataclasses
import json
import logging

import pytest
import torch

import pstar_fx
from pstar_fx.models import GPT, gpt_config
from pstar_fx.planning import costs
from pstar_fx.planning.plan import Estimate
from pstar_fx.runtime import host_rate
from pstar_fx.runtime.host_rate import HostRateCheck
from pstar_fx.runtime.telemetry import Telemetry

GPU = costs.Rates("fake_gpu", 500e12, 3e12, 50e9, 50e9, host_adam=6e9, host_adam_bf16=10e9, host_adam_int8=4e9)


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """A CUDA device this machine pretends to have, its calibration cached in a fresh cache folder (nothing is
    measured): what `calibrate` and `learn_host_rate` read and write for it."""
    monkeypatch.setenv("PSTAR_FX_CACHE", str(tmp_path))
    monkeypatch.delenv("PSTAR_FX_LEARN_RATES", raising=False)
    monkeypatch.setattr(costs.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(costs, "_device_key", lambda device: "fake_gpu")
    monkeypatch.setattr(costs, "_MEASURED", {})
    with open(costs._cache_path("fake_gpu-bfloat16"), "w") as f:
        json.dump(dataclasses.asdict(GPU), f)
    return torch.device("cuda")


def _run(check: HostRateCheck, telemetry: Telemetry, steps: int, elems_per_step: int, seconds_per_step: float,
         first_step_seconds: float | None = None) -> None:
    """`steps` steps whose host Adam updated `elems_per_step` parameters in `seconds_per_step` (the first in
    `first_step_seconds`: page faults)."""
    for k in range(steps):
        telemetry.adam_done(elems_per_step, first_step_seconds if k == 0 and first_step_seconds else seconds_per_step)
        telemetry.count_step()
        check.after_step(on_plan=True)


def test_a_rate_off_the_plans_is_learned_for_the_next_plan_on_this_machine(fake_gpu, caplog):
    """bf16 moments: the plan priced the host Adam at 8 G params/s beside its copies (10 alone: a share of 0.8);
    training ran it at 6 (the first step, 10x slower, left out). The rate learned alone is 6 / 0.8 = 7.5, which
    the next calibrate() gives for bf16 moments, the other moments' rates as calibrated."""
    assert costs.calibrate(fake_gpu).host_adam_bf16 == 10e9
    est = Estimate(rates=costs.calibrate(fake_gpu), host_adam_rate=8e9)
    t = Telemetry()
    check = HostRateCheck(est, "bf16", fake_gpu, torch.bfloat16, t)
    with caplog.at_level(logging.INFO, logger="pstar_fx"):
        _run(check, t, host_rate.WINDOW[1] - 1, 6_000_000_000, 1.0, first_step_seconds=10.0)
        assert check.measured is None                   # the window is not over
        _run(check, t, 1, 6_000_000_000, 1.0)
    assert check.measured == pytest.approx(6e9)
    assert check.learned == pytest.approx(7.5e9)
    assert "plans with 7.5 G params/s alone" in caplog.text
    learned = costs.calibrate(fake_gpu)
    assert learned.host_adam_bf16 == pytest.approx(7.5e9)
    assert (learned.host_adam, learned.host_adam_int8) == (GPU.host_adam, GPU.host_adam_int8)
    # what a stated figure says still wins
    with costs.assumed(host_adam_bf16=9e9):
        assert costs.calibrate(fake_gpu).host_adam_bf16 == 9e9
    # more steps change nothing: one window a run
    _run(check, t, 10, 6_000_000_000, 2.0)
    assert check.measured == pytest.approx(6e9)


def test_a_rate_within_tolerance_or_learning_off_leaves_the_calibration(fake_gpu, monkeypatch):
    est = Estimate(rates=costs.calibrate(fake_gpu), host_adam_rate=5e9)     # fp32 moments: 6 alone
    t = Telemetry()
    check = HostRateCheck(est, "fp32", fake_gpu, torch.bfloat16, t)
    _run(check, t, host_rate.WINDOW[1], 4_800_000_000, 1.0)                # 4.8 of 5: within 10%
    assert check.measured == pytest.approx(4.8e9) and check.learned is None
    assert costs.calibrate(fake_gpu) == GPU

    monkeypatch.setenv("PSTAR_FX_LEARN_RATES", "0")
    t = Telemetry()
    check = HostRateCheck(est, "fp32", fake_gpu, torch.bfloat16, t)
    _run(check, t, host_rate.WINDOW[1], 3_000_000_000, 1.0)
    assert check.measured == pytest.approx(3e9) and check.learned is None
    assert costs.calibrate(fake_gpu) == GPU
    monkeypatch.setenv("PSTAR_FX_LEARN_RATES", "2")
    with pytest.raises(ValueError, match="PSTAR_FX_LEARN_RATES"):
        costs.calibrate(fake_gpu)


def test_a_learned_rate_never_goes_above_the_calibration(fake_gpu):
    """A rate learned low, then measured high by a plan whose copies the share model overprices: the rate learned
    again is the calibration's at most (here: it is the calibration's, and the next plan gets it back)."""
    est = Estimate(rates=costs.calibrate(fake_gpu), host_adam_rate=5e9)
    t = Telemetry()
    low = HostRateCheck(est, "fp32", fake_gpu, torch.bfloat16, t)
    _run(low, t, host_rate.WINDOW[1], 3_000_000_000, 1.0)
    assert low.learned == pytest.approx(3.6e9) and costs.calibrate(fake_gpu).host_adam == pytest.approx(3.6e9)
    est = Estimate(rates=costs.calibrate(fake_gpu), host_adam_rate=3e9)     # (a share of 3 / 3.6)
    t = Telemetry()
    high = HostRateCheck(est, "fp32", fake_gpu, torch.bfloat16, t)
    _run(high, t, host_rate.WINDOW[1], 9_000_000_000, 1.0)                # 9 G/s: 10.8 alone by the share
    assert high.learned == GPU.host_adam and costs.calibrate(fake_gpu).host_adam == GPU.host_adam
    t = Telemetry()
    again = HostRateCheck(Estimate(rates=costs.calibrate(fake_gpu), host_adam_rate=5e9), "fp32", fake_gpu,
                          torch.bfloat16, t)
    _run(again, t, host_rate.WINDOW[1], 9_000_000_000, 1.0)               # above, at the calibration already
    assert again.measured == pytest.approx(9e9) and again.learned is None


def test_a_rank_that_does_not_learn_or_another_shapes_steps_learn_nothing(fake_gpu):
    est = Estimate(rates=costs.calibrate(fake_gpu), host_adam_rate=5e9)
    t = Telemetry()
    check = HostRateCheck(est, "fp32", fake_gpu, torch.bfloat16, t, learns=False)
    _run(check, t, host_rate.WINDOW[1], 1_000_000_000, 1.0)
    assert check.measured == pytest.approx(1e9) and check.learned is None
    assert costs.calibrate(fake_gpu) == GPU
    # a step on another plan (another sequence length) inside the window starts it again
    t = Telemetry()
    check = HostRateCheck(est, "fp32", fake_gpu, torch.bfloat16, t)
    _run(check, t, host_rate.WINDOW[1] - 1, 1_000_000_000, 1.0)
    t.adam_done(1_000_000_000, 100.0)
    t.count_step()
    check.after_step(on_plan=False)
    _run(check, t, host_rate.WINDOW[1] - host_rate.WINDOW[0], 1_000_000_000, 0.5)   # (the first begins it)
    assert check.measured is None
    _run(check, t, 1, 1_000_000_000, 0.5)
    assert check.measured == pytest.approx(2e9)


def test_an_engine_measures_its_host_adam_and_the_cpu_tier_learns_nothing(cache_folder):
    """On the CPU tier with host chunks: after WINDOW[1] steps the engine knows the rate its whole host updates
    ran at (each counted once, none on the device); it writes nothing, as the CPU tier shares its cores."""
    torch.manual_seed(0)
    model = GPT(gpt_config("GPT3_18B", n_layer=4, n_embd=128, n_head=4, vocab_size=512, block_size=64))
    x = torch.randint(0, 512, (4, 64))
    eng = pstar_fx.compile(model, dict(device="cpu", dtype="fp32", device_memory="8MiB"), example_inputs=(x, x))
    host = [c for c, tier in enumerate(eng.plan.placement) if tier == "host"]
    assert host and eng.host_rate.assumed
    for _ in range(host_rate.WINDOW[1]):
        eng.step(x, x)
    t = eng.rt.telemetry
    used = sum(eng.lowered.layout.chunks[c].used_elems for c in host)
    assert t.adam_elems == host_rate.WINDOW[1] * used
    assert eng.host_rate.measured > 0 and eng.host_rate.learned is None
    assert not list(cache_folder.glob("host-rates-*"))
