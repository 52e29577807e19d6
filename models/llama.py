"""LLaMA-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, no biases, untied lm_head.

Same contract as models/gpt.py: forward(idx, targets=None) returns the mean cross-entropy loss or the
logits; build on meta fast; init_weights() (re)initializes every parameter and the RoPE buffers.
RoPE rotates the two halves of each head (the Hugging Face layout), in real arithmetic so that
export and fake tensors see no complex dtype.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt import config_from_table, materialize


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    """Token vocabulary."""
    block_size: int = 4096
    """Longest sequence; the length of the precomputed RoPE tables."""
    n_layer: int = 32
    """Transformer blocks."""
    n_head: int = 32
    """Query heads; n_embd // n_head is the head size."""
    n_kv_head: int = 32
    """Key/value heads (grouped-query attention when < n_head); must divide n_head."""
    n_embd: int = 4096
    """Hidden size (width of the residual stream)."""
    ffn_hidden: int = 11008
    """Inner width of the SwiGLU MLP (gate/up output, down input)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base; frequencies are rope_theta ** (-2i / head_dim)."""

    def __post_init__(self):
        if self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"need n_embd % n_head == 0 and n_head % n_kv_head == 0, got "
                             f"n_embd={self.n_embd} n_head={self.n_head} n_kv_head={self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head size, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def num_params(self) -> int:
        """Parameters of Llama(self), computed without building it."""
        h, kv = self.n_embd, self.n_kv_head * self.head_dim
        attn = 2 * h * h + 2 * h * kv  # q, o and k, v
        per_block = attn + 3 * h * self.ffn_hidden + 2 * h  # + two RMSNorm weights
        return 2 * self.vocab_size * h + self.n_layer * per_block + h  # embedding, untied head, final norm


def rope_tables(config: LlamaConfig, device=None):
    """cos and sin of position * frequency, each (block_size, head_dim // 2), float32."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(config.block_size, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate (B, heads, T, head_dim) by position; in float32 so bf16 compute keeps the angles exact."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.q_proj = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_head != self.n_head:
            # Explicit repeat rather than SDPA's enable_gqa: every SDPA backend and decomposition accepts it.
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        device = torch.get_default_device()
        # Skeleton on meta, one init by init_weights(): see GPT.__init__ for why.
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
            self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            # Buffers, not constants, so they move with the model and a capture sees them as named inputs;
            # non-persistent because they are recomputed, never loaded.
            cos, sin = rope_tables(config)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        if device.type != "meta":
            materialize(self, device)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """(Re)initialize every parameter and buffer in place; deterministic under torch.manual_seed."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)  # projections that write the residual stream
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=residual_std)
            elif p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            else:  # RMSNorm weights, the only 1-D parameters
                nn.init.ones_(p)
        cos, sin = rope_tables(self.config, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        assert T <= self.config.block_size, f"sequence length {T} > block_size {self.config.block_size}"
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


LLAMA_CONFIGS = {
    # small shapes for tests and the CPU demo; vocab 256 fits byte-level tokens
    "tiny": LlamaConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                        ffn_hidden=128),
    "small": LlamaConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_kv_head=2, n_embd=256,
                         ffn_hidden=704),
    # published shapes (Meta's params.json)
    "Llama2_7B": LlamaConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_kv_head=32,
                             n_embd=4096, ffn_hidden=11008, norm_eps=1e-5, rope_theta=10000.0),
    "Llama2_13B": LlamaConfig(vocab_size=32000, block_size=4096, n_layer=40, n_head=40, n_kv_head=40,
                              n_embd=5120, ffn_hidden=13824, norm_eps=1e-5, rope_theta=10000.0),
    "Llama3_8B": LlamaConfig(vocab_size=128256, block_size=8192, n_layer=32, n_head=32, n_kv_head=8,
                             n_embd=4096, ffn_hidden=14336, norm_eps=1e-5, rope_theta=500000.0),
    "Llama3_70B": LlamaConfig(vocab_size=128256, block_size=8192, n_layer=80, n_head=64, n_kv_head=8,
                              n_embd=8192, ffn_hidden=28672, norm_eps=1e-5, rope_theta=500000.0),
}


def llama_config(name: str, **overrides) -> LlamaConfig:
    """LLAMA_CONFIGS[name], e.g. llama_config("Llama3_8B", block_size=2048)."""
    return config_from_table(LLAMA_CONFIGS, name, overrides)
