"""pstar_fx.models: config tables, analytic sizes, init, and that the models trace as one graph."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pstar_fx.models import (GPT, GPT_CONFIGS, LLAMA_CONFIGS, GPTConfig, Llama, gpt_config, gpt,
                             llama_config, num_params)
from pstar_fx.models.llama import rope_tables

# PatrickStar's examples/model_builder.py: name -> (HIDDEN_DIM, SEQ_LEN, NUM_LAYER, NUM_HEAD)
PATRICKSTAR = {
    "Bert": (768, 512, 6, 12), "Bertlarge": (1024, 512, 24, 16), "GPT2small": (1536, 128, 24, 16),
    "GPT2_1B": (2048, 1024, 20, 16), "megatron_1.3B": (2048, 1024, 24, 32), "GPT2_2B": (2048, 1024, 40, 16),
    "megatron_3.9B": (2560, 1024, 24, 40), "GPT2_4B": (2304, 1024, 64, 16), "GPT3_6B": (3072, 1024, 53, 16),
    "GPT3_8B": (3072, 1024, 72, 16), "GPT3_10B": (4096, 1024, 50, 16), "GPT3_11B": (4096, 1024, 55, 16),
    "GPT3_12B": (4096, 1024, 60, 16), "GPT3_13B": (4096, 1024, 65, 16), "GPT3_15B": (4096, 1024, 78, 16),
    "GPT3_18B": (4096, 1024, 90, 16), "GPT_NV_18B": (6144, 1024, 40, 16), "GPT_NV_39B": (8192, 1024, 48, 16),
    "GPT_NV_76B": (10240, 1024, 60, 16), "GPT_DS_20B": (8192, 1024, 25, 16), "GPT_DS_40B": (8192, 1024, 50, 16),
    "GPT_DS_50B": (8192, 1024, 62, 16), "GPT_DS_60B": (8192, 1024, 75, 16), "GPT_DS_68B": (9216, 1024, 66, 16),
    "GPT_175B": (12288, 1024, 96, 96), "GPT_220B": (12288, 1024, 120, 96), "GPT_250B": (12288, 1024, 137, 96),
    "GPT_310B": (16384, 1024, 128, 128), "GPT_454B": (20480, 1024, 90, 128),
}

TINY = [(GPT, gpt_config("tiny")), (Llama, llama_config("tiny"))]


def unique_params(model):
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def batch(vocab, B=2, T=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g), torch.randint(0, vocab, (B, T), generator=g)


def test_patrickstar_table_with_head_size_rule():
    changed = []
    for name, (hidden, seq_len, n_layer, n_head) in PATRICKSTAR.items():
        c = gpt_config(name)
        assert (c.n_embd, c.block_size, c.n_layer, c.vocab_size) == (hidden, seq_len, n_layer, 50304), name
        assert c.head_dim in (64, 128), name
        if hidden // n_head in (64, 128):
            assert c.n_head == n_head, name
        else:
            assert c.n_head == hidden // 128, name
            changed.append(name)
    for name in ["GPT2small", "GPT2_4B", "GPT3_6B", "GPT3_10B", "GPT_NV_76B", "GPT_DS_68B", "GPT_454B"]:
        assert name in changed and name in gpt.__doc__  # the module docstring's table lists the changes
    assert "GPT_175B" not in changed and "megatron_3.9B" not in changed


def test_every_name_gives_a_config():
    for name in GPT_CONFIGS:
        c = gpt_config(name)
        assert c == GPT_CONFIGS[name] and num_params(c) > 0
    for name in LLAMA_CONFIGS:
        c = llama_config(name)
        assert c == LLAMA_CONFIGS[name] and num_params(c) > 0
    small, bench = gpt_config("small"), gpt_config("GPT_h3072_L36")
    assert (small.vocab_size, small.block_size, small.n_layer, small.n_embd, small.n_head) == (256, 256, 4, 256, 4)
    assert (bench.n_embd, bench.n_layer, bench.block_size, bench.head_dim) == (3072, 36, 1024, 128)
    assert 4.1e9 < num_params(bench) < 4.3e9


def test_overrides_and_unknown_keys():
    assert gpt_config("GPT3_10B", block_size=2048).block_size == 2048
    assert llama_config("tiny", n_layer=3).n_layer == 3
    with pytest.raises(KeyError, match="GPT3_10B"):  # the message lists the valid names
        gpt_config("GPT3_10b")
    with pytest.raises(TypeError, match="n_embd"):  # the message lists the valid fields
        gpt_config("tiny", hidden=3)
    with pytest.raises(ValueError):
        GPTConfig(n_embd=100, n_head=3)


@pytest.mark.parametrize("cls,name", [(GPT, "tiny"), (GPT, "small"), (GPT, "GPT2small"), (GPT, "GPT3_10B"),
                                      (GPT, "GPT_h3072_L36"), (Llama, "tiny"), (Llama, "Llama2_7B"),
                                      (Llama, "Llama3_8B")])
def test_analytic_count_matches_meta_build(cls, name):
    config = gpt_config(name) if cls is GPT else llama_config(name)
    with torch.device("meta"):
        model = cls(config)
    assert all(p.is_meta for p in model.parameters())
    assert unique_params(model) == num_params(config)


def test_known_sizes():
    assert 10.0e9 < num_params(gpt_config("GPT3_10B")) < 10.6e9
    assert num_params(llama_config("Llama2_7B")) == 6_738_415_616  # Meta's published counts
    assert num_params(llama_config("Llama3_8B")) == 8_030_261_248


@pytest.mark.parametrize("cls,config", TINY)
def test_tiny_forward_backward(cls, config):
    torch.manual_seed(0)
    model = cls(config)
    idx, tgt = batch(config.vocab_size)
    assert model(idx).shape == (2, 32, config.vocab_size)
    loss = model(idx, tgt)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.15  # near-uniform predictions at init
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_gpt_weights_tied():
    model = GPT(gpt_config("tiny"))
    assert model.lm_head.weight is model.wte.weight
    with torch.device("meta"):
        model = GPT(gpt_config("tiny"))
    model.to_empty(device="cpu")  # unties: a new Parameter per module
    model.init_weights()
    assert model.lm_head.weight is model.wte.weight
    idx, tgt = batch(256)
    model(idx, tgt).backward()
    assert model.wte.weight.grad is model.lm_head.weight.grad


def test_gpt_init_values():
    torch.manual_seed(0)
    config = gpt_config("small")
    model = GPT(config)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.h[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * config.n_layer)
    assert model.h[0].attn.c_proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert model.h[0].mlp.c_proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert (model.h[1].ln_2.weight == 1).all() and (model.ln_f.bias == 0).all()
    assert (model.h[1].mlp.c_fc.bias == 0).all()


@pytest.mark.parametrize("cls,config", TINY)
def test_meta_to_empty_init_equals_cpu_build(cls, config):
    torch.manual_seed(0)
    on_cpu = cls(config)
    with torch.device("meta"):
        from_meta = cls(config)
    from_meta.to_empty(device="cpu")
    torch.manual_seed(0)
    from_meta.init_weights()
    a, b = dict(on_cpu.named_parameters()), dict(from_meta.named_parameters())
    a.update(on_cpu.named_buffers()), b.update(from_meta.named_buffers())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    torch.manual_seed(1)
    other = cls(config)
    assert not torch.equal(other.lm_head.weight, on_cpu.lm_head.weight)  # the seed matters


def test_llama_rope_buffers():
    config = llama_config("tiny")
    model = Llama(config)
    buffers = dict(model.named_buffers())
    cos, sin = rope_tables(config)
    assert buffers.keys() == {"rope_cos", "rope_sin"} and cos.shape == (config.block_size, config.head_dim // 2)
    assert torch.equal(buffers["rope_cos"], cos) and torch.equal(buffers["rope_sin"], sin)
    assert "rope_cos" not in model.state_dict()  # recomputed, never loaded
    model.rope_cos.fill_(float("nan")), model.rope_sin.zero_()
    model.init_weights()
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)
    assert llama_config("Llama3_8B").n_kv_head < llama_config("Llama3_8B").n_head  # a GQA shape


@pytest.mark.parametrize("cls,config", TINY)
def test_export_one_graph(cls, config):
    torch.manual_seed(0)
    model = cls(config)
    idx, tgt = batch(config.vocab_size)
    exported = torch.export.export(model, (idx, tgt))
    torch.testing.assert_close(exported.module()(idx, tgt), model(idx, tgt))
    torch.export.export(model, (idx,))


@pytest.mark.parametrize("cls,config", TINY + [(GPT, gpt_config("GPT3_10B"))])
def test_fake_tensor_build_and_step(cls, config):
    with FakeTensorMode():
        model = cls(config)
        idx, tgt = torch.randint(0, config.vocab_size, (1, 64)), torch.randint(0, config.vocab_size, (1, 64))
        loss = model(idx, tgt)
        loss.backward()
        assert loss.shape == () and model.lm_head.weight.grad.shape == model.lm_head.weight.shape
