"""The step of a model with repeated blocks captured from a trace of four of them (pstar_fx/capture_blocks.py) is a
full trace's, node for node: the same code, parameters and gradients; and where the blocks do not repeat (an
attribute of one block differs, a forward that needs every block, too few blocks) the whole model is traced."""
import logging

import pytest
import torch
import transformers
from torch import nn

import pstar_fx
from pstar_fx import capture as cap
from pstar_fx import capture_blocks
from pstar_fx.models import GPT, Llama, gpt_config, llama_config
from test_engine import batch

DEPTH = 8       # blocks in these tests' models: stacks this short are captured by blocks here (the cheapest test)


@pytest.fixture(autouse=True)
def short_stacks(monkeypatch):
    """By blocks from DEPTH blocks on (the default, MIN_BLOCKS, is where that starts to pay: 24)."""
    monkeypatch.setattr(capture_blocks, "MIN_BLOCKS", DEPTH)


def captured(model, inputs, blocks: bool, monkeypatch, dtype=torch.float32):
    monkeypatch.setenv("PSTAR_FX_CAPTURE_BLOCKS", "1" if blocks else "0")
    return cap.capture(model, inputs, torch.device("cpu"), dtype)


def same_capture(model, inputs, monkeypatch, caplog, dtype=torch.float32) -> bool:
    """Whether the capture by blocks ran, asserting it is the full trace's."""
    full = captured(model, inputs, False, monkeypatch, dtype)
    with caplog.at_level(logging.INFO, logger="pstar_fx"):
        caplog.clear()
        stamped = captured(model, inputs, True, monkeypatch, dtype)
    assert stamped.gm.code == full.gm.code
    assert [(p.name, p.aliases, p.shape, p.has_grad) for p in stamped.params] == \
        [(p.name, p.aliases, p.shape, p.has_grad) for p in full.params]
    assert [(n.name, n.meta.get("role"), n.meta.get("index")) for n in stamped.gm.graph.nodes] == \
        [(n.name, n.meta.get("role"), n.meta.get("index")) for n in full.gm.graph.nodes]
    for a, b in zip(stamped.gm.graph.nodes, full.gm.graph.nodes):
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(vb, torch.Tensor):
            assert (va.shape, va.stride(), va.dtype, va.storage_offset()) == \
                (vb.shape, vb.stride(), vb.dtype, vb.storage_offset()), a.name
    return any("captured" in r.getMessage() and "blocks" in r.getMessage() for r in caplog.records)


def hf(kind: str, layers: int = DEPTH, dropout: float = 0.0):
    t = transformers
    if kind == "gpt2":
        cfg = t.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=dropout,
                           embd_pdrop=dropout, attn_pdrop=dropout)
        return t.GPT2LMHeadModel(cfg)
    cfg = t.LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, head_dim=8)
    return t.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_gpt_and_llama_by_blocks_are_their_full_trace(monkeypatch, caplog, dtype):
    gpt = GPT(gpt_config("tiny", n_layer=DEPTH))
    assert same_capture(gpt, batch(), monkeypatch, caplog, dtype)
    if dtype == torch.float32:
        llama = Llama(llama_config("tiny", n_layer=DEPTH))
        assert same_capture(llama, batch(vocab=llama.config.vocab_size), monkeypatch, caplog, dtype)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_models_by_blocks_are_their_full_trace(monkeypatch, caplog, kind):
    model = hf(kind, dropout=0.1)
    ids = torch.randint(0, 128, (2, 16))
    assert same_capture(model, {"input_ids": ids, "labels": ids}, monkeypatch, caplog)


def test_a_peft_lora_model_by_blocks_is_its_full_trace(monkeypatch, caplog):
    """peft's LoRA layers name their target with the block's index in it ("model.layers.5.mlp.gate_proj"): alike
    all the same. Its forward hands **kwargs on, so it gets `use_cache=False` too (else every block builds a KV
    cache: a tensor constant each). Its first block's backward makes no input gradient (nothing before it is
    trained): the template is read from blocks 1-4 of a 5-block trace, block 0 traced as it is."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[peft]')")
    model = peft.get_peft_model(hf("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"]))
    assert capture_blocks._stack(cap._fake_copy(model, cap.FakeTensorMode(), torch.device("cpu"), torch.float32))
    ids = torch.randint(0, 128, (2, 16))
    assert same_capture(model, {"input_ids": ids, "labels": ids}, monkeypatch, caplog)
    assert any("from a trace of 5" in r.getMessage() for r in caplog.records)
    assert not any(n.op == "get_attr" for n in captured(model, {"input_ids": ids, "labels": ids}, True,
                                                            monkeypatch).gm.graph.nodes)


def test_a_frozen_embedding_keeps_block_0_outside_the_template(monkeypatch, caplog):
    """A full fine-tune with the embedding frozen: block 0's backward makes no input gradient, as in LoRA, so the
    template comes from blocks 1-4 (a trace of 5), tried first since nothing before the stack is trained."""
    llama = Llama(llama_config("tiny", n_layer=DEPTH))
    llama.embed_tokens.weight.requires_grad_(False)
    assert same_capture(llama, batch(vocab=llama.config.vocab_size), monkeypatch, caplog)
    assert any("from a trace of 5" in r.getMessage() for r in caplog.records)


def test_blocks_not_alike_or_too_few_are_traced_whole(monkeypatch, caplog):
    few = GPT(gpt_config("tiny", n_layer=DEPTH - 1))
    assert not same_capture(few, batch(), monkeypatch, caplog)
    odd = GPT(gpt_config("tiny", n_layer=DEPTH))
    odd.h[6].attn.some_flag = True                  # one block's attribute differs
    assert not capture_blocks._alike(list(odd.h))
    assert not same_capture(odd, batch(), monkeypatch, caplog)
    frozen = GPT(gpt_config("tiny", n_layer=DEPTH))
    frozen.h[3].mlp.c_fc.weight.requires_grad_(False)
    assert not same_capture(frozen, batch(), monkeypatch, caplog)
    hooked = GPT(gpt_config("tiny", n_layer=DEPTH))
    hooked.h[2].register_forward_hook(lambda m, i, o: None)
    assert not same_capture(hooked, batch(), monkeypatch, caplog)


class ByCount(nn.Module):
    """A forward that reads its blocks by a count of its own: a stack cut short fails, so it is traced whole."""

    def __init__(self, n=DEPTH, d=16):
        super().__init__()
        self.n = n
        self.emb = nn.Embedding(64, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.head = nn.Linear(d, 64)

    def forward(self, x, y):
        h = self.emb(x)
        for i in range(self.n):
            h = torch.tanh(self.blocks[i](h)) + h
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class Skips(nn.Module):
    """Each block reads the output of the block two back: not a chain, so not stamped (traced whole)."""

    def __init__(self, n=DEPTH, d=16):
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.head = nn.Linear(d, 64)

    def forward(self, x, y):
        hs = [self.emb(x)] * 2
        for b in self.blocks:
            hs.append(torch.tanh(b(hs[-1])) + hs[-2])
        return nn.functional.cross_entropy(self.head(hs[-1]).flatten(0, 1), y.flatten())


class Chain(Skips):
    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = torch.tanh(b(h)) + h
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class Indexed(nn.Linear):
    """A block that knows its index (`layer_idx`, as Hugging Face's do) and runs otherwise as the last one."""

    def __init__(self, d: int, layer_idx: int, last: int):
        super().__init__(d, d)
        self.layer_idx, self.last = layer_idx, last

    def forward(self, h):
        h = torch.tanh(super().forward(h)) + h
        return h * 0.5 if self.layer_idx == self.last else h


class LastDiffers(Chain):
    def __init__(self, n=DEPTH, d=16):
        super().__init__(n, d)
        self.blocks = nn.ModuleList(Indexed(d, i, n - 1) for i in range(n))

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def test_forwards_that_do_not_chain_their_blocks_are_traced_whole(monkeypatch, caplog):
    ids = torch.randint(0, 64, (2, 8))
    assert not same_capture(ByCount(), (ids, ids), monkeypatch, caplog)
    assert not same_capture(Skips(), (ids, ids), monkeypatch, caplog)
    assert same_capture(Chain(), (ids, ids), monkeypatch, caplog)


def test_a_block_that_runs_otherwise_by_its_index_is_traced_whole(monkeypatch, caplog):
    """Its attributes are alike but for its index, so only a trace of the last blocks shows the difference."""
    model = LastDiffers()
    assert capture_blocks._alike(list(model.blocks))
    ids = torch.randint(0, 64, (2, 8))
    assert not same_capture(model, (ids, ids), monkeypatch, caplog)


def test_an_engine_captured_by_blocks_trains_bit_for_bit_as_one_traced_whole(monkeypatch):
    data = [batch(seed=s) for s in range(3)]
    runs = {}
    for blocks in (False, True):
        monkeypatch.setenv("PSTAR_FX_CAPTURE_BLOCKS", "1" if blocks else "0")
        torch.manual_seed(0)
        model = GPT(gpt_config("tiny", n_layer=DEPTH))
        engine = pstar_fx.compile(model, {"device": "cpu", "placement": "host", "chunk_size": 16384,
                                          "optimizer": {"type": "adamw", "lr": 1e-2}}, data[0])
        losses = [float(engine.step(*b)) for b in data]
        runs[blocks] = (losses, engine.state_dict())
    assert runs[True][0] == runs[False][0]
    for k, v in runs[False][1].items():
        assert torch.equal(runs[True][1][k], v), k


def test_the_switch_is_a_flag(monkeypatch):
    monkeypatch.setenv("PSTAR_FX_CAPTURE_BLOCKS", "maybe")
    with pytest.raises(ValueError, match="PSTAR_FX_CAPTURE_BLOCKS"):
        capture_blocks.wanted()
