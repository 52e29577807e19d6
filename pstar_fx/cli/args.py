"""args: argument types, and the flags that set a `pstar_fx.Config` field, made from the field itself.

A Config-backed flag takes its type and choices from the field's annotation (`Literal` values become argparse
choices; `Union[int, Literal["auto"]]` reads "auto" or an int) and its help from the field's docstring in
config.py (the first sentence; the command adds what its default is). Config is the one validator: a value
is checked by building a Config with it, and Config's message becomes the argparse error (exit 2).
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import re
import textwrap
import types
import typing
from functools import cache

import torch

from pstar_fx.config import Config

from .models import model_arg

STEPS_ENV = "PSTAR_FX_TRAIN_STEPS"   # default for `train --steps`; CI sets it to keep the README's run short
DEFAULT_STEPS = 200
DEFAULT_BATCH = 8
TRAIN_SEQ_CAP = 128                  # train/explain default --seq: the model's block_size, at most this

# The Config fields the command line sets, each as --NAME-WITH-DASHES (a command takes the ones it adds)
CONFIG_FLAGS = ("device", "device_memory", "host_memory", "dtype", "chunk_size", "seed", "grad_clip", "grad_accum",
                "seq_buckets")


# ---- plain argument types: a bad value is an argparse error that says what is wanted ---------------------

def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return x


def seq_buckets(text: str) -> list[int]:
    """--seq-buckets 128,256,512 -> Config.seq_buckets, checked by Config."""
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sequence lengths separated by commas, like 128,256,512; "
                                         f"got {text!r}") from None
    try:
        Config(seq_buckets=lengths)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("seq_buckets: ")) from None
    return lengths


def default_steps() -> int:
    text = os.environ.get(STEPS_ENV)
    if text is None:
        return DEFAULT_STEPS
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"pstar-fx: error: {STEPS_ENV}: {e}") from None


# ---- flags made from Config's fields ---------------------------------------------------------------------

@cache
def _field_docs() -> dict[str, str]:
    """Each Config field's docstring (the string under it in the class body), whitespace folded."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(Config)))
    except (OSError, TypeError):        # no source shipped: flags without help text
        return {}
    body = tree.body[0].body
    return {stmt.target.id: " ".join(doc.value.value.split()) for stmt, doc in zip(body, body[1:])
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)}


@cache
def _hints() -> dict:
    return typing.get_type_hints(Config)


def _summary(name: str) -> str:
    """The first sentence of a field's docstring."""
    doc = _field_docs().get(name, "")
    m = re.match(r"(.+?[.!?])(?=\s|$)", doc)
    return m.group(1) if m else doc


def _members(hint) -> tuple:
    """What an annotation admits, flattened: Union[int, Literal["auto"]] -> (int, "auto")."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(m for a in typing.get_args(hint) for m in _members(a))
    return (hint,)


def _config_value(name: str, members: tuple):
    """The argparse type of field `name`: the text as the first of the field's types it reads as (a Literal
    value, an int, a float; else the text itself), checked by Config."""
    def convert(text: str):
        value = text
        if text not in members:
            for kind in (k for k in (int, float) if k in members):
                try:
                    value = kind(text)
                    break
                except ValueError:
                    pass
        try:
            Config(**{name: value})
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{name}: ")) from None
        return value
    convert.__name__ = name
    return convert


def config_flag(p: argparse.ArgumentParser, name: str, note: str = "", **kwargs) -> None:
    """--NAME for Config field `name`: choices or type from its annotation, help from its docstring followed
    by `note` (what this command's default is). Given, it is written over --config's value (config_dict)."""
    assert name in CONFIG_FLAGS, name
    members = _members(_hints()[name])
    text = " ".join(s for s in (_summary(name), note) if s).replace("%", "%%")
    if all(isinstance(m, str) for m in members):       # a Literal: argparse checks the choice
        p.add_argument("--" + name.replace("_", "-"), choices=list(members), help=text, **kwargs)
    else:
        p.add_argument("--" + name.replace("_", "-"), type=_config_value(name, members), help=text, **kwargs)


def common(p: argparse.ArgumentParser, model_default: str | None, sizing: bool = False) -> None:
    """The flags every command takes; `sizing` (plan) states plan's own defaults, cuda and bf16."""
    p.add_argument("--model", type=model_arg, default=model_default, required=model_default is None,
                   help="a GPT from pstar_fx.models.GPT_CONFIGS (tiny, small, GPT3_10B, ...), llama:NAME, or "
                        "hf:DIR, a local Hugging Face causal LM (save_pretrained folder: config.json, and "
                        "weights unless they should be fresh)"
                        + (f" (default {model_default})" if model_default else ""))
    p.add_argument("--batch", type=positive_int, default=DEFAULT_BATCH, help=f"default {DEFAULT_BATCH}")
    config_flag(p, "device", "Here: cuda (default: sizing for a GPU box needs no GPU)." if sizing else
                "Here: auto (default: cuda if available, else cpu).")
    config_flag(p, "device_memory", "(default unlimited)" if sizing else
                "(default: the GPU's free memory; with the CPU as the device tier, a budget chosen so that chunks "
                "move every step)", metavar="SIZE")
    config_flag(p, "host_memory", "(default unlimited)", metavar="SIZE")
    config_flag(p, "dtype", f"(default {'bf16' if sizing else 'fp32'})")
    config_flag(p, "chunk_size", "(default auto)", metavar="ELEMS")
    p.add_argument("--config", metavar="FILE.json", help="a pstar_fx.Config as JSON; flags override it"
                   + (" and it overrides plan's defaults" if sizing else ""))


def config_dict(args) -> dict:
    """The --config file's dict with the flags given on the command line written over it."""
    d = {}
    if args.config:
        with open(args.config) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"--config {args.config}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"--config {args.config}: expected a JSON object of Config fields")
    d.update({name: getattr(args, name) for name in CONFIG_FLAGS if getattr(args, name, None) is not None})
    # two flags set part of a field: the optimizer's lr, and a warm-up + cosine lr_schedule over --steps
    if getattr(args, "lr", None) is not None:
        d["optimizer"] = {**d.get("optimizer", {}), "lr": args.lr}
    if getattr(args, "warmup", None) is not None:
        steps = args.steps if args.steps is not None else default_steps()
        d["lr_schedule"] = {"type": "cosine", "warmup_steps": args.warmup, "total_steps": max(steps, args.warmup)}
    return d


# ---- shared set-up ---------------------------------------------------------------------------------------

def seq_len(args, parser, cap: int | None) -> int:
    block = args.model.block_size
    buckets = getattr(args, "seq_buckets", None)
    if buckets:                         # the step is compiled at the largest bucket (Config.seq_buckets)
        top = max(buckets)
        if args.seq is not None and args.seq != top:
            parser.error(f"--seq {args.seq}: with --seq-buckets the step is compiled at the largest bucket, {top}; "
                         "leave --seq out")
        if block is not None and top > block:
            parser.error(f"--seq-buckets: {top} is longer than {args.model}'s block_size {block}")
        return top
    if args.seq is None:
        if block is None:
            if cap is None:
                parser.error(f"{args.model} does not say its longest sequence; give --seq")
            return cap
        return block if cap is None else min(block, cap)
    if block is not None and args.seq > block:
        parser.error(f"--seq {args.seq} is longer than {args.model}'s block_size {block}")
    return args.seq


def example_inputs(args, seq: int):
    x = torch.zeros((args.batch, seq), dtype=torch.long)
    return args.model.inputs(x, x.clone())


def call(fn, inputs):
    """engine.step / engine.evaluate on a batch of positional tensors or of keyword tensors (Hugging Face)."""
    return fn(**inputs) if isinstance(inputs, dict) else fn(*inputs)


def check_cuda(config: Config) -> None:
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {config.device!r} requested but this torch has no usable CUDA "
                         f"(torch {torch.__version__}); use --device cpu")


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__

