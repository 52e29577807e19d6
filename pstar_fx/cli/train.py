"""train: `pstar-fx train` — build a model, compile its step, train it on the stdlib's bytes or on --data."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

import pstar_fx
from pstar_fx.config import Config, format_bytes
from pstar_fx.data import (TEXT_SUFFIXES, TOKEN_DTYPES, TOKEN_SUFFIXES, batches, check_vocab, held_out,
                           load_tokenizer, read_tokens, vocab_size)
from pstar_fx.cli import demo_budget
from pstar_fx.records import (IGNORE_INDEX, encode_records, eval_batches, held_out_records, is_records, pack_rows,
                              pad_id, pad_rows, read_records, row_batches)
from pstar_fx.runtime.dist import world_from_env

from .adapt import adapt, add_flags
from .args import (DEFAULT_STEPS, STEPS_ENV, TRAIN_SEQ_CAP, call, check_cuda, common, config_dict, config_flag,
                   default_steps, example_inputs, positive_float, positive_int, seq_buckets, seq_len)
from .progress import Bar
from .report import Reporters, report_to

MiB = 2**20


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="train a model on the Python stdlib's bytes or on your --data",
                           description="Compile a model's training step and train it on --data (a text file, a "
                                       "folder of text files, a token file or JSONL instruction / chat records), "
                                       "or without it on the bytes of the Python standard library's source.")
    common(train, "small")
    train.add_argument("--data", metavar="PATH",
                       help="a text file; a folder of text files (" + ", ".join("*" + x for x in TEXT_SUFFIXES)
                            + ", recursively, in sorted path order); or a token file *.bin or *.dat of raw "
                            "token ids as nanoGPT writes them, memory-mapped; or FILE.jsonl of instruction or chat "
                            "records ({\"prompt\", \"completion\"} or {\"messages\": [...]}), trained on the "
                            "completions / assistant turns only (default: the Python stdlib's source)")
    train.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                       help="JSONL records: several whole records to a row of --seq tokens (default), or with "
                            "--no-pack one record a row, padded")
    train.add_argument("--data-dtype", choices=list(TOKEN_DTYPES),
                       help="a *.bin / *.dat file's token type (default uint16, or uint32 when the model's vocabulary "
                            "exceeds 65536)")
    train.add_argument("--tokenizer", metavar="DIR",
                       help="a local Hugging Face tokenizer directory for text data, or 'bytes' (vocabulary 256); "
                            "default: an hf:DIR model's own tokenizer if it has one, else bytes")
    train.add_argument("--seq", type=positive_int,
                       help=f"sequence length (default the model's block_size, at most {TRAIN_SEQ_CAP})")
    train.add_argument("--seq-buckets", type=seq_buckets, metavar="L1,L2,...",
                       help="train at several sequence lengths on one chunk memory (Config.seq_buckets): the step is "
                            "compiled at the largest and each step's windows take the lengths in turn")
    train.add_argument("--steps", type=positive_int, default=None,
                       help=f"training steps (default {DEFAULT_STEPS}, or ${STEPS_ENV})")
    train.add_argument("--lr", type=positive_float, help="learning rate (default 1e-3)")
    add_flags(train)
    config_flag(train, "grad_clip", "(default none)", metavar="NORM")
    config_flag(train, "grad_accum", "Each of --batch rows (default 1).", metavar="K")
    train.add_argument("--warmup", type=int, metavar="STEPS", help="linear warm-up, then cosine decay to 0 over "
                       "--steps (Config.lr_schedule; --config takes any schedule)")
    config_flag(train, "seed", "Here it also seeds the model's own weights and the batches (default 0).",
                default=0)
    train.add_argument("--log-every", type=positive_int, default=10, metavar="N", help="default 10")
    train.add_argument("--save", metavar="DIR", help="a checkpoint directory (engine.save) written at the end, also "
                       "when interrupted, and every --save-every steps; a path ending in .pt gets "
                       "torch.save(engine.state_dict()) instead")
    train.add_argument("--save-every", type=positive_int, metavar="N", help="also save every N steps")
    train.add_argument("--resume", metavar="DIR", help="start from this checkpoint (or folder of safetensors weights)")
    train.add_argument("--nproc", type=positive_int, default=1, metavar="N",
                       help="data-parallel ranks on this machine (runs torchrun; --batch is per rank; default 1)")
    train.add_argument("--eval-every", type=positive_int, metavar="N", help="every N steps, the loss of a held-out "
                       "batch (the data's last 5%%, kept out of training; of JSONL data, the last 5%% of the "
                       "records, all of them evaluated), forward only (engine.evaluate); the same batch and the "
                       "same mean whatever --nproc")
    train.add_argument("--metrics", metavar="FILE.jsonl", help="append one JSON object per step (step, loss, lr, "
                       "grad_norm, clip_coef, skipped, tokens_per_s, tflops, seconds, device_peak_bytes, "
                       "host_peak_bytes (engine.memory_stats' peaks so far); eval_loss when evaluated), "
                       "flushed as it is written; loss is the step's own (the printed lines show the mean "
                       "over --log-every steps); written by rank 0 only")
    train.add_argument("--report-to", type=report_to, default=(), metavar="NAMES",
                       help="also send each step's --metrics record, under the same keys, to tensorboard, wandb "
                            "(comma-separated: tensorboard,wandb) or none (default); rank 0 only; pip install "
                            "'pstar_fx[loggers]'. wandb runs offline with WANDB_MODE=offline")
    train.add_argument("--log-dir", metavar="DIR", help="where --report-to writes: TensorBoard's event files in DIR "
                       "(default runs/<date>_<host>), the wandb run in DIR/wandb (default $WANDB_DIR or ./wandb)")
    train.add_argument("--progress", choices=["auto", "bar", "lines"], default="auto",
                       help="auto (default): a progress bar on stderr when it is a terminal, else lines only; "
                            "the step lines on stdout are printed either way")


def flops_per_token(n_params: int, n_layer: int, n_embd: int, seq: int) -> int:
    """Training FLOPs per token of a causal LM, PaLM's count (Chowdhery et al. 2022, appendix B): 6 per parameter
    (forward 2, backward 4; the embedding's parameters included) plus 12 * layers * width * seq for the attention
    scores and their weighted sum over the whole (unmasked) seq x seq matrix. Recompute is not counted: these
    are the model's FLOPs, not the hardware's."""
    return 6 * n_params + 12 * n_layer * n_embd * seq

def compile_model(args, parser, cap: int | None, inputs=None):
    """Model, Engine and sequence length for train/explain (compiled for `inputs`, or a batch of zeros);
    prints the device budget it chose, if it chose one."""
    seq = seq_len(args, parser, cap)
    config = Config.from_dict(config_dict(args))
    check_cuda(config)
    torch.manual_seed(args.seed)
    model = adapt(args.model.build(), args)      # --lora, --freeze: what is trained
    inputs = example_inputs(args, seq) if inputs is None else inputs
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {n_params:,} parameters; batch {args.batch} x seq {seq}; {config.dtype}; "
          f"device {config.device}")
    if not demo_budget.applies(config):
        return model, pstar_fx.compile(model, config, inputs), seq
    chosen = demo_budget.compile_in_demo_budget(model, config, inputs)
    n_host, n_chunks = chosen.engine.plan.placement.count("host"), len(chosen.engine.plan.placement)
    print(f"device memory: {format_bytes(chosen.budget_bytes)}, chosen for you: the whole step on the device would "
          f"need {format_bytes(chosen.whole_step_bytes)}; "
          + (f"in this budget {n_chunks - n_host} of {n_chunks} chunks' fp32 state fit on the device and "
             f"{n_host} live on the host, so chunks move every step" if n_host else
             "no smaller budget fit, so nothing moves")
          + " (--device-memory sets the budget)")
    return model, chosen.engine, seq


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"



def _save(engine, path: str) -> None:
    if path.endswith((".pt", ".pth")):
        torch.save(engine.state_dict(), path)
        print(f"saved: {path} (state_dict after {engine.steps} update(s); load with "
              "model.load_state_dict(torch.load(path), strict=False))", flush=True)
    else:
        engine.save(path)
        print(f"saved: {path} (checkpoint after {engine.steps} update(s); --resume {path} goes on from it)",
              flush=True)


def _tokenizer(args, is_ids: bool = False):
    """(tokenizer or None for bytes, its directory), checked against the model's vocabulary."""
    model_vocab = args.model.vocab_size
    tok_dir = args.tokenizer if args.tokenizer is not None else args.model.tokenizer_dir
    if tok_dir == "bytes" or is_ids and args.tokenizer is None:
        tok_dir = None                        # a token file holds ids already; an hf:DIR tokenizer does not apply
    tokenizer = load_tokenizer(tok_dir) if tok_dir else None
    vocab = vocab_size(tokenizer)
    if not is_ids and vocab > model_vocab:
        raise ValueError(f"{'tokenizer ' + tok_dir if tokenizer else 'byte data'} has a vocabulary of {vocab}, "
                         f"but {args.model} has vocab_size {model_vocab}; use a model with at least {vocab} "
                         "(or a smaller tokenizer)")
    return tokenizer, tok_dir


def _train_data(args, lengths: tuple[int, ...], world: int, k: int):
    """(example inputs of one micro-batch, endless whole batches of all ranks for each of `lengths` (the sequence
    lengths steps take in turn; the last is the longest), held-out batches or None), checked before anything
    compiles: records of a JSONL file, else tokens. A held-out batch holds --batch rows for each rank, so every
    --nproc sees the same held-out rows."""
    rows_per_step = args.batch * k * world
    seq = max(lengths)
    if is_records(args.data):
        if len(lengths) > 1:
            raise ValueError("--seq-buckets applies to token data: JSONL records are packed or padded into rows of "
                             "--seq tokens")
        rows, held_rows, pad = _train_records(args, seq)
        whole = [(args.model.row_inputs(b) for b in row_batches(rows, rows_per_step, seed=args.seed))]
        held = None if held_rows is None else [args.model.row_inputs(b)
                                               for b in eval_batches(held_rows, args.batch * world, pad)]
        first = next(row_batches(rows, rows_per_step, seed=args.seed))
        example = args.model.row_inputs(first)
    else:
        if args.pack is not None:
            raise ValueError("--pack / --no-pack apply to JSONL records (--data FILE.jsonl) only")
        tokens, rest = _train_tokens(args, seq)
        whole = [(args.model.inputs(idx, tgt) for idx, tgt in batches(tokens, rows_per_step, n, seed=args.seed + j))
                 for j, n in enumerate(lengths)]
        held = None if rest is None else [args.model.inputs(*next(batches(rest, args.batch * world, seq,
                                                                          seed=args.seed + 1)))]
        example = None                        # compile_model's batch of zeros
    if example is not None:
        example = _micro(_rank_inputs(example, 0, world), k)
    return example, whole, held


def _train_records(args, seq: int):
    """(training rows, held-out rows or None, the pad id) of a JSONL file of records; prints what they are."""
    if (args.tokenizer or args.model.tokenizer_dir or "bytes") == "bytes":
        raise ValueError(f"data {args.data}: JSONL records need a tokenizer (--tokenizer DIR, or an hf:DIR model "
                         "with its own tokenizer files)")
    tokenizer, tok_dir = _tokenizer(args)
    records, problems = read_records(args.data)
    examples, problems = encode_records(records, tokenizer, seq, problems)
    if not examples:
        raise ValueError(f"data {args.data}: no usable record ({problems.summary()})")
    pack = args.pack is not False
    held = []
    if args.eval_every:
        examples, held = held_out_records(examples)
    pad = pad_id(tokenizer)
    make = pack_rows if pack else pad_rows
    rows = make(examples, seq, pad)
    held_rows = make(held, seq, pad) if held else None
    print(f"data: {len(examples) + len(held):,} records of {args.data} (tokenizer {tok_dir}, vocab "
          f"{vocab_size(tokenizer):,})" + (f"; {problems.summary()}" if problems.total() else ""))
    print(f"rows: {len(rows):,} {'packed' if pack else 'padded'} rows of {seq} tokens ({rows.tokens:,} tokens of "
          f"{len(examples):,} records, {rows.trained:,} trained)"
          + (f"; held out: {len(held):,} records in {len(held_rows):,} row(s)" if held else ""))
    return rows, held_rows, pad


def _train_tokens(args, seq: int):
    """The training tokens and, with --eval-every, the held-out tokens, checked against the model's vocabulary
    before anything compiles; prints what they are."""
    model_vocab = args.model.vocab_size
    is_ids = args.data is not None and Path(args.data).suffix in TOKEN_SUFFIXES and not Path(args.data).is_dir()
    tokenizer, tok_dir = _tokenizer(args, is_ids)
    vocab = vocab_size(tokenizer)
    dtype = args.data_dtype or ("uint16" if model_vocab <= 2**16 else "uint32")
    tokens = read_tokens(args.data, tokenizer, dtype)
    source = args.data or "Python stdlib source"
    check_vocab(tokens, model_vocab, f"data {source}")
    unit = (f"{dtype} ids" if is_ids else f"tokenizer {tok_dir}, vocab {vocab:,}" if tokenizer
            else "bytes, vocab 256")
    print(f"data: {len(tokens):,} tokens ({unit}) of {source}" + (", memory-mapped" if is_ids else ""))
    rest = None
    if args.eval_every:
        tokens, rest = held_out(tokens)
        if len(rest) < seq + 1:
            raise ValueError(f"data {source}: the held-out last 5% is {len(rest):,} tokens, fewer than one window "
                             f"of --seq {seq} + 1; give more data or a shorter --seq (or no --eval-every)")
    if len(tokens) < seq + 1:
        raise ValueError(f"data {source}: {len(tokens):,} training tokens, fewer than one window of --seq {seq} + 1; "
                         "give more data or a shorter --seq")
    return tokens, rest


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

def run(args, parser) -> int:
    steps = args.steps if args.steps is not None else default_steps()
    if args.save_every and not args.save:
        parser.error("--save-every needs --save DIR")
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _torchrun(args)
    rank, world, _ = world_from_env()
    if rank:                                   # one rank reports: the others' lines would repeat its own
        sys.stdout = open(os.devnull, "w")
        logging.getLogger("pstar_fx").setLevel(logging.WARNING)
    config = Config.from_dict(config_dict(args))
    k = config.grad_accum
    top = seq_len(args, parser, TRAIN_SEQ_CAP)
    lengths = tuple(config.seq_buckets) if config.seq_buckets else (top,)   # each step's windows take them in turn
    # bad data fails before compiling
    example, whole_batches, held = _train_data(args, lengths, world, k)
    model, engine, seq = compile_model(args, parser, TRAIN_SEQ_CAP, example)
    if args.resume:
        engine.load(args.resume)
        print(f"resumed: {args.resume} at update {engine.steps}")
    print(engine.explain())
    n_layer, n_embd = args.model.shape
    n_params = sum(p.numel() for p in model.parameters())
    flops = flops_per_token(n_params, n_layer, n_embd, seq)
    print(f"training: {steps} steps of {args.batch * k * seq * world:,} tokens"
          + (f" ({world} ranks of {args.batch * k * seq:,})" if world > 1 else "")
          + (f" at length {seq}, fewer at lengths {', '.join(map(str, lengths[:-1]))} in turn" if len(lengths) > 1
             else "")
          + f"; {flops:,} FLOPs per token (6 * parameters + 12 * layers * width * seq)")
    # a step takes grad_accum micro-batches on each rank; every rank draws the whole batch and keeps its part
    streams = [(_rank_inputs(whole, rank, world) for whole in stream) for stream in whole_batches]
    first_step = engine.steps
    for step in range(1, first_step + 1):                           # resumed: the batches those updates saw
        next(streams[(step - 1) % len(lengths)])
    # one rank reports and writes the file
    reporters = None if not args.report_to or rank else Reporters(
        args.report_to, args.log_dir, {"model": str(args.model), "steps": steps, "batch": args.batch, "seq": seq,
                                       **config_dict(args)})
    metrics = open(args.metrics, "a") if args.metrics and rank == 0 else None
    bar = Bar(args.progress if rank == 0 else "lines", first_step + steps, first_step)   # one bar, rank 0's
    first = last = None
    in_step = interrupted = False
    start = mark = time.perf_counter()
    loss_sum, since = 0.0, 0
    tokens_since = flops_since = tokens_done = flops_done = 0     # (steps of several lengths: summed, not counted)
    ran = 0
    try:
        for step in range(first_step + 1, first_step + steps + 1):   # numbered on from a resumed checkpoint
            length = lengths[(step - 1) % len(lengths)]
            inputs = next(streams[(step - 1) % len(lengths)])
            tokens_per_step = args.batch * k * length * world
            flops = flops_per_token(n_params, n_layer, n_embd, length)
            in_step = True
            t0 = time.perf_counter()
            loss = call(engine.step, inputs)
            seconds = time.perf_counter() - t0
            in_step = False
            ran += 1
            loss_sum, since = loss_sum + loss, since + 1    # a tensor sum: no device sync until printed
            tokens_since, flops_since = tokens_since + tokens_per_step, flops_since + tokens_per_step * flops
            tokens_done, flops_done = tokens_done + tokens_per_step, flops_done + tokens_per_step * flops
            r = engine.last_step
            record = None if metrics is None and reporters is None else {
                "step": step, "loss": float(loss), "lr": r.lr, "grad_norm": r.grad_norm, "clip_coef": r.clip_coef,
                "skipped": r.skipped, "tokens_per_s": tokens_per_step / seconds,
                "tflops": tokens_per_step * flops / seconds / 1e12, "seconds": seconds,
                **{k: v for k, v in engine.memory_stats().items() if k in ("device_peak_bytes", "host_peak_bytes")}}
            postfix = {}
            if ran == 1 or step % args.log_every == 0 or ran == steps:
                now = time.perf_counter()
                mean = float(loss_sum) / since
                # the printed loss is the mean over the steps since the last line (the metrics file has each
                # step's own), and says so: a window mean and a step's loss differ by the step-to-step noise
                window = f" (mean of steps {step - since + 1}-{step})" if since > 1 else ""
                first = (mean, window or f" (step {step})") if first is None else first
                last = (mean, window or f" (step {step})")
                rate, flop_rate = tokens_since / (now - mark), flops_since / (now - mark)
                bar.print(f"step {step:5d}  loss {mean:.4f}{window}  {rate:,.0f} tok/s  {flop_rate / 1e12:.3g} TFLOPs  "
                          f"lr {r.lr:.3g}  grad norm {r.grad_norm:.3g}" + (f" (clipped x{r.clip_coef:.3f})"
                                                                             if r.clip_coef < 1 else ""))
                postfix = {"loss": f"{mean:.4f}", "tok/s": f"{rate:,.0f}", "TFLOPs": f"{flop_rate / 1e12:.3g}"}
                loss_sum, since, tokens_since, flops_since, mark = 0.0, 0, 0, 0, now
            if args.save_every and step % args.save_every == 0 and ran != steps:
                _save(engine, args.save)
            if held is not None and (step % args.eval_every == 0 or ran == steps):
                eval_loss = _evaluate(engine, held, rank, world)
                bar.print(f"step {step:5d}  eval loss {eval_loss:.4f} (held-out {_held_words(held)})")
                if record is not None:
                    record["eval_loss"] = eval_loss
            if metrics is not None:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if reporters is not None:
                reporters.log(record)
            bar.update(**postfix)
    except KeyboardInterrupt:
        interrupted = True
        print(f"\ninterrupted after {ran} complete step(s)"
              + ("; the step in flight was rolled back" if in_step else ""), file=sys.stderr)
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
        if reporters is not None:
            reporters.close()
    elapsed = time.perf_counter() - start
    if first is not None:
        rate = tokens_done / elapsed
        print(f"done: {ran} steps in {elapsed:.1f} s ({rate:,.0f} tok/s, {flops_done / elapsed / 1e12:.3g} TFLOPs); "
              f"loss {first[0]:.4f}{first[1]} -> {last[0]:.4f}{last[1]}")
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


def _rank_inputs(inputs, rank: int, world: int):
    """This rank's rows of a batch (a tuple or a dict of tensors), as tensors of their own (a view would keep the
    whole batch alive)."""
    if world == 1:
        return inputs
    if isinstance(inputs, dict):
        return {key: x.chunk(world)[rank].clone() for key, x in inputs.items()}
    return tuple(x.chunk(world)[rank].clone() for x in inputs)


def _micro(inputs, k: int):
    """The first of a rank's k micro-batches: the shape the step is compiled for."""
    if isinstance(inputs, dict):
        return {key: x[: x.shape[0] // k] for key, x in inputs.items()}
    return tuple(x[: x.shape[0] // k] for x in inputs)


def _trained_tokens(inputs) -> int:
    """The tokens a batch's loss is the mean over: a Hugging Face model's labels after its shift, or our models'
    targets, not -100."""
    if isinstance(inputs, dict):
        return int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())
    return int((inputs[1] != IGNORE_INDEX).sum())


def _held_words(held: list) -> str:
    return "batch" if len(held) == 1 else f"batches: {len(held)}"


def _evaluate(engine, held: list, rank: int, world: int) -> float:
    """The mean loss over every trained token of the held-out batches, whatever the number of ranks: each rank
    evaluates its rows of each batch, and the losses (each a mean over its own tokens) are weighted by their
    token counts and summed over batches and ranks."""
    total = torch.zeros(2, dtype=torch.float64)            # (sum of loss x tokens, tokens)
    for whole in held:
        part = _rank_inputs(whole, rank, world)
        n = _trained_tokens(part)
        loss = float(call(engine.evaluate, part))             # every rank evaluates: collective when chunked
        if n:                                                 # rows of padding only: no tokens, a loss of 0/0
            total += torch.tensor([loss * n, n], dtype=torch.float64)
    if world > 1:
        import torch.distributed as dist
        on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        summed = total.to(on)
        dist.all_reduce(summed)
        total = summed.cpu()
    return float(total[0] / total[1])

