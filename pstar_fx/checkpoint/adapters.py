"""adapters: a `peft` model's checkpoint as `peft` writes it — `adapter_model.safetensors` (the adapter weights under
peft's own key names) and `adapter_config.json`, which `PeftModel.from_pretrained(base, dir)` reads — beside the
optimizer and loop state a resume needs. The base model's frozen weights are not written (the base checkpoint has
them) unless a save asks for the full weights (`save(..., full=True)`).

`Adapter` is what the engine hands over, made once at compile from the live `PeftModel`: its configs and, per
trained parameter, peft's key. The keys come from peft itself (`get_peft_model_state_dict`, which drops the adapter
name and keeps only the adapter's tensors), so every adapter type peft saves maps as peft maps it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from torch import nn

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class Adapter:
    """A `peft` model's adapter, as a checkpoint saves and loads it."""
    configs: dict             # adapter name -> its PeftConfig (written as adapter_config.json)
    keys: dict[str, str]      # the model's parameter name -> peft's key in adapter_model.safetensors (every trained
    #                           parameter, and any adapter tensor that was frozen)

    def write_config(self, directory: Path) -> None:
        """adapter_config.json as `PeftModel.save_pretrained` writes it (for inference: `inference_mode` on)."""
        for name, config in self.configs.items():
            config = copy.deepcopy(config)
            config.inference_mode = True
            where = directory if name == "default" else directory / name   # peft's layout for more adapters
            where.mkdir(parents=True, exist_ok=True)
            config.save_pretrained(str(where))


def adapter_of(model: nn.Module) -> Adapter | None:
    """The adapter of a `peft.PeftModel` (None for any other model), with peft's key of every trained parameter."""
    if not hasattr(model, "peft_config") or not hasattr(model, "active_adapter"):
        return None
    try:
        from peft import PeftModel, get_peft_model_state_dict
    except ImportError:       # a model that looks like peft's, without peft installed: save it whole
        return None
    if not isinstance(model, PeftModel):
        return None
    if len(model.peft_config) != 1:
        raise ValueError(f"a PeftModel with {len(model.peft_config)} adapters ({list(model.peft_config)}): train one "
                         "adapter at a time (peft's delete_adapter drops the others)")
    (adapter_name,) = model.peft_config
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    # peft picks and renames by key; stand-in values tell which parameter each key came from. Every parameter is
    # offered: an adapter tensor someone froze (--freeze) is still part of the adapter peft loads
    marks = {n: object() for n, _ in model.named_parameters()}
    picked = get_peft_model_state_dict(model, state_dict=dict(marks), adapter_name=adapter_name,
                                       save_embedding_layers=False)
    by_mark = {id(v): n for n, v in marks.items()}
    keys = {by_mark[id(v)]: k for k, v in picked.items() if id(v) in by_mark}
    left = sorted(set(trained) - set(keys))
    if left:
        raise ValueError(f"trainable parameters that peft's adapter checkpoint leaves out: {left[:5]}; freeze them "
                         "(requires_grad=False) or list their modules in the LoraConfig's modules_to_save")
    return Adapter(dict(model.peft_config), keys)
