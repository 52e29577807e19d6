"""LoRA through `peft`: a PeftModel compiles and trains equal to eager peft + torch.optim.AdamW, with its base
weights in frozen chunks; its checkpoint is what `PeftModel.from_pretrained` reads; `pstar-fx train --lora`."""
import copy

import pytest
import torch

import pstar_fx
from pstar_fx.checkpoint import CheckpointError

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[peft]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
from test_engine import assert_losses_close, assert_weights_close, reference_run, tight_budget  # noqa: E402
from test_hf import OPT, batches, hf_model  # noqa: E402

TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj"], "gpt2": ["c_attn", "c_proj"]}


def lora(base, kind):
    # init_lora_weights=False: B random too, so the adapter changes the output from the first step on; seeded, so
    # every call makes the same adapter
    torch.manual_seed(1)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[kind],
                                                     init_lora_weights=False))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_lora_trains_like_eager_peft_and_its_adapter_loads_in_peft(kind, tmp_path):
    base = hf_model(kind)
    model = lora(copy.deepcopy(base), kind)
    data = batches(kind)
    ref, ref_losses = reference_run(model, data, OPT, loss_of=lambda m, b: m(**b).loss)
    cfg = {"chunk_size": 16384, "optimizer": OPT}
    budget, _ = tight_budget(model, data[0], device_chunks=1, **cfg)
    engine = pstar_fx.compile(model, pstar_fx.Config(device="cpu", device_memory=budget, **cfg),
                              example_inputs=data[0])
    layout, plan = engine.lowered.layout, engine.plan
    assert plan.placement.count("host") > len(plan.placement) // 2, plan.placement
    frozen = [ch for ch in layout.chunks if ch.frozen]
    assert frozen and all("lora_" not in s.param.name for ch in frozen for s in ch.slots)
    assert all("lora_" in s.param.name for ch in layout.chunks if not ch.frozen for s in ch.slots)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = [engine.step(**b).item() for b in data]
    assert_losses_close(losses, ref_losses, ref.__dict__["float64_truth"][2])
    sd = engine.state_dict()
    assert_weights_close(sd, ref)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(sd[name], before[name]), name

    engine.save(tmp_path / "adapter")
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files
    assert "model.safetensors" not in files and "config.json" not in files        # the base weights only when asked
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter")).eval()
    trained = engine.export(lora(copy.deepcopy(base), kind)).eval()
    with torch.no_grad():
        ids = data[0]["input_ids"]
        assert torch.equal(loaded(input_ids=ids).logits, trained(input_ids=ids).logits)

    if kind == "llama":                          # an adapter into a model without it: an error that says so
        plain = pstar_fx.compile(copy.deepcopy(base), {"device": "cpu", **cfg}, example_inputs=data[0])
        with pytest.raises(CheckpointError, match="holds a peft adapter"):
            plain.load(tmp_path / "adapter")

    engine.save(tmp_path / "full", full=True)                                     # the whole model as well
    from safetensors.torch import load_file
    whole = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert set(whole) == {n for n, _ in model.named_parameters()} and all(torch.equal(whole[k], sd[k]) for k in whole)


def _hf_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, head_dim=16,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return path


def test_train_cli_with_lora_saves_an_adapter_and_resumes_exactly(tmp_path, capsys):
    from safetensors.torch import load_file

    from pstar_fx.cli import main
    hf = _hf_llama(tmp_path / "llama")
    common = ["train", "--model", f"hf:{hf}", "--batch", "2", "--seq", "32", "--log-every", "1", "--lr", "0.01",
              "--lora", "r=4,alpha=8,targets=q_proj,k_proj,v_proj,o_proj", "--freeze", "*.layers.0.*lora_*"]
    assert main(common + ["--steps", "4", "--save", str(tmp_path / "whole")]) == 0
    out = capsys.readouterr().out
    assert "LoRA r=4 on q_proj,k_proj,v_proj,o_proj" in out and "frozen chunks:" in out and "done: 4 steps" in out
    half = tmp_path / "half"
    assert main(common + ["--steps", "2", "--save", str(half)]) == 0
    assert main(common + ["--steps", "2", "--resume", str(half), "--save", str(half)]) == 0
    assert "resumed: " in capsys.readouterr().out
    a, b = load_file(str(half / "adapter_model.safetensors")), load_file(str(tmp_path / "whole" /
                                                                            "adapter_model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # the adapter holds layer 0's frozen LoRA tensors too (PeftModel.from_pretrained loads every one)
    assert any(".layers.0.self_attn.q_proj.lora_A" in k for k in a) and any(".layers.1.self_attn.o_proj.lora_B" in k
                                                                               for k in a)
    from transformers import AutoModelForCausalLM
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(hf)), str(half))
    assert loaded.peft_config["default"].r == 4


@pytest.mark.parametrize("flag,message", [
    (["--lora", "r=4,rank=2"], "unknown key 'rank'"),
    (["--lora", "alpha=4"], "give the rank"),
    (["--freeze", "nothing.*"], "matches no parameter"),
])
def test_bad_lora_and_freeze_flags_are_clear_errors(tmp_path, flag, message, capsys):
    from pstar_fx.cli import main
    hf = _hf_llama(tmp_path / "llama")
    try:
        code = main(["train", "--model", f"hf:{hf}", "--batch", "2", "--seq", "32", "--steps", "1", *flag])
    except SystemExit as e:
        code = e.code
    assert code in (1, 2) and message in capsys.readouterr().err


def test_a_lora_model_built_on_meta_starts_as_its_base_model():
    """Built on the meta device, its weights made by its own init in chunk memory: the base model's init, then
    LoRA's (B zero, A Kaiming-uniform within 1/sqrt(fan_in)) — not the base model's normal draw for the adapters'
    Linear layers, which made the adapted model differ from its base before any step."""
    from transformers import LlamaForCausalLM
    config = hf_model("llama").config
    lora_config = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS["llama"])
    with torch.device("meta"):
        model = peft.get_peft_model(LlamaForCausalLM(config), peft.LoraConfig(**lora_config))
    data = batches("llama")
    engine = pstar_fx.compile(model, {"device": "cpu", "chunk_size": 16384, "optimizer": OPT},
                              example_inputs=data[0])
    sd = engine.state_dict()
    a = {k: v for k, v in sd.items() if ".lora_A." in k}
    b = {k: v for k, v in sd.items() if ".lora_B." in k}
    assert a and len(a) == len(b) and all(not v.any() for v in b.values())
    assert all(v.any() and float(v.abs().max()) <= v.shape[1] ** -0.5 for v in a.values())
    torch.manual_seed(5)
    real = engine.export(peft.get_peft_model(LlamaForCausalLM(config), peft.LoraConfig(**lora_config))).eval()
    ids = data[0]["input_ids"]
    with torch.no_grad():
        adapted = real(input_ids=ids).logits
        with real.disable_adapter():
            assert torch.equal(adapted, real(input_ids=ids).logits)


@pytest.mark.gpu
def test_gpu_bf16_lora_with_base_weights_on_the_host_tracks_eager_fp32():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base = hf_model("llama")
    model = lora(copy.deepcopy(base), "llama")
    data = batches("llama", n=6)
    ref, ref_losses = reference_run(model, data, OPT, loss_of=lambda m, b: m(**b).loss)
    on_gpu = [{k: v.cuda() for k, v in b.items()} for b in data]
    engine = pstar_fx.compile(model, {"device": "cuda", "dtype": "bf16", "placement": "host", "chunk_size": 16384,
                                      "optimizer": OPT, "compute": "eager"}, example_inputs=on_gpu[0])
    assert "frozen" in engine.plan.ship
    losses = [engine.step(**b).item() for b in on_gpu]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=3e-2, atol=0)
    assert engine.memory_stats()["h2d_bytes"] > 0
