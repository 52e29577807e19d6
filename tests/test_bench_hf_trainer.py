"""bench/hf_trainer_bench.py on CPU: PstarTrainer and the engine's own loop on HF's LlamaForCausalLM of the tiny LLaMA
shape, built on meta, both sides in this process (the GPU run puts each in a subprocess: faked here, as
test_bench_gpt fakes torch-best's children)."""
import json

import pytest
from bench_modules import load

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (the Trainer needs it: pip install -e '.[hf]')")

bench = load("hf_trainer_bench", "bench_hf_trainer")

TINY = ["--model", "hf-llama/tiny", "--device", "cpu", "--batch", "2", "--seq", "16", "--steps", "3"]


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_both_sides_train_the_same_losses_and_report_the_ratio(tmp_path):
    out = tmp_path / "r.jsonl"
    bench.main([*TINY, "--in-process", "--json", str(out)])
    engine, trainer = lines(out)
    assert [engine["side"], trainer["side"]] == ["engine", "trainer"]
    for r in (engine, trainer):
        assert "error" not in r, r.get("error")
        assert (r["tokens_per_step"], r["dtype"], r["device"]) == (32, "bf16", "cpu")
        assert len(r["losses"]) == 3 and len(r["steps_s"]) == 2            # the first step apart
        assert r["compile_s"] > 0 and r["first_step_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(32 * 2 / sum(r["steps_s"]), rel=1e-2)   # (steps_s rounded)
        assert r["config"]["grad_clip"] == 1.0 and r["config"]["lr_schedule"]["total_steps"] == 3
    # the same Config, seed and rows in the same order: the same engine arithmetic, bit for bit
    assert trainer["config_equal"] is True
    assert engine["losses"] == trainer["losses"] and engine["losses_equal"] is True
    assert engine["ratio"] == trainer["ratio"] == pytest.approx(trainer["tokens_per_s"] / engine["tokens_per_s"],
                                                                rel=1e-3)


def test_children_and_a_failed_side(tmp_path, monkeypatch):
    seen = []

    def child(argv, side, timeout_s):
        seen.append((argv, side, timeout_s))
        if side == "trainer":
            return {"side": side, "error": "timeout: no result within 5 s"}
        return {"side": side, "tokens_per_s": 10.0, "losses": [1.0, 2.0]}

    monkeypatch.setattr(bench, "run_child", child)
    out = tmp_path / "r.jsonl"
    bench.main([*TINY, "--json", str(out), "--timeout", "300"])
    assert [s for _, s, _ in seen] == ["engine", "trainer"]
    assert all(argv == TINY and 0 < t <= 300 for argv, _, t in seen)     # less --json and --timeout
    engine, trainer = lines(out)
    assert trainer["error"].startswith("timeout") and engine["ratio"] is None and trainer["ratio"] is None
    with pytest.raises(SystemExit):
        bench.main(["--model", "tiny", "--device", "cpu"])               # our GPT is no Hugging Face model
    with pytest.raises(SystemExit):
        bench.main([*TINY, "--steps", "1"])
