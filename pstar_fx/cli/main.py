"""cli: `pstar-fx train | plan | explain | bench`, thin wrappers over `pstar_fx.compile` and `pstar_fx.plan`.

    train    build a model, compile its step, train it on the stdlib's bytes or on --data (pstar_fx.data)
    plan     size a model built on the meta device against budgets: fits or not, and why; allocates nothing
    explain  compile like train, print engine.explain() (and engine.graph.code with --code)
    bench    run the repository's pytest-benchmark cases (bench/test_bench_*.py): save a baseline, compare with it

Models: a GPT from pstar_fx.models (NAME), a LLaMA (llama:NAME) or a local Hugging Face causal LM (hf:DIR, a
`save_pretrained` folder; its config alone builds fresh weights). Without a GPU the CPU plays the device tier:
train and explain then pick a device budget that the whole step would overflow, so that most chunks' fp32 state
lives on the host and chunks really move each step.
Exit codes: 0 done, 1 a clear error on one line of stderr (for plan also "does not fit", after its summary),
2 bad arguments, 130 interrupted (train saves first when --save is given); bench exits with pytest's code.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import pstar_fx
from pstar_fx.config import Config, format_bytes, parse_bytes
from pstar_fx.planning.costs import NOMINAL_COLL_BW, assumed
from pstar_fx.data import (TEXT_SUFFIXES, TOKEN_DTYPES, batches, check_vocab, has_tokenizer, held_out,
                           load_tokenizer, read_tokens, vocab_size)
from pstar_fx.runtime.dist import world_from_env
from pstar_fx.models import GPT_CONFIGS, LLAMA_CONFIGS, GPT, Llama

STEPS_ENV = "PSTAR_FX_TRAIN_STEPS"   # default for `train --steps`; CI sets it to keep the README's run short
DEFAULT_STEPS = 200
DEFAULT_BATCH = 8
TRAIN_SEQ_CAP = 128                  # train/explain default --seq: the model's block_size, at most this
MiB = 2**20
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


# ---- argument types: a bad value is an argparse error that says what is wanted ---------------------------

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


def _model(text: str) -> ModelSpec:
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


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return x


def _bytes(text: str) -> int:
    try:
        return parse_bytes(int(text) if text.isdigit() else text, "size")
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("size: ")) from None


def _chunk_size(text: str):
    return "auto" if text == "auto" else _positive_int(text)


def _device(text: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not one of auto, cpu, cuda, cuda:N")
    return text


def _default_steps() -> int:
    text = os.environ.get(STEPS_ENV)
    if text is None:
        return DEFAULT_STEPS
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"pstar-fx: error: {STEPS_ENV}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pstar-fx", description=__doc__.splitlines()[0].partition(": ")[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,plan,explain,bench}")

    def common(p: argparse.ArgumentParser, model_default: str | None, sizing: bool = False) -> None:
        """The flags every command takes; `sizing` (plan) states plan's own defaults, cuda and bf16."""
        p.add_argument("--model", type=_model, default=model_default, required=model_default is None,
                       help="a GPT from pstar_fx.models.GPT_CONFIGS (tiny, small, GPT3_10B, ...), llama:NAME, or "
                            "hf:DIR, a local Hugging Face causal LM (save_pretrained folder: config.json, and "
                            "weights unless they should be fresh)"
                            + (f" (default {model_default})" if model_default else ""))
        p.add_argument("--batch", type=_positive_int, default=DEFAULT_BATCH, help=f"default {DEFAULT_BATCH}")
        p.add_argument("--device", type=_device,
                       help="cuda (default: sizing for a GPU box needs no GPU), cuda:N, cpu, auto" if sizing else
                            "auto (default: cuda if available, else cpu), cpu, cuda, cuda:N")
        p.add_argument("--device-memory", type=_bytes, metavar="SIZE",
                       help="device tier budget, e.g. 64MiB, 80GB (default unlimited)" if sizing else
                            "device tier budget, e.g. 64MiB, 80GB (default: the GPU's free memory; with the CPU as "
                            "the device tier, a budget chosen so that chunks move every step)")
        p.add_argument("--host-memory", type=_bytes, metavar="SIZE", help="host tier budget (default unlimited)")
        p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                       help=f"compute dtype (default {'bf16' if sizing else 'fp32'})")
        p.add_argument("--chunk-size", type=_chunk_size, metavar="ELEMS", help="elements per chunk, or auto (default)")
        p.add_argument("--config", metavar="FILE.json", help="a pstar_fx.Config as JSON; flags override it"
                       + (" and it overrides plan's defaults" if sizing else ""))

    train = sub.add_parser("train", help="train a model on the Python stdlib's bytes or on your --data",
                           description="Compile a model's training step and train it on --data (a text file, a "
                                       "folder of text files or a token file), or without it on the bytes of the "
                                       "Python standard library's source.")
    common(train, "small")
    train.add_argument("--data", metavar="PATH",
                       help="a text file; a folder of text files (" + ", ".join("*" + x for x in TEXT_SUFFIXES)
                            + ", recursively, in sorted path order); or a token file *.bin of raw token ids as "
                            "nanoGPT writes them, memory-mapped (default: the Python stdlib's source)")
    train.add_argument("--data-dtype", choices=list(TOKEN_DTYPES),
                       help="a *.bin file's token type (default uint16, or uint32 when the model's vocabulary "
                            "exceeds 65536)")
    train.add_argument("--tokenizer", metavar="DIR",
                       help="a local Hugging Face tokenizer directory for text data, or 'bytes' (vocabulary 256); "
                            "default: an hf:DIR model's own tokenizer if it has one, else bytes")
    train.add_argument("--seq", type=_positive_int,
                       help=f"sequence length (default the model's block_size, at most {TRAIN_SEQ_CAP})")
    train.add_argument("--steps", type=_positive_int, default=None,
                       help=f"training steps (default {DEFAULT_STEPS}, or ${STEPS_ENV})")
    train.add_argument("--lr", type=_positive_float, help="learning rate (default 1e-3)")
    train.add_argument("--grad-clip", type=_positive_float, metavar="NORM", help="clip the global gradient norm")
    train.add_argument("--grad-accum", type=_positive_int, metavar="K", help="micro-batches of --batch per update")
    train.add_argument("--warmup", type=int, metavar="STEPS", help="linear warm-up, then cosine decay to 0 over "
                       "--steps (Config.lr_schedule; --config takes any schedule)")
    train.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default 0)")
    train.add_argument("--log-every", type=_positive_int, default=10, metavar="N", help="default 10")
    train.add_argument("--save", metavar="DIR", help="a checkpoint directory (engine.save) written at the end, also "
                       "when interrupted, and every --save-every steps; a path ending in .pt gets "
                       "torch.save(engine.state_dict()) instead")
    train.add_argument("--save-every", type=_positive_int, metavar="N", help="also save every N steps")
    train.add_argument("--resume", metavar="DIR", help="start from this checkpoint (or folder of safetensors weights)")
    train.add_argument("--nproc", type=_positive_int, default=1, metavar="N",
                       help="data-parallel ranks on this machine (runs torchrun; --batch is per rank; default 1)")
    train.add_argument("--eval-every", type=_positive_int, metavar="N", help="every N steps, the loss of a held-out "
                       "batch (the data's last 5%%, kept out of training), forward only (engine.evaluate)")
    train.add_argument("--metrics", metavar="FILE.jsonl", help="append one JSON object per step (step, loss, lr, "
                       "grad_norm, clip_coef, skipped, tokens_per_s, tflops, seconds; eval_loss when evaluated), "
                       "flushed as it is written")
    train.add_argument("--progress", choices=["auto", "bar", "lines"], default="auto",
                       help="auto (default): a progress bar on stderr when it is a terminal, else lines only; "
                            "the step lines on stdout are printed either way")

    plan = sub.add_parser("plan", help="does a model fit? (built on the meta device, nothing allocated)",
                          description="Plan a model built on the meta device against device and host budgets. "
                                      "Sizing for a GPU box by default (--device cuda --dtype bf16, no GPU needed). "
                                      "Exits 0 when it fits, 1 when it does not.")
    common(plan, None, sizing=True)
    plan.add_argument("--seq", type=_positive_int, help="sequence length (default the model's block_size)")
    plan.add_argument("--gpus", type=_positive_int, default=1, metavar="N",
                      help="data-parallel ranks, chunks partitioned (chunk c's state lives on rank c %% N only); "
                           "--batch, --device-memory and --host-memory are then per rank, and the plan printed is "
                           "rank 0's, which holds the most chunks (default 1)")
    plan.add_argument("--coll-bw", type=_positive_float, metavar="GB/s",
                      help="the collective bus bandwidth between ranks to assume, with --gpus (default the "
                           f"nominal figure, printed: {NOMINAL_COLL_BW['cuda'] / 1e9:.0f} for cuda, NCCL within one "
                           "NVLink host; across hosts give the network's, e.g. 45 for 400 Gb/s InfiniBand per GPU)")

    explain = sub.add_parser("explain", help="compile like train and print the plan and schedule")
    common(explain, "small")
    explain.add_argument("--seq", type=_positive_int,
                         help=f"sequence length (default the model's block_size, at most {TRAIN_SEQ_CAP})")
    explain.add_argument("--seed", type=int, default=0, help="seed for the weights (default 0)")
    explain.add_argument("--code", action="store_true", help="also print engine.graph.code")
    explain.add_argument("--plot", metavar="OUT.png", help="also draw the plan along the step to this image: "
                         "bytes per tier against the budgets, chunk moves, each chunk's tier (needs matplotlib: "
                         "pip install pstar_fx[plot])")

    bench = sub.add_parser("bench", help="run the benchmark cases in bench/ (pytest-benchmark): save, compare",
                           description="Run the repository's benchmark cases (bench/test_bench_*.py) with "
                                       "pytest-benchmark, --benchmark-only: the CPU cases by default, the GPU cases "
                                       "(marked gpu) with --gpu. Prints the pytest command and exits with its code "
                                       "(1: a case failed or a comparison exceeded --fail; 2: no bench/ folder or "
                                       "no saved run of that name). Needs a source checkout (pip install -e .) and "
                                       "the dev extra.")
    bench.add_argument("--save", metavar="NAME", help="save this run as NAME: STORAGE/MACHINE/NNNN_NAME.json "
                       "(pytest-benchmark's --benchmark-save)")
    bench.add_argument("--compare", metavar="NAME", help="compare with the latest run saved as NAME on this machine "
                       "(a table of both; --benchmark-compare)")
    bench.add_argument("--fail", type=_positive_int, metavar="PCT", help="with --compare: fail (exit 1) when a "
                       "case's mean time is more than PCT%% (a whole number) above the saved run's "
                       "(--benchmark-compare-fail=mean:PCT%%)")
    bench.add_argument("-k", dest="keyword", metavar="EXPR", help="only the cases matching this pytest -k expression")
    bench.add_argument("--gpu", action="store_true", help="the GPU cases instead of the CPU ones (they skip, saying "
                       "why, without CUDA)")
    bench.add_argument("--storage", metavar="DIR", help="where runs are saved and looked up (default: .benchmarks "
                       "in the repository)")
    bench.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARG",
                       help="after --: more pytest options, passed on as they are (e.g. -- -x --benchmark-json=F)")
    return parser


# ---- shared set-up ---------------------------------------------------------------------------------------

def _config_dict(args) -> dict:
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
    for key in ("device", "device_memory", "host_memory", "dtype", "chunk_size"):
        if getattr(args, key) is not None:
            d[key] = getattr(args, key)
    if getattr(args, "lr", None) is not None:
        d["optimizer"] = {**d.get("optimizer", {}), "lr": args.lr}
    if getattr(args, "seed", None) is not None:
        d["seed"] = args.seed
    if getattr(args, "grad_clip", None) is not None:
        d["grad_clip"] = args.grad_clip
    if getattr(args, "grad_accum", None) is not None:
        d["grad_accum"] = args.grad_accum
    if getattr(args, "warmup", None) is not None:
        steps = args.steps if args.steps is not None else _default_steps()
        d["lr_schedule"] = {"type": "cosine", "warmup_steps": args.warmup, "total_steps": max(steps, args.warmup)}
    return d


def _seq(args, parser, cap: int | None) -> int:
    block = args.model.block_size
    if args.seq is None:
        if block is None:
            if cap is None:
                parser.error(f"{args.model} does not say its longest sequence; give --seq")
            return cap
        return block if cap is None else min(block, cap)
    if block is not None and args.seq > block:
        parser.error(f"--seq {args.seq} is longer than {args.model}'s block_size {block}")
    return args.seq


def _example_inputs(args, seq: int):
    x = torch.zeros((args.batch, seq), dtype=torch.long)
    return args.model.inputs(x, x.clone())


def _call(fn, inputs):
    """engine.step / engine.evaluate on a batch of positional tensors or of keyword tensors (Hugging Face)."""
    return fn(**inputs) if isinstance(inputs, dict) else fn(*inputs)


def flops_per_token(n_params: int, n_layer: int, n_embd: int, seq: int) -> int:
    """Training FLOPs per token of a causal LM, PaLM's count (Chowdhery et al. 2022, appendix B): 6 per parameter
    (forward 2, backward 4; the embedding's parameters included) plus 12 * layers * width * seq for the attention
    scores and their weighted sum over the whole (unmasked) seq x seq matrix. Recompute is not counted: these
    are the model's FLOPs, not the hardware's."""
    return 6 * n_params + 12 * n_layer * n_embd * seq


def _check_cuda(config: Config) -> None:
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {config.device!r} requested but this torch has no usable CUDA "
                         f"(torch {torch.__version__}); use --device cpu")


def _auto_budgets(model, d: dict, inputs) -> tuple[int, list[int]]:
    """What the whole step needs on the device, and device budgets to try, in order, when the CPU plays the
    device tier and no budget was given.

    The first budget has room for the step's activations, about a quarter of the chunks' fp32 state and 4
    compute slots, so most state lives on the host and chunks move every step; the later ones are
    fallbacks in case the planner needs more room than that (e.g. one op reads more chunks at once).
    """
    whole = pstar_fx.plan(model, Config.from_dict({**d, "placement": "device", "device_memory": None}), inputs)
    state = whole.device_breakdown["chunk state"]
    n_chunks = len(whole.placement)
    chunk_state = state // n_chunks
    slot_bytes = whole.profile.chunk_elems * Config.from_dict(d).torch_dtype.itemsize
    base = whole.device_peak_bytes - state - whole.device_breakdown["compute slots"]
    budgets = [base + keep * chunk_state + slots * slot_bytes for keep, slots in ((n_chunks // 4, 4),
                                                                                  (n_chunks // 2, 8))]
    return whole.device_peak_bytes, [b for b in budgets if b < whole.device_peak_bytes] + [whole.device_peak_bytes]


def _compile(args, parser, cap: int | None):
    """Model, Engine and sequence length for train/explain; prints the device budget it chose, if it chose one."""
    seq = _seq(args, parser, cap)
    d = _config_dict(args)
    config = Config.from_dict(d)
    _check_cuda(config)
    torch.manual_seed(args.seed)
    model = args.model.build()
    inputs = _example_inputs(args, seq)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {n_params:,} parameters; batch {args.batch} x seq {seq}; {config.dtype}; "
          f"device {config.device}")
    auto = config.device == "cpu" and config.device_memory is None and config.placement == "auto"
    if not auto:
        return model, pstar_fx.compile(model, config, inputs), seq
    whole_bytes, budgets = _auto_budgets(model, d, inputs)
    for i, budget in enumerate(budgets):
        try:
            engine = pstar_fx.compile(model, Config.from_dict({**d, "device_memory": budget}), inputs)
        except pstar_fx.BudgetError:
            if i == len(budgets) - 1:
                raise
            continue
        n_host, n_chunks = engine.plan.placement.count("host"), len(engine.plan.placement)
        print(f"device memory: {format_bytes(budget)}, chosen for you: the whole step on the device would need "
              f"{format_bytes(whole_bytes)}; "
              + (f"in this budget {n_chunks - n_host} of {n_chunks} chunks' fp32 state fit on the device and "
                 f"{n_host} live on the host, so chunks move every step" if n_host else
                 "no smaller budget fit, so nothing moves")
              + " (--device-memory sets the budget)")
        return model, engine, seq


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"


# ---- commands --------------------------------------------------------------------------------------------

def _save(engine, path: str) -> None:
    if path.endswith((".pt", ".pth")):
        torch.save(engine.state_dict(), path)
        print(f"saved: {path} (state_dict after {engine.steps} update(s); load with "
              "model.load_state_dict(torch.load(path), strict=False))", flush=True)
    else:
        engine.save(path)
        print(f"saved: {path} (checkpoint after {engine.steps} update(s); --resume {path} goes on from it)",
              flush=True)


def _train_tokens(args, seq: int):
    """The training tokens and, with --eval-every, a held-out batch, checked against the model's vocabulary
    before anything compiles; prints what they are."""
    model_vocab = args.model.vocab_size
    tok_dir = args.tokenizer if args.tokenizer is not None else args.model.tokenizer_dir
    is_ids = args.data is not None and Path(args.data).suffix == ".bin" and not Path(args.data).is_dir()
    if tok_dir == "bytes" or is_ids and args.tokenizer is None:
        tok_dir = None                        # a token file holds ids already; an hf:DIR tokenizer does not apply
    tokenizer = load_tokenizer(tok_dir) if tok_dir else None
    vocab = vocab_size(tokenizer)
    if not is_ids and vocab > model_vocab:
        raise ValueError(f"{'tokenizer ' + tok_dir if tokenizer else 'byte data'} has a vocabulary of {vocab}, "
                         f"but {args.model} has vocab_size {model_vocab}; use a model with at least {vocab} "
                         "(or a smaller tokenizer)")
    dtype = args.data_dtype or ("uint16" if model_vocab <= 2**16 else "uint32")
    tokens = read_tokens(args.data, tokenizer, dtype)
    source = args.data or "Python stdlib source"
    check_vocab(tokens, model_vocab, f"data {source}")
    unit = (f"{dtype} ids" if is_ids else f"tokenizer {tok_dir}, vocab {vocab:,}" if tokenizer
            else "bytes, vocab 256")
    print(f"data: {len(tokens):,} tokens ({unit}) of {source}" + (", memory-mapped" if is_ids else ""))
    held = None
    if args.eval_every:
        tokens, rest = held_out(tokens)
        if len(rest) < seq + 1:
            raise ValueError(f"data {source}: the held-out last 5% is {len(rest):,} tokens, fewer than one window "
                             f"of --seq {seq} + 1; give more data or a shorter --seq (or no --eval-every)")
        held = next(batches(rest, args.batch, seq, seed=args.seed + 1))
    if len(tokens) < seq + 1:
        raise ValueError(f"data {source}: {len(tokens):,} training tokens, fewer than one window of --seq {seq} + 1; "
                         "give more data or a shorter --seq")
    return tokens, held


class _Bar:
    """The training progress bar (tqdm on stderr; its ETA is tqdm's), or nothing when stderr is not a terminal:
    CI logs get the step lines alone. Lines go to stdout through tqdm.write so that they never break the bar."""

    def __init__(self, mode: str, total: int, initial: int):
        from tqdm import tqdm
        on = mode == "bar" or mode == "auto" and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, unit="step", file=sys.stderr, dynamic_ncols=True,
                        leave=False) if on else None
        self._write = tqdm.write

    def update(self, **postfix) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if postfix:               # a log step: always shown (update alone shows at most every 0.1 s)
                self.bar.set_postfix_str("  ".join(f"{k} {v}" for k, v in postfix.items()))

    def print(self, line: str) -> None:
        self._write(line, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _torchrun(args) -> int:
    """`--nproc N`: this command again under torchrun, as N ranks on this machine (each drops --nproc)."""
    import subprocess
    argv, skip = [], False
    for a in args.argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            argv.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "pstar_fx.cli", *argv]
    print("launching: " + " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


def cmd_train(args, parser) -> int:
    steps = args.steps if args.steps is not None else _default_steps()
    if args.save_every and not args.save:
        parser.error("--save-every needs --save DIR")
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _torchrun(args)
    rank, world, _ = world_from_env()
    if rank:                                   # one rank reports: the others' lines would repeat its own
        sys.stdout = open(os.devnull, "w")
        logging.getLogger("pstar_fx").setLevel(logging.WARNING)
    tokens, held = _train_tokens(args, _seq(args, parser, TRAIN_SEQ_CAP))     # bad data fails before compiling
    model, engine, seq = _compile(args, parser, TRAIN_SEQ_CAP)
    if args.resume:
        engine.load(args.resume)
        print(f"resumed: {args.resume} at update {engine.steps}")
    print(engine.explain())
    k = engine.config.grad_accum
    n_layer, n_embd = args.model.shape
    flops = flops_per_token(sum(p.numel() for p in model.parameters()), n_layer, n_embd, seq)
    print(f"training: {steps} steps of {args.batch * k * seq * world:,} tokens"
          + (f" ({world} ranks of {args.batch * k * seq:,})" if world > 1 else "")
          + f"; {flops:,} FLOPs per token (6 * parameters + 12 * layers * width * seq)")
    # a step takes grad_accum micro-batches on each rank; every rank draws the whole batch and keeps its part
    data = _rank_part(batches(tokens, args.batch * k * world, seq, seed=args.seed), rank, world)
    first_step = engine.steps
    for _ in range(first_step):                                     # resumed: the batches those updates saw
        next(data)
    tokens_per_step = args.batch * k * seq * world
    metrics = open(args.metrics, "a") if args.metrics else None
    bar = _Bar(args.progress, first_step + steps, first_step)
    first = last = None
    in_step = interrupted = False
    start = mark = time.perf_counter()
    loss_sum, since = 0.0, 0
    ran = 0
    try:
        for step in range(first_step + 1, first_step + steps + 1):   # numbered on from a resumed checkpoint
            idx, tgt = next(data)
            in_step = True
            t0 = time.perf_counter()
            loss = _call(engine.step, args.model.inputs(idx, tgt))
            seconds = time.perf_counter() - t0
            in_step = False
            ran += 1
            loss_sum, since = loss_sum + loss, since + 1    # a tensor sum: no device sync until printed
            r = engine.last_step
            record = None if metrics is None else {
                "step": step, "loss": float(loss), "lr": r.lr, "grad_norm": r.grad_norm, "clip_coef": r.clip_coef,
                "skipped": r.skipped, "tokens_per_s": tokens_per_step / seconds,
                "tflops": tokens_per_step * flops / seconds / 1e12, "seconds": seconds}
            postfix = {}
            if ran == 1 or step % args.log_every == 0 or ran == steps:
                now = time.perf_counter()
                mean = float(loss_sum) / since
                first = mean if first is None else first
                last = mean
                rate = since * tokens_per_step / (now - mark)
                bar.print(f"step {step:5d}  loss {mean:.4f}  {rate:,.0f} tok/s  {rate * flops / 1e12:.3g} TFLOPs  "
                          f"lr {r.lr:.3g}  grad norm {r.grad_norm:.3g}" + (f" (clipped x{r.clip_coef:.3f})"
                                                                             if r.clip_coef < 1 else ""))
                postfix = {"loss": f"{mean:.4f}", "tok/s": f"{rate:,.0f}", "TFLOPs": f"{rate * flops / 1e12:.3g}"}
                loss_sum, since, mark = 0.0, 0, now
            if args.save_every and step % args.save_every == 0 and ran != steps:
                _save(engine, args.save)
            if held is not None and (step % args.eval_every == 0 or ran == steps):
                eval_loss = _call(engine.evaluate, args.model.inputs(*held)).item()
                bar.print(f"step {step:5d}  eval loss {eval_loss:.4f} (held-out batch)")
                if record is not None:
                    record["eval_loss"] = eval_loss
            if metrics is not None:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            bar.update(**postfix)
    except KeyboardInterrupt:
        interrupted = True
        print(f"\ninterrupted after {ran} complete step(s)"
              + ("; the step in flight was rolled back" if in_step else ""), file=sys.stderr)
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
    elapsed = time.perf_counter() - start
    if first is not None:
        rate = ran * tokens_per_step / elapsed
        print(f"done: {ran} steps in {elapsed:.1f} s ({rate:,.0f} tok/s, {rate * flops / 1e12:.3g} TFLOPs); "
              f"loss {first:.4f} -> {last:.4f}")
    s = engine.memory_stats()
    print(f"memory: device peak {_mib(s['device_peak_bytes'])} measured, "
          f"{_mib(s['predicted_device_peak_bytes'])} predicted"
          + (f", budget {_mib(s['device_budget_bytes'])}" if s["device_budget_bytes"] else "")
          + f"; host peak {_mib(s['host_peak_bytes'])}")
    per_step = max(ran, 1)
    print(f"moved: host->device {_mib(s['h2d_bytes'])} ({_mib(s['h2d_bytes'] // per_step)}/step), "
          f"device->host {_mib(s['d2h_bytes'])} ({_mib(s['d2h_bytes'] // per_step)}/step)")
    if args.save:
        _save(engine, args.save)
    return 130 if interrupted else 0


def _rank_part(data, rank: int, world: int):
    """This rank's rows of each batch, as tensors of their own (a view would keep the whole batch alive)."""
    for idx, tgt in data:
        yield (idx, tgt) if world == 1 else (idx.chunk(world)[rank].clone(), tgt.chunk(world)[rank].clone())


def cmd_explain(args, parser) -> int:
    _, engine, _ = _compile(args, parser, TRAIN_SEQ_CAP)
    print(engine.explain())
    if args.code:
        print(engine.graph.code)
    if args.plot:
        try:
            print(f"plot: {engine.plot_memory(args.plot, title=str(args.model))}")
        except ImportError as e:          # matplotlib is an optional extra
            print(f"pstar-fx explain: error: {e}", file=sys.stderr)
            return 1
    return 0


def cmd_plan(args, parser) -> int:
    seq = _seq(args, parser, None)
    if args.coll_bw is not None and args.gpus == 1:
        parser.error("--coll-bw is the bandwidth between ranks: it needs --gpus 2 or more")
    # A plan sizes the model for a GPU box unless told otherwise: cuda and bf16 are the defaults here, and
    # planning for cuda needs no GPU (nothing is allocated).
    config = Config.from_dict({"device": "cuda", "dtype": "bf16", **_config_dict(args)})
    model = args.model.build(meta=True)
    n_params = sum(p.numel() for p in model.parameters())
    per_rank = " per rank" if args.gpus > 1 else ""
    print(f"{args.model}: {n_params:,} parameters; batch {args.batch} x seq {seq}{per_rank}; {config.dtype}; "
          f"device {config.device}; device_memory "
          f"{format_bytes(config.device_memory) if config.device_memory else 'unlimited'}, host_memory "
          f"{format_bytes(config.host_memory) if config.host_memory else 'unlimited'}{per_rank}"
          + (f"; {args.gpus} data-parallel ranks" if args.gpus > 1 else ""))
    try:
        with assumed(**({} if args.coll_bw is None else {"coll_bw": args.coll_bw * 1e9})):
            plan = pstar_fx.plan(model, config, _example_inputs(args, seq), world=args.gpus, rank=0)
    except pstar_fx.BudgetError as e:
        print(f"answer: does not fit: {_one_line(e)}")
        return 1
    except Exception as e:  # planning on meta is young; a failure is an error line, not a traceback
        print(f"pstar-fx plan: error: planning failed: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1
    print(plan.summary())
    print(_job_summary(plan, args, config, n_params, seq))
    print("answer: fits" if plan.fits else "answer: does not fit (the plan above says why)")
    return 0 if plan.fits else 1


def _job_summary(plan, args, config: Config, n_params: int, seq: int) -> str:
    """What the plan means for the whole job: the model state over the ranks, the predicted step's tokens/s
    and TFLOPs (6 * parameters * tokens, the convention of bench/RESULTS.md), and the rates it assumed."""
    gpus = args.gpus
    n_chunks = len(plan.placement)
    lines = []
    if gpus > 1 and plan.world > 1:
        # the k-th chunk each rank owns sits on the same tier on every rank (make_plan): the first n_device
        # of a rank's chunks are on its device, the rest on its host
        owned = {r: len(range(r, n_chunks, gpus)) for r in range(gpus)}
        groups: dict[int, list[int]] = {}
        for r, k in owned.items():
            groups.setdefault(k, []).append(r)
        state_bytes = int(n_chunks * plan.profile.chunk_elems * plan.state_bytes_per_param)
        lines.append(f"data parallel: {gpus} ranks, chunks partitioned (chunk c's state on rank c % {gpus}); the "
                     "plan above is rank 0's, which holds the most")
        lines.append(f"  model state (fp32 masters + Adam moments, {plan.state_bytes_per_param:.3g} B/param): "
                     f"{format_bytes(state_bytes)} in all, {n_chunks} chunks spread over the ranks")
        lines += [f"  rank{'s' if len(rs) > 1 else ''} {_rank_range(rs)}: {k} chunks, {min(k, plan.n_device)} on "
                  f"device, {k - min(k, plan.n_device)} on host: {format_bytes(k * state_bytes // n_chunks)} of state"
                  + (" each" if len(rs) > 1 else "") for k, rs in sorted(groups.items(), reverse=True)]
    elif gpus > 1:
        lines.append(f"data parallel: {gpus} ranks, replicated (Config.data_parallel): every rank holds the whole "
                     "state, as planned above")
    tokens = args.batch * seq * gpus
    step_s = plan.estimated_step_seconds
    if config.grad_accum > 1:
        lines.append("predicted: no step time for grad_accum > 1 (the cost model's estimate covers the compute of "
                     "one micro-batch)")
    elif plan.fits and step_s > 0:
        lines.append(f"predicted: {tokens:,} tokens per step" + (f" ({gpus} x {tokens // gpus:,})" if gpus > 1 else "")
                     + f", {step_s:.3g} s per step (the cost model's estimate), {tokens / step_s:,.0f} tokens/s, "
                     f"{_num(6 * n_params * tokens / step_s / 1e12)} TFLOPs (6 * parameters * tokens)"
                     + (f", {_num(6 * n_params * tokens / step_s / 1e12 / gpus)} per GPU" if gpus > 1 else ""))
    r = plan.rates
    if r is not None:
        kind = "cuda" if config.device.startswith("cuda") else "cpu"
        link = "NCCL within one NVLink host" if kind == "cuda" else "gloo between processes of one host"
        coll = (f"collective bus {_num(r.coll_bw / 1e9)} GB/s ("
                + ("--coll-bw" if args.coll_bw is not None else
                   f"nominal, not measured: {link}; --coll-bw sets it"
                   if r.coll_bw == NOMINAL_COLL_BW[kind] else "measured") + "), ") if plan.world > 1 else ""
        lines.append(f"rates the estimate uses ({r.device}): {coll}host->device {_num(r.h2d_bw / 1e9)} GB/s, device->host "
                     f"{_num(r.d2h_bw / 1e9)} GB/s, matmul {_num(r.flops / 1e12)} TFLOP/s, device memory "
                     f"{_num(r.mem_bw / 1e12)} TB/s, host Adam {_num(r.host_adam_with(plan.optimizer_state) / 1e9)} "
                     f"G params/s" + (f" ({plan.optimizer_state} moments)" if plan.optimizer_state != "fp32" else ""))
    return "\n".join(lines)


def _num(x: float) -> str:
    """Three significant digits, thousands separated: 1,980 and 0.0123 alike."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _rank_range(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _bench_dir() -> Path | None:
    """The repository's bench/ folder, beside the package's folder in a checkout (and so in an editable install);
    None when there is none, as in an installed wheel."""
    bench = Path(pstar_fx.__file__).resolve().parent.parent / "bench"
    return bench if any(bench.glob("test_bench_*.py")) else None


def cmd_bench(args, parser) -> int:
    import glob
    import shlex
    import subprocess
    if args.fail is not None and args.compare is None:
        parser.error("bench --fail PCT needs --compare NAME, the saved run to compare with")
    bench = _bench_dir()
    if bench is None:
        print(f"pstar-fx bench: error: no bench/ folder with test_bench_*.py beside the package "
              f"({Path(pstar_fx.__file__).resolve().parent.parent}): the benchmark cases live in the source "
              "repository; run from a checkout installed with pip install -e .", file=sys.stderr)
        return 2
    try:
        from pytest_benchmark.utils import get_machine_id
    except ImportError:
        print("pstar-fx bench: error: pytest-benchmark is not installed: pip install -e \".[dev]\"", file=sys.stderr)
        return 2
    repo = bench.parent
    storage = Path(args.storage).resolve() if args.storage else repo / ".benchmarks"
    cmd = [sys.executable, "-m", "pytest", str(bench), "--benchmark-only", "-rs",
           "-m", "gpu" if args.gpu else "not gpu", f"--benchmark-storage={storage}"]
    if args.keyword:
        cmd += ["-k", args.keyword]
    if args.save:
        cmd.append(f"--benchmark-save={args.save}")
    if args.compare:
        # pytest-benchmark matches --benchmark-compare against the start of a file name (NNNN_NAME.json), so a
        # name is looked up here: the latest run saved under exactly that name on this machine
        machine_dir = storage / get_machine_id()
        saved = sorted(machine_dir.glob(f"[0-9][0-9][0-9][0-9]_{glob.escape(args.compare)}.json"))
        if not saved:
            names = sorted({p.stem.partition("_")[2] for p in machine_dir.glob("[0-9][0-9][0-9][0-9]_*.json")})
            print(f"pstar-fx bench: error: no run saved as {args.compare!r} in {machine_dir} ("
                  + (f"saved: {', '.join(names)}" if names else "none saved yet")
                  + f"); save one first: pstar-fx bench --save {args.compare}", file=sys.stderr)
            return 2
        cmd.append(f"--benchmark-compare={saved[-1]}")
        if args.fail is not None:
            cmd.append(f"--benchmark-compare-fail=mean:{args.fail}%")
    cmd += args.pytest_args
    print(f"running in {repo}: {shlex.join(cmd)}", flush=True)
    return subprocess.run(cmd, cwd=repo, check=False).returncode


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "explain": cmd_explain, "bench": cmd_bench}


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class _Progress(logging.Handler):
    """The library's progress lines (logger "pstar_fx", INFO) on standard output, as they happen. With `live`
    (stderr is a terminal) a status line on stderr also counts the seconds of the compile phase in flight
    (engine.Phases logs "NAME ..." as a phase starts and "NAME done in ..." as it ends), so that a long
    capture or plan is seen to be alive; logs and CI get the lines alone."""

    def __init__(self, live: bool, stream=None, tick_s: float = 0.5):
        super().__init__()
        self.live, self.stream, self.tick_s = live, stream, tick_s
        self._phase: tuple[str, float] | None = None       # (name, started) of the phase in flight
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm
        with self._lock:
            self._clear()
            tqdm.write(f"  [{record.relativeCreated / 1e3:7.1f} s] {record.getMessage()}", file=sys.stdout)
            sys.stdout.flush()
            if not self.live or not isinstance(record.msg, str):
                return
            if record.msg.endswith(" ...") and record.args:
                self._phase = (str(record.args[0]), time.perf_counter())
                self._show()
                if self._ticker is None:
                    self._ticker = threading.Thread(target=self._tick, daemon=True, name="pstar-fx progress")
                    self._ticker.start()
            elif record.msg.startswith("%s done in"):
                self._phase = None

    def _out(self):
        return self.stream or sys.stderr

    def _show(self) -> None:
        if self._phase is not None:
            name, t0 = self._phase
            self._out().write(f"\r  {name} ... {time.perf_counter() - t0:.0f} s")
            self._out().flush()

    def _clear(self) -> None:
        if self.live and self._phase is not None:
            self._out().write("\r\033[K")

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            with self._lock:
                self._show()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._clear()
            self._phase = None
        super().close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logger = logging.getLogger("pstar_fx")
    for h in [h for h in logger.handlers if isinstance(h, _Progress)]:    # main() called again in one process
        logger.removeHandler(h)
        h.close()
    progress = _Progress(live=getattr(args, "progress", "auto") != "lines" and sys.stderr.isatty())
    logger.addHandler(progress)
    logger.setLevel(logging.INFO)
    try:
        return COMMANDS[args.command](args, parser)
    except (ValueError, TypeError, MemoryError, OSError, pstar_fx.CaptureError) as e:
        progress.close()
        print(f"pstar-fx {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    finally:
        progress.close()
        logger.removeHandler(progress)
