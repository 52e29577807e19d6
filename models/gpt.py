"""GPT in the nanoGPT style, sized by PatrickStar's model table (examples/model_builder.py).

Token + learned position embeddings, pre-LN blocks (fused qkv, causal SDPA, 4h GELU MLP), final
LayerNorm, lm_head tied to the token embedding; biases everywhere, no dropout.

Names, hidden sizes, layer counts and sequence lengths (block_size) are PatrickStar's. Its head counts
are kept where the head size is 64 or 128; elsewhere we keep the width and use head size 128
(n_head = n_embd // 128), because flash-attention kernels want 64 or 128 and the parameter count does
not depend on the head count:

    name                                    PatrickStar n_head (head size)   n_head here
    GPT2small                               16 (96)                          12
    GPT2_4B                                 16 (144)                         18
    GPT3_6B, GPT3_8B                        16 (192)                         24
    GPT3_10B, 11B, 12B, 13B, 15B, 18B       16 (256)                         32
    GPT_NV_18B                              16 (384)                         48
    GPT_NV_39B, GPT_DS_20B, 40B, 50B, 60B   16 (512)                         64
    GPT_DS_68B                              16 (576)                         72
    GPT_NV_76B                              16 (640)                         80
    GPT_454B                                128 (160)                        160

Two names understate or overstate their size (we keep them for comparison with PatrickStar's
numbers): megatron_3.9B is 2.0B here (Megatron's 3.9B had 48 layers, PatrickStar uses 24) and
GPT_310B is 413B. `num_params(config)` gives the true count without building the model.
"""

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304
    """Token vocabulary; 50304 is GPT-2's 50257 padded to a multiple of 64 for matmul speed."""
    block_size: int = 1024
    """Longest sequence (number of learned position embeddings); PatrickStar's SEQ_LEN."""
    n_layer: int = 12
    """Transformer blocks."""
    n_head: int = 12
    """Attention heads; n_embd // n_head is the head size."""
    n_embd: int = 768
    """Hidden size (width of the residual stream)."""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon (PyTorch's default)."""

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def num_params(self) -> int:
        """Unique parameters of GPT(self), tied lm_head counted once, computed without building it."""
        h = self.n_embd
        # ln_1 2h + qkv 3h²+3h + attn proj h²+h + ln_2 2h + fc 4h²+4h + mlp proj 4h²+h
        per_block = 12 * h * h + 13 * h
        return self.vocab_size * h + self.block_size * h + self.n_layer * per_block + 2 * h


def materialize(module: nn.Module, device: torch.device):
    """Give every meta parameter and buffer uninitialized storage on device, keeping tied weights tied.

    Module.to_empty() would do, but under FakeTensorMode it swaps tensors and fails on the mode's weakrefs.
    """
    new = {}  # id of the meta tensor -> its replacement, so a tied weight stays one Parameter
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            setattr(m, name, new[id(p)])
        for name, b in m.named_buffers(recurse=False):
            m._buffers[name] = torch.empty_like(b, device=device)  # keeps the buffer's persistence


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # one matmul for q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        device = torch.get_default_device()
        # Build the skeleton on meta and initialize once with init_weights(): no second pass of
        # nn.Linear's default init (tens of seconds for a 10B model on CPU), and a model built on a device
        # equals meta + to_empty + init_weights under the same seed.
        with torch.device("meta"):
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
            self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        if device.type != "meta":
            materialize(self, device)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """(Re)initialize every parameter in place, GPT-2 style; deterministic under torch.manual_seed."""
        # Module.to_empty() replaces parameters one module at a time, which unties lm_head from wte.
        self.lm_head.weight = self.wte.weight
        # residual projections are scaled so the residual stream's variance does not grow with depth
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():  # tied weight appears once
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=residual_std)
            elif p.dim() == 2:  # embeddings and the other Linear weights
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("weight"):  # the only 1-D weights are LayerNorm's
                nn.init.ones_(p)
            else:  # LayerNorm and Linear biases
                nn.init.zeros_(p)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        assert T <= self.config.block_size, f"sequence length {T} > block_size {self.config.block_size}"
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _patrickstar(hidden, seq_len, n_layer, n_head):
    """One row of PatrickStar's table, with the head-size rule of the module docstring applied."""
    if hidden // n_head not in (64, 128):
        n_head = hidden // 128
    return GPTConfig(block_size=seq_len, n_layer=n_layer, n_head=n_head, n_embd=hidden)


GPT_CONFIGS = {
    # small shapes for tests and the CPU demo; vocab 256 fits byte-level tokens
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64),
    "small": GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=256),
    # the 4.2B shape our benchmarks compare against PyTorch, DeepSpeed and PatrickStar on one H200
    "GPT_h3072_L36": GPTConfig(block_size=1024, n_layer=36, n_head=24, n_embd=3072),
    # PatrickStar's table: HIDDEN_DIM, SEQ_LEN, NUM_LAYER, NUM_HEAD
    "Bert": _patrickstar(768, 512, 6, 12),
    "Bertlarge": _patrickstar(1024, 512, 24, 16),
    "GPT2small": _patrickstar(1536, 128, 24, 16),
    "GPT2_1B": _patrickstar(2048, 1024, 20, 16),
    "megatron_1.3B": _patrickstar(2048, 1024, 24, 32),
    "GPT2_2B": _patrickstar(2048, 1024, 40, 16),
    "megatron_3.9B": _patrickstar(2560, 1024, 24, 40),
    "GPT2_4B": _patrickstar(2304, 1024, 64, 16),
    "GPT3_6B": _patrickstar(3072, 1024, 53, 16),
    "GPT3_8B": _patrickstar(3072, 1024, 72, 16),
    "GPT3_10B": _patrickstar(4096, 1024, 50, 16),
    "GPT3_11B": _patrickstar(4096, 1024, 55, 16),
    "GPT3_12B": _patrickstar(4096, 1024, 60, 16),
    "GPT3_13B": _patrickstar(4096, 1024, 65, 16),
    "GPT3_15B": _patrickstar(4096, 1024, 78, 16),
    "GPT3_18B": _patrickstar(4096, 1024, 90, 16),
    "GPT_NV_18B": _patrickstar(6144, 1024, 40, 16),
    "GPT_NV_39B": _patrickstar(8192, 1024, 48, 16),
    "GPT_NV_76B": _patrickstar(10240, 1024, 60, 16),
    "GPT_DS_20B": _patrickstar(8192, 1024, 25, 16),
    "GPT_DS_40B": _patrickstar(8192, 1024, 50, 16),
    "GPT_DS_50B": _patrickstar(8192, 1024, 62, 16),
    "GPT_DS_60B": _patrickstar(8192, 1024, 75, 16),
    "GPT_DS_68B": _patrickstar(9216, 1024, 66, 16),
    "GPT_175B": _patrickstar(12288, 1024, 96, 96),
    "GPT_220B": _patrickstar(12288, 1024, 120, 96),
    "GPT_250B": _patrickstar(12288, 1024, 137, 96),
    "GPT_310B": _patrickstar(16384, 1024, 128, 128),
    "GPT_454B": _patrickstar(20480, 1024, 90, 128),
}


def config_from_table(table: dict, name: str, overrides: dict):
    """table[name] with fields replaced by overrides; unknown names or fields are errors listing the valid ones."""
    if name not in table:
        raise KeyError(f"unknown model name {name!r}; valid names: {', '.join(table)}")
    config = table[name]
    fields = [f.name for f in dataclasses.fields(config)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(f"unknown {type(config).__name__} fields {unknown}; valid fields: {', '.join(fields)}")
    return dataclasses.replace(config, **overrides)


def gpt_config(name: str, **overrides) -> GPTConfig:
    """GPT_CONFIGS[name], e.g. gpt_config("GPT3_10B", block_size=2048)."""
    return config_from_table(GPT_CONFIGS, name, overrides)
