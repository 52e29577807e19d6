"""cli: `pstar-fx train | plan | explain`, thin wrappers over `pstar_fx.compile` and `pstar_fx.plan`.

    train    build a model, compile its step, train it on the stdlib's bytes (pstar_fx.data)
    plan     size a model built on the meta device against budgets: fits or not, and why; allocates nothing
    explain  compile like train, print engine.explain() (and engine.graph.code with --code)

Without a GPU the CPU plays the device tier. train and explain then pick a device budget that the whole
step would overflow, so that most chunks' fp32 state lives on the host and chunks really move each step.
Exit codes: 0 done (for plan also "does not fit"), 1 a clear error on one line of stderr, 2 bad arguments,
130 interrupted (train saves first when --save is given).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

import pstar_fx
from pstar_fx.config import Config, format_bytes, parse_bytes
from pstar_fx.data import batches, stdlib_tokens
from pstar_fx.plan import MASTER_STATE_BYTES
from pstar_fx.models import GPT_CONFIGS, LLAMA_CONFIGS, GPT, Llama

STEPS_ENV = "PSTAR_FX_TRAIN_STEPS"   # default for `train --steps`; CI sets it to keep the README's run short
DEFAULT_STEPS = 200
DEFAULT_BATCH = 8
TRAIN_SEQ_CAP = 128                  # train/explain default --seq: the model's block_size, at most this
MiB = 2**20


# ---- argument types: a bad value is an argparse error that says what is wanted ---------------------------

@dataclass(frozen=True)
class ModelSpec:
    family: str        # "gpt" | "llama"
    name: str
    config: object     # GPTConfig | LlamaConfig

    def build(self) -> nn.Module:
        return (Llama if self.family == "llama" else GPT)(self.config)

    def __str__(self) -> str:
        return f"{'LLaMA' if self.family == 'llama' else 'GPT'} {self.name!r}"


def _model(text: str) -> ModelSpec:
    family, _, name = text.rpartition(":")
    family = family or "gpt"
    tables = {"gpt": GPT_CONFIGS, "llama": LLAMA_CONFIGS}
    if family not in tables:
        raise argparse.ArgumentTypeError(f"{text!r}: use NAME (a GPT) or llama:NAME")
    table = tables[family]
    if name not in table:
        raise argparse.ArgumentTypeError(f"unknown {family} model {name!r}; choose from: {', '.join(table)}"
                                         + ("" if family == "llama" else " (or llama:NAME)"))
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
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,plan,explain}")

    def common(p: argparse.ArgumentParser, model_default: str | None) -> None:
        p.add_argument("--model", type=_model, default=model_default, required=model_default is None,
                       help="a GPT from pstar_fx.models.GPT_CONFIGS (tiny, small, GPT3_10B, ...) or llama:NAME"
                            + (f" (default {model_default})" if model_default else ""))
        p.add_argument("--batch", type=_positive_int, default=DEFAULT_BATCH, help=f"default {DEFAULT_BATCH}")
        p.add_argument("--device", type=_device, help="auto (default), cpu, cuda, cuda:N")
        p.add_argument("--device-memory", type=_bytes, metavar="SIZE", help="device tier budget, e.g. 64MiB, 80GB")
        p.add_argument("--host-memory", type=_bytes, metavar="SIZE", help="host tier budget (default unlimited)")
        p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="compute dtype (default fp32)")
        p.add_argument("--chunk-size", type=_chunk_size, metavar="ELEMS", help="elements per chunk, or auto")
        p.add_argument("--config", metavar="FILE.json", help="a pstar_fx.Config as JSON; flags override it")

    train = sub.add_parser("train", help="train a model on the Python stdlib's bytes",
                           description="Compile a model's training step and train it on byte tokens read from "
                                       "the Python standard library's source.")
    common(train, "small")
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
    train.add_argument("--eval-every", type=_positive_int, metavar="N", help="every N steps, the loss of a held-out "
                       "batch (the data's last 5%%, kept out of training), forward only (engine.evaluate)")

    plan = sub.add_parser("plan", help="does a model fit? (built on the meta device, nothing allocated)",
                          description="Plan a model built on the meta device against device and host budgets "
                                      "(default --device cuda --dtype bf16: sizing for a GPU box).")
    common(plan, None)
    plan.add_argument("--seq", type=_positive_int, help="sequence length (default the model's block_size)")

    explain = sub.add_parser("explain", help="compile like train and print the plan and schedule")
    common(explain, "small")
    explain.add_argument("--seq", type=_positive_int,
                         help=f"sequence length (default the model's block_size, at most {TRAIN_SEQ_CAP})")
    explain.add_argument("--seed", type=int, default=0, help="seed for the weights (default 0)")
    explain.add_argument("--code", action="store_true", help="also print engine.graph.code")
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
    block = args.model.config.block_size
    if args.seq is None:
        return block if cap is None else min(block, cap)
    if args.seq > block:
        parser.error(f"--seq {args.seq} is longer than {args.model}'s block_size {block}")
    return args.seq


def _example_inputs(args, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros((args.batch, seq), dtype=torch.long)
    return x, x.clone()


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
    slot_bytes = chunk_state // MASTER_STATE_BYTES * Config.from_dict(d).torch_dtype.itemsize
    base = whole.device_peak_bytes - state - whole.device_breakdown["compute slots"]
    budgets = [base + keep * chunk_state + slots * slot_bytes for keep, slots in ((n_chunks // 4, 4),
                                                                                  (n_chunks // 2, 8))]
    return whole.device_peak_bytes, [b for b in budgets if b < whole.device_peak_bytes] + [whole.device_peak_bytes]


def _compile(args, parser, cap: int | None):
    """Model, Engine and sequence length for train/explain; prints the device budget it chose, if it chose one."""
    seq = _seq(args, parser, cap)
    if args.model.config.vocab_size < 256:
        parser.error(f"{args.model} has vocab_size {args.model.config.vocab_size}; byte tokens need 256")
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


def cmd_train(args, parser) -> int:
    steps = args.steps if args.steps is not None else _default_steps()
    if args.save_every and not args.save:
        parser.error("--save-every needs --save DIR")
    model, engine, seq = _compile(args, parser, TRAIN_SEQ_CAP)
    if args.resume:
        engine.load(args.resume)
        print(f"resumed: {args.resume} at update {engine.steps}")
    print(engine.explain())
    tokens = stdlib_tokens()
    print(f"data: {tokens.numel():,} bytes of Python stdlib source (vocab 256); {steps} steps")
    k = engine.config.grad_accum
    held_out = None
    if args.eval_every:
        cut = tokens.numel() * 19 // 20
        held_out = next(batches(tokens[cut:], args.batch, seq, seed=args.seed + 1))
        tokens = tokens[:cut]
    data = batches(tokens, args.batch * k, seq, seed=args.seed)     # a step takes grad_accum micro-batches
    for _ in range(engine.steps):                                   # resumed: the batches those updates saw
        next(data)
    tokens_per_step = args.batch * k * seq
    first = last = None
    in_step = interrupted = False
    start = mark = time.perf_counter()
    loss_sum, since = 0.0, 0
    ran = 0
    try:
        for step in range(1, steps + 1):
            idx, tgt = next(data)
            in_step = True
            loss = engine.step(idx, tgt)
            in_step = False
            ran = step
            loss_sum, since = loss_sum + loss, since + 1    # a tensor sum: no device sync until printed
            if step == 1 or step % args.log_every == 0 or step == steps:
                now = time.perf_counter()
                mean = float(loss_sum) / since
                first = mean if first is None else first
                last = mean
                r = engine.last_step
                print(f"step {step:5d}  loss {mean:.4f}  {since * tokens_per_step / (now - mark):,.0f} tok/s  "
                      f"lr {r.lr:.3g}  grad norm {r.grad_norm:.3g}" + (f" (clipped x{r.clip_coef:.3f})"
                                                                         if r.clip_coef < 1 else ""), flush=True)
                loss_sum, since, mark = 0.0, 0, now
            if args.save_every and step % args.save_every == 0 and step != steps:
                _save(engine, args.save)
            if held_out is not None and (step % args.eval_every == 0 or step == steps):
                print(f"step {step:5d}  eval loss {engine.evaluate(*held_out).item():.4f} (held-out batch)",
                      flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print(f"\ninterrupted after {ran} complete step(s)"
              + ("; the step in flight was rolled back" if in_step else ""), file=sys.stderr)
    elapsed = time.perf_counter() - start
    if first is not None:
        print(f"done: {ran} steps in {elapsed:.1f} s "
              f"({ran * tokens_per_step / elapsed:,.0f} tok/s); loss {first:.4f} -> {last:.4f}")
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


def cmd_explain(args, parser) -> int:
    _, engine, _ = _compile(args, parser, TRAIN_SEQ_CAP)
    print(engine.explain())
    if args.code:
        print(engine.graph.code)
    return 0


def cmd_plan(args, parser) -> int:
    seq = _seq(args, parser, None)
    # A plan sizes the model for a GPU box unless told otherwise: cuda and bf16 are the defaults here, and
    # planning for cuda needs no GPU (nothing is allocated).
    config = Config.from_dict({"device": "cuda", "dtype": "bf16", **_config_dict(args)})
    with torch.device("meta"):
        model = args.model.build()
    n_params = args.model.config.num_params()
    print(f"{args.model}: {n_params:,} parameters; batch {args.batch} x seq {seq}; {config.dtype}; "
          f"device {config.device}; device_memory "
          f"{format_bytes(config.device_memory) if config.device_memory else 'unlimited'}, host_memory "
          f"{format_bytes(config.host_memory) if config.host_memory else 'unlimited'}")
    try:
        plan = pstar_fx.plan(model, config, _example_inputs(args, seq))
    except pstar_fx.BudgetError as e:
        print(f"answer: does not fit: {_one_line(e)}")
        return 0
    except Exception as e:  # planning on meta is young; a failure is an error line, not a traceback
        print(f"pstar-fx plan: error: planning failed: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1
    print(plan.summary())
    print("answer: fits" if plan.fits else "answer: does not fit (the plan above says why)")
    return 0


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "explain": cmd_explain}


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class _Progress(logging.Handler):
    """The library's progress lines (logger "pstar_fx", INFO) on standard output, as they happen."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"  [{record.relativeCreated / 1e3:7.1f} s] {record.getMessage()}", file=sys.stdout, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logger = logging.getLogger("pstar_fx")
    if not any(isinstance(h, _Progress) for h in logger.handlers):
        logger.addHandler(_Progress())
    logger.setLevel(logging.INFO)
    try:
        return COMMANDS[args.command](args, parser)
    except (ValueError, TypeError, MemoryError, OSError, pstar_fx.CaptureError) as e:
        print(f"pstar-fx {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
