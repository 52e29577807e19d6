"""pstar_fx.data and the `pstar-fx` command line: tokens, batches, train/plan/explain and their errors."""

import pytest
import torch

from pstar_fx.cli import STEPS_ENV, main
from pstar_fx.data import batches, stdlib_tokens
from pstar_fx.models import GPT, gpt_config


def test_stdlib_tokens_are_bytes_and_deterministic():
    a = stdlib_tokens(max_bytes=100_000)
    assert a.dtype == torch.uint8 and a.numel() == 100_000
    assert torch.equal(a, stdlib_tokens(max_bytes=100_000))
    assert bytes(a[:2000].tolist()).isascii()  # Python source: mostly ASCII, certainly at the start
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_tokens(max_bytes=0)


def test_batches_shift_by_one_and_follow_the_seed():
    tokens = stdlib_tokens(max_bytes=50_000)
    idx, tgt = next(batches(tokens, batch=4, seq=32, seed=1))
    assert idx.shape == tgt.shape == (4, 32) and idx.dtype == tgt.dtype == torch.int64
    assert torch.equal(idx[:, 1:], tgt[:, :-1])
    windows = tokens.long().unfold(0, 33, 1)  # every 33 consecutive tokens
    for row_idx, row_tgt in zip(idx, tgt):
        assert (windows == torch.cat([row_idx, row_tgt[-1:]])).all(dim=1).any()
    again = batches(tokens, batch=4, seq=32, seed=1)
    first, second = next(again), next(again)
    assert torch.equal(first[0], idx) and not torch.equal(second[0], idx)
    assert not torch.equal(next(batches(tokens, batch=4, seq=32, seed=2))[0], idx)
    with pytest.raises(ValueError, match="tokens"):
        next(batches(tokens[:10], batch=2, seq=32))


def test_train_runs_prints_loss_and_saves_a_loadable_state_dict(tmp_path, capsys):
    path = tmp_path / "tiny.pt"
    assert main(["train", "--model", "tiny", "--steps", "3", "--log-every", "1", "--save", str(path)]) == 0
    out = capsys.readouterr().out
    assert "device memory:" in out and "on the host" in out  # the CPU default budget really moves chunks
    losses = [float(line.split("loss")[1].split()[0]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses)
    assert "h2d" in out or "host->device" in out
    sd = torch.load(path)
    model = GPT(gpt_config("tiny"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = model.load_state_dict(sd, strict=False)
    assert not result.unexpected_keys
    assert set(sd) == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert all(torch.equal(model.state_dict()[k], sd[k]) for k in sd)
    assert any(not torch.equal(before[k], sd[k]) for k in sd)  # three steps changed the weights


def test_steps_default_comes_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv(STEPS_ENV, "2")
    assert main(["train", "--model", "llama:tiny"]) == 0
    out = capsys.readouterr().out
    assert "step     2" in out and "done: 2 steps" in out


@pytest.mark.parametrize("argv, message", [
    (["train", "--steps", "0"], "--steps: expected a positive integer"),
    (["train", "--model", "nope"], "unknown gpt model 'nope'; choose from: tiny, small"),
    (["train", "--model", "llama:GPT3_10B"], "unknown llama model"),
    (["train", "--device-memory", "lots"], "cannot read 'lots' as a size"),
    (["train", "--device", "tpu"], "'tpu' is not one of auto, cpu, cuda"),
    (["train", "--model", "tiny", "--seq", "65"], "longer than GPT 'tiny''s block_size 64"),
    (["plan"], "--model"),
])
def test_bad_arguments_exit_2_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_engine_errors_are_one_line_and_exit_1(tmp_path, capsys):
    assert main(["train", "--model", "tiny", "--steps", "1", "--device-memory", "64KiB"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("pstar-fx train: error:") and "device memory" in err and "\n" not in err
    bad = tmp_path / "config.json"
    bad.write_text('{"dtyp": "bf16"}')
    assert main(["explain", "--model", "tiny", "--config", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert "unknown key(s) ['dtyp']" in err and "\n" not in err


def test_config_file_with_flags_over_it(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"dtype": "bf16", "placement": "host", "optimizer": {"lr": 0.01}}')
    assert main(["explain", "--model", "tiny", "--config", str(cfg), "--dtype", "fp32", "--code"]) == 0
    out = capsys.readouterr().out
    assert "compute dtype fp32" in out and "0 chunk(s) on device" in out
    assert "rt.fetch(" in out and "rt.adam(" in out  # --code printed the lowered step


def test_plan_on_meta_answers_fits_or_not(capsys):
    assert main(["plan", "--model", "tiny", "--device", "cpu", "--device-memory", "64MiB"]) == 0
    assert "answer: fits" in capsys.readouterr().out
    assert main(["plan", "--model", "tiny", "--device", "cpu", "--device-memory", "256KiB"]) == 0
    assert "does not fit" in capsys.readouterr().out


def test_plan_for_cuda_needs_no_gpu(capsys):
    assert main(["plan", "--model", "tiny", "--device", "cuda", "--dtype", "bf16", "--device-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "device cuda" in out and "answer: fits" in out
    assert main(["plan", "--model", "tiny", "--device-memory", "1GiB"]) == 0     # sizing for a GPU box by default
    out = capsys.readouterr().out
    assert "bf16; device cuda" in out and "answer: fits" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only torch gives")
def test_train_on_cuda_without_cuda_is_a_clean_error(capsys):
    assert main(["train", "--model", "tiny", "--device", "cuda", "--steps", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert "no usable CUDA" in err and "\n" not in err


def test_train_clips_accumulates_and_warms_up(capsys):
    assert main(["train", "--model", "tiny", "--steps", "3", "--log-every", "1", "--grad-clip", "0.01",
                 "--grad-accum", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "step     1" in out and "lr 0 " in out and "clipped x" in out and "done: 3 steps" in out
    assert "step transaction: accumulate" in out


def test_train_saves_checkpoints_and_resumes_exactly(tmp_path, capsys):
    whole = tmp_path / "whole"
    assert main(["train", "--model", "tiny", "--steps", "4", "--log-every", "1", "--save", str(whole)]) == 0
    capsys.readouterr()
    half = tmp_path / "half"
    assert main(["train", "--model", "tiny", "--steps", "2", "--save", str(half), "--save-every", "1"]) == 0
    assert "saved: " in capsys.readouterr().out
    # resume continues the step count, the schedule and the data where they were: 2 + 2 steps equal 4
    from safetensors.torch import load_file
    assert main(["train", "--model", "tiny", "--steps", "2", "--resume", str(half), "--save", str(half)]) == 0
    assert "resumed: " in capsys.readouterr().out
    state = __import__("json").loads((half / "pstar_fx_state.json").read_text())
    assert state["step"] == 4
    a, b = load_file(str(half / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_train_evaluates_a_held_out_batch(capsys):
    assert main(["train", "--model", "tiny", "--steps", "4", "--log-every", "2", "--eval-every", "2"]) == 0
    out = capsys.readouterr().out
    evals = [float(line.split("eval loss")[1].split()[0]) for line in out.splitlines() if "eval loss" in line]
    assert len(evals) == 2 and all(0 < x < 10 for x in evals)
