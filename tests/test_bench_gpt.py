"""bench/gpt.py's PyTorch peer on CPU: --checkpoint none|half|all, --compile, --system torch-best.

The real runs are GPU-only; here the tiny model runs on --device cpu, --compile uses the "eager" backend
(inductor on this CPU takes minutes for the tiny model) and torch-best's subprocesses are faked, except
one real child that is cut off by its timeout.
"""
import copy
import json
import time

import pytest
import torch
from pstar_fx.models import GPT, Llama, gpt_config, llama_config
from bench_modules import load

gpt = load("gpt", "bench_gpt")

TINY = ["--model", "tiny", "--device", "cpu", "--batch", "2", "--seq", "16", "--steps", "2"]


def run(tmp_path, *extra):
    out = tmp_path / "r.jsonl"
    gpt.main([*TINY, *extra, "--json", str(out)])
    return [json.loads(x) for x in out.read_text().splitlines()]


@pytest.mark.parametrize("checkpoint, expected", [("none", []), ("half", [0, 2, 4]), ("all", [0, 1, 2, 3, 4])])
def test_checkpoint_wraps_the_blocks_it_names(checkpoint, expected):
    for model in (GPT(gpt_config("tiny", n_layer=5)), Llama(llama_config("tiny", n_layer=5))):
        assert gpt.checkpoint_blocks(model, checkpoint) == expected
        blocks = model.h if hasattr(model, "h") else model.layers
        assert len(blocks) == 5
        assert [i for i, b in enumerate(blocks) if isinstance(b, gpt.Checkpointed)] == expected


def test_each_checkpoint_trains_the_same_losses(tmp_path):
    results = {}
    for ck in ("none", "half", "all"):
        (tmp_path / ck).mkdir()
        results[ck] = run(tmp_path / ck, "--system", "torch", "--checkpoint", ck)[0]
    for ck, n in (("none", 0), ("half", 1), ("all", 2)):
        r = results[ck]
        assert "error" not in r, r.get("error")
        assert (r["checkpoint"], r["checkpointed_blocks"], r["compile"]) == (ck, n, False)
        assert "compile_s" not in r and len(r["steps_s"]) == 2
        assert r["losses"] == pytest.approx(results["none"]["losses"], rel=1e-3)   # recompute is not new math
        assert len(r["gc_s"]) == 2 and all(isinstance(g, dict) for g in r["gc_s"])


def test_collections_timed_counts_a_full_collection_by_generation():
    import gc
    with gpt.collections_timed() as seconds:
        gc.collect()
    assert "2" in seconds and seconds["2"] >= 0          # (a collection the block set off may come first)
    gc.disable()                                        # (no automatic collection can come in the block)
    try:
        with gpt.collections_timed() as seconds:
            pass
    finally:
        gc.enable()
    assert seconds == {}


def test_cpu_profile_reports_the_launching_thread_by_function(tmp_path):
    r = run(tmp_path, "--system", "torch", "--checkpoint", "none", "--cpu-profile")[0]
    prof = r["cpu_profile"]
    assert prof["wall_s"] > 0 and 0 < len(prof["top_own"]) <= 30
    own = [f["own_ms"] for f in prof["top_own"]]
    assert own == sorted(own, reverse=True) and sum(own) <= prof["wall_s"] * 1e3 * 1.01
    assert any("linear" in f["function"] for f in prof["top_own"])   # the model's matmuls ran under it


def test_compile_reaches_torch_compile(tmp_path, monkeypatch):
    calls = []
    real = torch.compile

    def recording(model, **kw):
        calls.append((type(model).__name__, kw))
        return real(model, **kw)

    monkeypatch.setattr(torch, "compile", recording)
    (r,) = run(tmp_path, "--system", "torch", "--checkpoint", "half", "--compile", "--compile-backend", "eager")
    assert calls == [("GPT", {"backend": "eager"})]       # the whole model, once; the optimizer is not compiled
    assert "error" not in r, r.get("error")
    assert (r["compile"], r["checkpoint"], r["compile_backend"]) == (True, "half", "eager")
    assert r["compile_s"] >= 0


def test_arguments():
    with pytest.raises(SystemExit):
        gpt.main([*TINY, "--system", "torch", "--checkpoint", "some"])
    with pytest.raises(SystemExit):
        gpt.main([*TINY, "--system", "pstar_fx"])       # --device cpu is for the torch system only
    with pytest.raises(SystemExit):
        gpt.main([*TINY, "--system", "torch", "--switch-interval", "0"])    # no interval at all: refused, not set
    argv = ["--model", "m", "--system=torch-best", "--compile", "--checkpoint", "half", "--json", "f", "--batch", "4"]
    assert gpt._without(argv, {"--system": True, "--checkpoint": True, "--compile": False, "--json": True}) == \
        ["--model", "m", "--batch", "4"]
    message = "CUDA out of memory. Tried to allocate 192.00 MiB. GPU 0 has a total capacity of 139.80 GiB"
    assert gpt._oom_tried_bytes(message) == 192 * 2**20
    assert gpt._oom_tried_bytes("something else") is None


def test_torch_best_reports_the_fastest_that_fits(tmp_path, monkeypatch, capsys):
    seen = []

    def fake(argv, compile_, checkpoint, timeout_s):
        seen.append((argv, compile_, checkpoint, timeout_s))
        r = {"system": "torch", "compile": compile_, "checkpoint": checkpoint, "sweep": "torch-best", "gpu": "G"}
        if checkpoint == "none":                # does not fit, eager or compiled
            return r | {"error": "OutOfMemoryError: ...", "fits": False, "oom": True,
                        "oom_tried_bytes": 2**30, "gpu_peak_bytes": 100 * 2**30}
        if compile_ and checkpoint == "all":
            return r | {"error": "timeout: no result within 5 s", "fits": False}
        step_s = {(False, "half"): 0.9, (False, "all"): 1.0, (True, "half"): 0.8}[compile_, checkpoint]
        return r | {"fits": True, "step_s": step_s, "tflops": 1 / step_s, "gpu_peak_bytes": 2**30}

    monkeypatch.setattr(gpt, "run_config", fake)
    lines = run(tmp_path, "--system", "torch-best", "--compile", "--config-timeout", "5")
    assert [(c, ck) for _, c, ck, _ in seen] == gpt.TORCH_BEST_CONFIGS
    # the children get the sweep's arguments less --system, --json and --compile
    assert all(argv == [*TINY, "--config-timeout", "5"] and t <= 5 for argv, _, _, t in seen)
    assert len(lines) == 7 and [x["system"] for x in lines] == ["torch"] * 6 + ["torch-best"]
    best = lines[-1]
    assert best["best"] == {"compile": True, "checkpoint": "half"} and best["step_s"] == 0.8
    assert best["gpu"] == "G" and len(best["configs"]) == 6
    assert [c["fits"] for c in best["configs"]] == [False, True, True, False, True, False]
    table = capsys.readouterr().out
    assert table.count("does not fit (tried 1.0 GiB more at 100.0 GiB allocated)") == 2
    assert "timeout: no result within 5 s" in table


def test_torch_best_with_nothing_fitting_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(gpt, "run_config", lambda argv, c, ck, t: {"system": "torch", "compile": c, "checkpoint": ck,
                                                                   "fits": False, "error": "OutOfMemoryError", "oom": True})
    best = run(tmp_path, "--system", "torch-best")[-1]
    assert best["error"] == "no configuration fits" and "best" not in best


def test_a_configuration_past_its_limit_is_killed_and_reported():
    t0 = time.monotonic()
    r = gpt.run_config(TINY, False, "none", timeout_s=0.5)    # the child is still importing torch
    assert time.monotonic() - t0 < 20
    assert r["fits"] is False and r["error"].startswith("timeout") and r["sweep"] == "torch-best"


def test_late_binding_off_never_records_the_verdicts_update_and_is_restored():
    """`--clip-sweep THRESHOLD@RATE@nolate` (CUDA only, like every pstar_fx run of the bench) runs its steps inside
    `late_binding(False)`: a step's log never records the verdict's update, so no host update binds it late; after
    the block StepLog is as it was."""
    from pstar_fx.optim import Hyper
    from pstar_fx.runtime.step_log import SPECULATE_KEEPING, StepLog
    hyper = Hyper(step=1, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, grad_scale=1.0, decoupled=True)
    with gpt.late_binding(False):
        log = StepLog(hyper, SPECULATE_KEEPING)
        log.verdict_hyper = hyper
        assert log.verdict_hyper is None
    assert StepLog.__dict__["verdict_hyper"] is None
    log = StepLog(hyper, SPECULATE_KEEPING)
    log.verdict_hyper = hyper
    assert log.verdict_hyper is hyper
    with gpt.late_binding(True):
        assert StepLog.__dict__["verdict_hyper"] is None


def test_an_undo_sweep_point_corrects_by_undo_then_redo_and_is_restored():
    """`--clip-sweep THRESHOLD@RATE@undo` runs its steps inside `undo_then_redo(True)`: each correction is the
    undo of the speculated update with a redo (the float64 kernel), not the one-pass rescale; after the block the
    runtime's correction is as it was."""
    from pstar_fx.runtime.undo import Undo
    rescale = Undo._correct_one
    calls = []

    class Log:
        hyper_of = {}

    class Fake:
        def _chunk_undo(self, c, grad, hyper, *, redo=None, part="all", shadow=True):
            calls.append((c, grad, hyper, redo, Log.hyper_of[c]))

    with gpt.undo_then_redo(True):
        assert Undo._correct_one is not rescale
        Undo._correct_one(Fake(), Log, 3, "grad", "guess", "verdict")
    assert calls == [(3, "grad", "guess", "verdict", "guess")] and Log.hyper_of[3] == "verdict"
    assert Undo._correct_one is rescale
    with gpt.undo_then_redo(False):
        assert Undo._correct_one is rescale


def test_chat_batches_are_packed_chat_rows_whose_loss_the_engine_computes_as_hugging_face_does():
    """--chat-packed (issue 25's 8B run at seq 4096 against 1024): rows of synthetic chat records over the model's
    vocabulary, packed by pstar_fx.records: trained tokens only on assistant turns (each its own id), padding masked
    and never trained; a tiny HF Llama's loss on them through the engine equals the eager model's."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    import pstar_fx
    batches = gpt.chat_batches(vocab=300, rows=3, seq=64, device="cpu")
    assert len(batches) == 2
    for ids, labels, mask in batches:
        assert ids.shape == labels.shape == mask.shape == (3, 64) and int(ids.max()) < 300
        trained = labels != -100
        assert trained.any() and (~trained & (mask == 1)).any()        # prompts are in the rows, not trained
        assert not (trained & (mask == 0)).any() and torch.equal(labels[trained], ids[trained])
        assert (mask == 0).any()                                       # some padding at rows' ends
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    keys = gpt.CHAT_KEYS
    from test_engine import rounding_tolerance
    with torch.no_grad():
        eager = float(model(**dict(zip(keys, batches[0]))).loss)
        truth = float(copy.deepcopy(model).double()(**dict(zip(keys, batches[0]))).loss)
    engine = pstar_fx.compile(model, {"device": "cpu", "optimizer": {"type": "adamw", "lr": 1e-3}},
                              example_inputs=dict(zip(keys, batches[0])))
    loss = float(engine.step(**dict(zip(keys, batches[0]))))
    assert loss == pytest.approx(eager, rel=rounding_tolerance(eager, truth, 1), abs=0)
