"""adapt: `--lora SPEC` and `--freeze PATTERN` — what part of the model `train` trains.

`--lora r=16,alpha=32,targets=q_proj,k_proj,v_proj,o_proj` wraps the model in `peft`'s LoRA (`get_peft_model` with
a `LoraConfig`; pip install pstar_fx[peft]): its base weights are frozen, so they sit in frozen chunks at the compute
dtype's size, and `--save` writes the adapter as peft does. `--freeze PATTERN` (repeatable) freezes every parameter
whose name matches the fnmatch pattern (`'model.embed_tokens.*'`, `'*.layers.0.*'`), after the LoRA wrapping when
both are given (the names are then peft's, `base_model.model.` first).
"""
from __future__ import annotations

import argparse
from fnmatch import fnmatch

from torch import nn

# --lora's keys: the LoraConfig field each sets, and its type
def _number(text: str) -> int | float:
    """An int when it is one (alpha=32 stays 32 in adapter_config.json), else a float."""
    return int(text) if text.strip().lstrip("-").isdigit() else float(text)


LORA_KEYS = {"r": ("r", int), "alpha": ("lora_alpha", _number), "dropout": ("lora_dropout", float),
             "targets": ("target_modules", str)}


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", type=lora_spec, metavar="SPEC",
                   help="train a LoRA adapter through peft instead of the whole model: comma-separated "
                        "r=RANK,alpha=A,dropout=P,targets=NAME,NAME,... (targets: the module names to adapt, e.g. "
                        "q_proj,k_proj,v_proj,o_proj; default peft's for the model type; dropout default 0); "
                        "--save then writes what PeftModel.from_pretrained reads. Needs pip install pstar_fx[peft]")
    p.add_argument("--freeze", action="append", metavar="PATTERN",
                   help="freeze the parameters whose names match this fnmatch pattern (repeatable): they keep "
                        "their weights, in the compute dtype only (no optimizer state)")


def lora_spec(text: str) -> dict:
    """--lora's type: the LoraConfig keyword arguments of `r=16,alpha=32,targets=q_proj,v_proj`. A word without `=`
    continues the list of the key before it (targets)."""
    out: dict = {}
    key = None
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        name, eq, value = word.partition("=")
        if not eq:
            if key != "targets":
                raise argparse.ArgumentTypeError(f"--lora {text!r}: {word!r} is not KEY=VALUE (keys: "
                                                 f"{', '.join(LORA_KEYS)})")
            out["target_modules"].append(word)
            continue
        key = name.strip()
        if key not in LORA_KEYS:
            raise argparse.ArgumentTypeError(f"--lora: unknown key {key!r}; keys: {', '.join(LORA_KEYS)}")
        field, kind = LORA_KEYS[key]
        try:
            out[field] = [value.strip()] if key == "targets" else kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--lora: {key}={value!r} is not a number") from None
    if "r" not in out:
        raise argparse.ArgumentTypeError(f"--lora {text!r}: give the rank, r=RANK")
    if out["r"] <= 0:
        raise argparse.ArgumentTypeError(f"--lora: r={out['r']}, expected a positive rank")
    out.setdefault("lora_dropout", 0.0)
    return out


def adapt(model: nn.Module, args) -> nn.Module:
    """The model `train` trains: wrapped in LoRA (--lora), with the parameters --freeze names frozen; prints what
    is trained."""
    lora, patterns = getattr(args, "lora", None), getattr(args, "freeze", None) or []
    if lora is None and not patterns:
        return model
    if lora is not None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise ValueError("--lora needs peft: pip install pstar_fx[peft] (or pip install peft)") from None
        model = get_peft_model(model, LoraConfig(**lora))
    names = [n for n, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(fnmatch(n, pattern) for n in names):
            raise ValueError(f"--freeze {pattern!r} matches no parameter; names look like {names[:3]}")
    for name, p in model.named_parameters():
        if any(fnmatch(name, pattern) for pattern in patterns):
            p.requires_grad_(False)
    n_all = sum(p.numel() for p in model.parameters())
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"training {n_trained:,} of {n_all:,} parameters ({100 * n_trained / n_all:.2f}%)"
          + (f"; LoRA r={lora['r']}" + (f" on {','.join(lora['target_modules'])}" if "target_modules" in lora else "")
             if lora is not None else "") + (f"; frozen: {', '.join(patterns)}" if patterns else ""))
    return model
