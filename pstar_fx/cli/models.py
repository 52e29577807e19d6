"""models: what --model names — a GPT or a LLaMA from pstar_fx.models by size name, or a local Hugging Face causal
LM (hf:DIR, a `save_pretrained` folder; its config alone builds fresh weights)."""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pstar_fx.data import has_tokenizer
from pstar_fx.models import GPT_CONFIGS, LLAMA_CONFIGS, GPT, Llama

HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class ModelSpec:
    family: str        # "gpt" | "llama" | "hf"
    name: str          # a size table's key, or the Hugging Face directory
    config: object     # GPTConfig | LlamaConfig | transformers.PretrainedConfig

    def build(self, meta: bool = False) -> nn.Module:
        """The model, in training mode; on the meta device (no memory) for plan."""
        if self.family != "hf":
            if meta:
                with torch.device("meta"):
                    return (Llama if self.family == "llama" else GPT)(self.config)
            return (Llama if self.family == "llama" else GPT)(self.config)
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
        if not sys.stderr.isatty():
            hf_logging.disable_progress_bar()      # its "Loading weights" bars: no bar spam in CI logs
        if meta:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(self.config).train()
        if self.has_weights:
            model = AutoModelForCausalLM.from_pretrained(self.name, dtype=torch.float32, local_files_only=True)
        else:
            model = AutoModelForCausalLM.from_config(self.config)
        return model.train()       # from_pretrained returns eval mode; training means dropout as configured

    def inputs(self, idx: torch.Tensor, tgt: torch.Tensor):
        """One batch as the model's forward takes it: a Hugging Face model shifts its labels itself."""
        return {"input_ids": idx, "labels": idx} if self.family == "hf" else (idx, tgt)

    def row_inputs(self, rows) -> dict | tuple:
        """A batch of record rows (pstar_fx.records.Rows) as the model's forward takes it: a Hugging Face model
        gets the unshifted labels (it shifts them itself) and the attention mask if its forward takes one; our
        own models get targets shifted by one, -100 (cross_entropy's ignore_index) past each row's end."""
        if self.family == "hf":
            inputs = {"input_ids": rows.input_ids, "labels": rows.labels}
            if self.takes_attention_mask:
                inputs["attention_mask"] = rows.attention_mask
            return inputs
        tgt = torch.full_like(rows.labels, -100)
        tgt[:, :-1] = rows.labels[:, 1:]
        return rows.input_ids, tgt

    @property
    def takes_attention_mask(self) -> bool:
        if self.family != "hf":
            return False
        import inspect
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
        try:
            cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(self.config)]
        except KeyError:
            # a class transformers does not map (remote code): its forward is unknown, and a causal LM's loss on
            # rows padded at the end is the same without the mask (no record token attends to a later pad)
            return False
        return "attention_mask" in inspect.signature(cls.forward).parameters

    @property
    def has_weights(self) -> bool:
        return self.family == "hf" and any((Path(self.name) / f).exists() for f in HF_WEIGHTS)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def block_size(self) -> int | None:
        if self.family != "hf":
            return self.config.block_size
        return getattr(self.config, "n_positions", None) or getattr(self.config, "max_position_embeddings", None)

    @property
    def shape(self) -> tuple[int, int]:
        """(layers, hidden size), for the attention term of the FLOP count."""
        if self.family != "hf":
            return self.config.n_layer, self.config.n_embd
        return self.config.num_hidden_layers, self.config.hidden_size

    @property
    def tokenizer_dir(self) -> str | None:
        """A Hugging Face directory's own tokenizer, the default for text data."""
        return self.name if self.family == "hf" and has_tokenizer(self.name) else None

    def __str__(self) -> str:
        if self.family == "hf":
            return f"Hugging Face {type(self.config).__name__.removesuffix('Config')} from {self.name}" + (
                "" if self.has_weights else " (config only: fresh weights)")
        return f"{'LLaMA' if self.family == 'llama' else 'GPT'} {self.name!r}"


def _hf_model(path: str) -> ModelSpec:
    if not (Path(path) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"hf:{path}: expected a Hugging Face model directory with a config.json "
                                         "(model.save_pretrained(DIR) writes one)")
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise argparse.ArgumentTypeError(f"hf:{path}: cannot read its config: {' '.join(str(e).split())}") from None
    return ModelSpec("hf", path, config)


def model_arg(text: str) -> ModelSpec:
    """--model's type: NAME (a GPT), llama:NAME or hf:DIR."""
    if text.startswith("hf:"):
        return _hf_model(text[3:])
    family, _, name = text.rpartition(":")
    family = family or "gpt"
    tables = {"gpt": GPT_CONFIGS, "llama": LLAMA_CONFIGS}
    if family not in tables:
        raise argparse.ArgumentTypeError(f"{text!r}: use NAME (a GPT), llama:NAME or hf:DIR")
    table = tables[family]
    if name not in table:
        raise argparse.ArgumentTypeError(f"unknown {family} model {name!r}; choose from: {', '.join(table)}"
                                         + ("" if family == "llama" else " (or llama:NAME, hf:DIR)"))
    return ModelSpec(family, name, table[name])
