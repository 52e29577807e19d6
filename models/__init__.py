"""Models for pstar_fx: a GPT with PatrickStar's size table and a LLaMA-style model."""

from .gpt import GPT, GPT_CONFIGS, GPTConfig, gpt_config
from .llama import LLAMA_CONFIGS, Llama, LlamaConfig, llama_config


def num_params(config: GPTConfig | LlamaConfig) -> int:
    """Unique parameters (tied weights once) of the model `config` describes, without building it."""
    return config.num_params()


__all__ = ["GPT", "GPTConfig", "gpt_config", "GPT_CONFIGS",
           "Llama", "LlamaConfig", "llama_config", "LLAMA_CONFIGS", "num_params"]
