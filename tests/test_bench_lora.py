"""bench/lora_bench.py on CPU: peft LoRA on HF's LlamaForCausalLM of the tiny LLaMA shape, built on meta, trained by
pstar_fx and by peft under FSDP2 (gloo, one process; the GPU run adds CPUOffloadPolicy), each in this process."""
import json
import os

import pytest
from bench_modules import load

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[peft]')")

bench = load("lora_bench", "bench_lora")

TINY = ["--model", "hf-llama/tiny", "--device", "cpu", "--batch", "2", "--seq", "16", "--steps", "3", "--rank", "4"]


@pytest.mark.parametrize("system", ["pstar_fx", "fsdp2"])
def test_a_side_trains_lora_and_counts_frozen_and_trainable_flops(tmp_path, system):
    out = tmp_path / "r.jsonl"
    env = dict(os.environ)
    bench.main([*TINY, "--system", system, "--peer-layers", "2", "--json", str(out)])
    (r,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert "error" not in r, r.get("error")
    # the one-process group's launch variables are gone again (later tests would take themselves for a rank)
    assert dict(os.environ) == env
    model = bench.lora_model(bench.gpt.model_config("hf-llama/tiny", 16, 2)[0], 4)
    frozen, trainable = bench.counts(model)
    # the seven projections of each of the 2 layers adapted: A (in x r) and B (r x out) each
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) > 0
    assert (r["params_frozen"], r["params_trainable"], r["layers"]) == (frozen, trainable, 2)
    assert len(r["losses"]) == 3 and all(x == x for x in r["losses"])
    assert r["step_s"] > 0
    assert r["tflops"] == pytest.approx((4 * frozen + 6 * trainable) * 32 / r["step_s"] / 1e12, abs=0.06)
