"""The `pstar-fx` command line: train (on the stdlib or --data), plan, explain, and their errors."""

import io
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from pstar_fx import cli
from pstar_fx.cli import STEPS_ENV, main
from pstar_fx.models import GPT, gpt_config
from pstar_fx.phases import PhaseEvent
from test_data import word_tokenizer

README = Path(__file__).resolve().parent.parent / "README.md"


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


def test_plan_on_meta_answers_fits_or_not_and_exits_1_when_not(capsys):
    assert main(["plan", "--model", "tiny", "--device", "cpu", "--device-memory", "64MiB"]) == 0
    assert "answer: fits" in capsys.readouterr().out
    assert main(["plan", "--model", "tiny", "--device", "cpu", "--device-memory", "256KiB"]) == 1
    out = capsys.readouterr().out
    assert "GPT 'tiny': " in out and "answer: does not fit" in out    # the summary still printed


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


def test_train_evaluates_a_held_out_batch_and_says_its_loss_is_a_window_mean(tmp_path, capsys):
    assert main(["train", "--model", "tiny", "--steps", "4", "--log-every", "2", "--eval-every", "2",
                 "--metrics", str(tmp_path / "m.jsonl")]) == 0
    out = capsys.readouterr().out
    evals = [float(line.split("eval loss")[1].split()[0]) for line in out.splitlines() if "eval loss" in line]
    assert len(evals) == 2 and all(0 < x < 10 for x in evals)
    # the printed loss is the mean over the --log-every window, and says so; the metrics file has each step's own
    per_step = [r["loss"] for r in _metrics(tmp_path / "m.jsonl")]
    printed = _steps(out)
    assert re.search(r"^step +1  loss [\d.]+  ", out, re.M)                      # one step: nothing to say
    assert re.search(r"^step +4  loss [\d.]+ \(mean of steps 3-4\)  ", out, re.M)
    assert printed[4] == pytest.approx((per_step[2] + per_step[3]) / 2, abs=1e-4)   # 4 printed digits
    done = out.split("done: ")[1].splitlines()[0]
    assert re.search(rf"loss {printed[1]:.4f} \(step 1\) -> {printed[4]:.4f} \(mean of steps 3-4\)$", done)


# ---- train --data: the user's own text, folder, token file or tokenizer ----------------------------------

TEXT = "".join(f"line {i}: the cat sat on the mat, a dog sat on the cat.\n" for i in range(120))


def _steps(out: str, key: str = "loss") -> dict[int, float]:
    """{step: value} of the printed step lines ("step N  loss X ..." or "step N  eval loss X ...")."""
    pat = re.compile(rf"^step +(\d+)  {key} ([\d.]+)", re.M)
    return {int(m[1]): float(m[2]) for m in pat.finditer(out)}


def _metrics(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_train_on_a_text_file_evaluates_logs_metrics_and_resumes_exactly(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text(TEXT)
    common = ["train", "--model", "tiny", "--data", str(tmp_path / "mine.txt"), "--batch", "4", "--seq", "32",
              "--eval-every", "2", "--log-every", "1"]
    assert main(common + ["--steps", "4", "--save", str(tmp_path / "whole"), "--metrics", str(tmp_path / "w.jsonl")]) == 0
    out = capsys.readouterr().out
    assert f"data: {len(TEXT.encode()):,} tokens (bytes, vocab 256) of {tmp_path / 'mine.txt'}" in out
    assert "done: 4 steps" in out and "TFLOPs" in out
    whole = _metrics(tmp_path / "w.jsonl")
    assert [r["step"] for r in whole] == [1, 2, 3, 4]
    assert [r["step"] for r in whole if "eval_loss" in r] == [2, 4]
    printed, evals = _steps(out), _steps(out, "eval loss")
    for r in whole:                                       # the file holds what the lines print, unrounded
        assert round(r["loss"], 4) == printed[r["step"]] and r["tokens_per_s"] > 0 and r["seconds"] > 0
        assert r["lr"] == 1e-3 and r["grad_norm"] > 0 and r["skipped"] is False
    assert {s: round(r["eval_loss"], 4) for s, r in ((r["step"], r) for r in whole) if "eval_loss" in r} == evals
    assert whole[-1]["loss"] < whole[0]["loss"]
    # 2 steps, save; resume 2 more into the same metrics file: the same 4 losses, numbered on, and the same weights
    half, m = tmp_path / "half", tmp_path / "m.jsonl"
    assert main(common + ["--steps", "2", "--save", str(half), "--metrics", str(m)]) == 0
    assert main(common + ["--steps", "2", "--resume", str(half), "--save", str(half), "--metrics", str(m)]) == 0
    out = capsys.readouterr().out
    assert "resumed: " in out and "step     3  loss" in out
    resumed = _metrics(m)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
    assert [r.get("eval_loss") for r in resumed] == [r.get("eval_loss") for r in whole]
    from safetensors.torch import load_file
    a, b = load_file(str(half / "model.safetensors")), load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_train_on_a_uint16_token_file_and_a_uint32_one(tmp_path, capsys):
    ids = np.tile(np.arange(0, 250, 5), 60)                        # a repeating pattern: the loss must fall
    ids.astype(np.uint16).tofile(tmp_path / "train.bin")
    argv = ["train", "--model", "tiny", "--batch", "4", "--seq", "32", "--steps", "6", "--log-every", "3",
            "--lr", "0.01"]
    assert main(argv + ["--data", str(tmp_path / "train.bin")]) == 0
    out = capsys.readouterr().out
    assert f"data: {ids.size:,} tokens (uint16 ids) of {tmp_path / 'train.bin'}, memory-mapped" in out
    losses = _steps(out)
    assert losses[6] < losses[1]
    ids.astype(np.uint32).tofile(tmp_path / "train32.bin")
    assert main(argv + ["--data", str(tmp_path / "train32.bin"), "--data-dtype", "uint32"]) == 0
    out = capsys.readouterr().out
    assert "(uint32 ids)" in out and _steps(out) == losses       # the same ids, the same run


def test_train_on_a_folder_of_text_files(tmp_path, capsys):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "a.md").write_text(TEXT[:3000])
    (tmp_path / "docs" / "sub" / "b.py").write_text(TEXT[3000:])
    (tmp_path / "docs" / "data.csv").write_text("1,2,3\n" * 100)  # not a text suffix: left out
    assert main(["train", "--model", "tiny", "--data", str(tmp_path / "docs"), "--batch", "2", "--seq", "32",
                 "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert f"data: {len(TEXT):,} tokens (bytes, vocab 256)" in out and "done: 1 steps" in out


def test_train_with_a_local_tokenizer_directory(tmp_path, capsys):
    tok = word_tokenizer(tmp_path / "tok")
    (tmp_path / "mine.txt").write_text(TEXT)
    n_words = len(TEXT.replace(":", " : ").replace(",", " , ").replace(".", " . ").split())
    assert main(["train", "--model", "tiny", "--data", str(tmp_path / "mine.txt"), "--tokenizer", str(tok),
                 "--batch", "4", "--seq", "32", "--steps", "4", "--log-every", "1", "--lr", "0.01"]) == 0
    out = capsys.readouterr().out
    assert f"data: {n_words:,} tokens (tokenizer {tok}, vocab 9)" in out   # one id a word (digits: [UNK])
    losses = _steps(out)
    assert losses[4] < losses[1] < 10


@pytest.mark.parametrize("make, extra, message", [
    (None, [], "data: {p} does not exist"),
    ("empty.txt", [], "data: {p} is empty"),
    ("big.bin", [], "token 300 at position 7 is outside the model's vocabulary (vocab_size 256)"),
    ("short.txt", [], "6 training tokens, fewer than one window of --seq 64 + 1"),
    ("mine.txt", ["--eval-every", "1"], "the held-out last 5% is 50 tokens, fewer than one window of --seq 64"),
    ("mine.txt", ["--tokenizer", "bpe"], "has a vocabulary of 258, but GPT 'tiny' has vocab_size 256"),
    ("binary.txt", [], "data: {p} is not UTF-8 text: byte 0xff at offset 1,005"),
    ("odd.dat", [], "data: {p} is 201 bytes, not a whole number of uint16 tokens"),
    ("big.dat", [], "token 300 at position 7 is outside the model's vocabulary (vocab_size 256)"),
])
def test_bad_data_is_a_clear_error_before_compiling(tmp_path, capsys, make, extra, message):
    p = tmp_path / (make or "missing.txt")
    if make == "empty.txt":
        p.write_text("")
    elif make == "binary.txt":
        p.write_bytes(b"x" * 1005 + b"\xff\xfe\x00\x01" * 100)            # binary bytes after some text
    elif make == "odd.dat":
        p.write_bytes(b"\x01" * 201)
    elif make in ("big.bin", "big.dat"):
        ids = np.zeros(200, dtype=np.uint16)
        ids[7] = 300
        ids.tofile(p)
    elif make == "short.txt":
        p.write_text("abcdef")
    elif make == "mine.txt":
        p.write_text("x" * 1000)
    if "bpe" in extra:
        extra = ["--tokenizer", str(_byte_bpe(tmp_path / "bpe"))]
    assert main(["train", "--model", "tiny", "--data", str(p), "--steps", "1", *extra]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("pstar-fx train: error:") and message.format(p=p) in err and "\n" not in err
    assert "parameters;" not in captured.out                          # failed before building or compiling


def _byte_bpe(path):
    """A byte-level BPE with two special tokens: 258 ids, two more than a byte model's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["the cat sat"], trainers.BpeTrainer(
        vocab_size=10, special_tokens=["[UNK]", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>").save_pretrained(str(path))
    return path


# ---- progress: the bar, the compile status line, the README's loop ---------------------------------------

def test_progress_bar_on_request_shows_loss_rate_and_flops_on_stderr(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text(TEXT)
    assert main(["train", "--model", "tiny", "--data", str(tmp_path / "mine.txt"), "--batch", "2", "--seq", "32",
                 "--steps", "2", "--log-every", "1", "--progress", "bar"]) == 0
    captured = capsys.readouterr()
    assert "2/2" in captured.err and "loss " in captured.err and "TFLOPs" in captured.err
    assert "step     2  loss" in captured.out and "done: 2 steps" in captured.out   # the lines still on stdout
    assert "%|" not in captured.out


def test_no_bar_when_stderr_is_not_a_terminal(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text(TEXT)
    assert main(["train", "--model", "tiny", "--data", str(tmp_path / "mine.txt"), "--batch", "2", "--seq", "32",
                 "--steps", "2"]) == 0
    captured = capsys.readouterr()
    assert "%|" not in captured.err and "\r" not in captured.err + captured.out


def test_flops_per_token_is_palms_count():
    # GPT-3 175B at seq 2048 (PaLM appendix B's example): 6N + 12 * 96 * 12288 * 2048
    assert cli.flops_per_token(175_000_000_000, 96, 12288, 2048) == 6 * 175e9 + 12 * 96 * 12288 * 2048


def test_compile_phases_get_a_live_status_line_on_a_terminal(capsys):
    stream = io.StringIO()
    handler = cli.progress.Progress(live=True, stream=stream, tick_s=0.02)
    log = logging.getLogger("pstar_fx.test_progress")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        log.info("%s%s ...", "capture", " (traced)")        # what phases.Phases logs and sends as a phase starts
        handler.on_phase(PhaseEvent("capture", "start", "traced"))
        import time
        for _ in range(200):                               # until the ticker has rewritten the line once
            if stream.getvalue().count("\r  capture ... ") >= 2:
                break
            time.sleep(0.01)
        log.info("%s done in %.1f s", "capture", 0.15)
        handler.on_phase(PhaseEvent("capture", "end", "traced", seconds=0.15))
    finally:
        log.removeHandler(handler)
        handler.close()
    status = stream.getvalue()
    assert status.count("\r  capture ... ") >= 2 and status.endswith("\r\033[K")   # ticked, then cleared
    out = capsys.readouterr().out
    assert "capture (traced) ..." in out and "capture done in 0.1 s" in out
    quiet = io.StringIO()
    handler = cli.progress.Progress(live=False, stream=quiet)
    log.addHandler(handler)
    log.info("%s%s ...", "plan", "")
    handler.on_phase(PhaseEvent("plan", "start"))
    log.removeHandler(handler)
    handler.close()
    assert quiet.getvalue() == "" and "plan ..." in capsys.readouterr().out


def test_status_line_shows_a_phases_progress():
    stream = io.StringIO()
    handler = cli.progress.Progress(live=True, stream=stream, tick_s=60)
    handler.on_phase(PhaseEvent("initialize", "start"))
    handler.on_phase(PhaseEvent("initialize", "progress", done=250, total=1000))
    handler.on_phase(PhaseEvent("plan", "progress", done=1, total=2))        # not the phase in flight: ignored
    handler.close()
    assert "\r  initialize ... 0 s (25%)" in stream.getvalue() and "(50%)" not in stream.getvalue()


def test_readme_quick_start_prints_progress(tmp_path, monkeypatch, capsys):
    block = README.read_text().split("## Quick start")[1].split("```python\n")[1].split("```")[0]
    fast = block
    for slow, quick in [('gpt_config("small")', 'gpt_config("tiny")'), ("seq=128", "seq=32"), ("range(1, 101)",
                        "range(1, 21)"), ("stdlib_tokens()", "stdlib_tokens(max_bytes=100_000)"),
                        ("batch=8", "batch=2")]:
        assert slow in fast, f"the README's quick start changed: {slow!r} is gone"
        fast = fast.replace(slow, quick)
    monkeypatch.chdir(tmp_path)
    exec(compile(fast, "README quick start", "exec"), {})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["10", "20"]
    assert all(0 < float(line.split("loss")[1].split()[0]) < 10 for line in lines)


def test_help_states_each_commands_real_defaults(capsys):
    for command in ("plan", "train"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        if command == "plan":
            assert "--device cuda --dtype bf16" in text and "cuda (default" in text and "(default bf16)" in text
            assert "auto (default: cuda if available" not in text and "(default fp32)" not in text
        else:
            assert "auto (default: cuda if available" in text and "(default fp32)" in text and "bf16)" not in text
    # and what plan's help says is what it does
    assert main(["plan", "--model", "tiny"]) == 0
    assert "tiny': " in (out := capsys.readouterr().out) and "bf16; device cuda; device_memory unlimited" in out


# ---- hf:DIR, a local Hugging Face model ------------------------------------------------------------------

def _hf_gpt2(path, weights: bool = True, tokenizer: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=1,
                        eos_token_id=1)
    if weights:
        torch.manual_seed(0)
        GPT2LMHeadModel(config).save_pretrained(str(path))
    else:
        config.save_pretrained(str(path))
    if tokenizer:
        word_tokenizer(path)
    return path


def test_hf_model_directory_plans_and_trains(tmp_path, capsys):
    hf = _hf_gpt2(tmp_path / "gpt2", tokenizer=True)
    assert main(["plan", "--model", f"hf:{hf}", "--device-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert f"Hugging Face GPT2 from {hf}" in out and "answer: fits" in out
    (tmp_path / "mine.txt").write_text(TEXT)
    assert main(["train", "--model", f"hf:{hf}", "--data", str(tmp_path / "mine.txt"), "--batch", "2",
                 "--seq", "32", "--steps", "3", "--log-every", "1", "--lr", "0.01", "--eval-every", "3"]) == 0
    out = capsys.readouterr().out
    assert f"(tokenizer {hf}, vocab 9)" in out               # the directory's own tokenizer by default
    losses = _steps(out)
    assert len(losses) == 3 and losses[3] < losses[1] and 3 in _steps(out, "eval loss")


def test_hf_config_only_directory_gets_fresh_weights_and_bytes(tmp_path, capsys):
    hf = _hf_gpt2(tmp_path / "cfg", weights=False)
    assert main(["train", "--model", f"hf:{hf}", "--batch", "2", "--seq", "32", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "(config only: fresh weights)" in out and "(bytes, vocab 256) of Python stdlib source" in out
    with pytest.raises(SystemExit) as e:
        main(["train", "--model", f"hf:{tmp_path / 'nothing'}"])
    assert e.value.code == 2 and "expected a Hugging Face model directory with a config.json" in capsys.readouterr().err


# ---- bench: the repository's pytest-benchmark cases ------------------------------------------------------

def test_bench_saves_a_run_and_compare_fails_on_a_slower_one(tmp_path, capfd):
    store = tmp_path / "store"
    one_fast_case = ["bench", "-k", "test_copy_fp32_reference", "--storage", str(store)]
    inner = ["--", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'inner'}"]   # nothing left in the repository
    assert main([*one_fast_case, "--save", "base", *inner]) == 0
    out = capfd.readouterr().out
    assert "running in " in out and "--benchmark-only" in out and "-m 'not gpu'" in out
    assert "test_copy_fp32_reference" in out and "1 passed" in out
    saved = list(store.glob("*/0001_base.json"))
    assert len(saved) == 1
    # make the saved run 1000x faster than any real one: this run's mean is then far more than 10% above it
    data = json.loads(saved[0].read_text())
    for case in data["benchmarks"]:
        case["stats"]["mean"] /= 1000
    saved[0].write_text(json.dumps(data))
    assert main([*one_fast_case, "--compare", "base", "--fail", "10", *inner]) == 1
    out, err = capfd.readouterr()
    assert f"--benchmark-compare={saved[0]}" in out and "--benchmark-compare-fail=mean:10%" in out
    assert "Performance has regressed" in out + err and "test_copy_fp32_reference (0001_base)" in out


def test_bench_without_a_saved_run_or_a_bench_folder_is_a_clear_error(tmp_path, monkeypatch, capfd):
    assert main(["bench", "--compare", "never-saved", "--storage", str(tmp_path)]) == 2
    err = capfd.readouterr().err
    assert "no run saved as 'never-saved'" in err and "(none saved yet)" in err
    assert "pstar-fx bench --save never-saved" in err and "\n" not in err.strip()
    with pytest.raises(SystemExit) as e:
        main(["bench", "--fail", "10"])
    assert e.value.code == 2 and "--fail PCT needs --compare NAME" in capfd.readouterr().err
    # an installed wheel: no bench/ beside the package
    monkeypatch.setattr(cli.pstar_fx, "__file__", str(tmp_path / "site-packages" / "pstar_fx" / "__init__.py"))
    assert main(["bench"]) == 2
    err = capfd.readouterr().err
    assert "no bench/ folder with test_bench_*.py beside the package" in err and "pip install -e ." in err


def test_status_line_follows_overlapping_phases():
    """Phases overlap (the weights are written on a thread while the regions build): the one started last is
    shown, with its own progress; when it ends, the one still in flight is shown again, and none after both."""
    stream = io.StringIO()
    handler = cli.progress.Progress(live=True, stream=stream, tick_s=60)
    handler.on_phase(PhaseEvent("build regions", "start"))
    handler.on_phase(PhaseEvent("initialize", "start"))
    handler.on_phase(PhaseEvent("initialize", "progress", done=1, total=4))
    handler.on_phase(PhaseEvent("build regions", "progress", done=1, total=2))    # in flight, not shown now
    assert stream.getvalue().endswith("\r  initialize ... 0 s (25%)\033[K")
    handler.on_phase(PhaseEvent("initialize", "end"))
    assert stream.getvalue().endswith("\r\033[K\r  build regions ... 0 s (50%)\033[K")
    handler.on_phase(PhaseEvent("build regions", "end"))
    assert stream.getvalue().endswith("(50%)\033[K\r\033[K")          # cleared, nothing shown after
    handler.close()
