"""Train the GPT from pstar_fx.models with random tokens and print one line: RESULT {json}
(torch-best: one per configuration, then the best).

    python bench/gpt.py --model NAME --system {pstar_fx,torch,torch-best,deepspeed} --batch B --seq S --steps K [--json FILE]

--model NAME: our GPT (pstar_fx.models.gpt_config); llama:NAME our LLaMA (llama_config); hf-llama:NAME the
same shape as Hugging Face's LlamaForCausalLM, unmodified (pstar_fx only), stepped with a dict batch.
        [--grad-clip X] [--grad-accum K] [--lr-schedule cosine:WARMUP:TOTAL[:MIN_LR]] [--transaction T]
        [--expected-trigger-rate R] [--clip-sweep X[@RATE[@nolate][@undo][@split]],...]

pstar_fx   the model built on the meta device, compiled with dtype bf16 on one GPU; the planner decides
           placement and recompute.
torch      the same model all on the GPU: bf16 autocast, fused AdamW, activation checkpointing of the blocks
           `--checkpoint` names (all, half or none), the model's forward torch.compile'd with `--compile`.
torch-best the strongest PyTorch peer: `--system torch` once per {eager, --compile} x {none, half, all}, each in
           a fresh subprocess with its own time limit (an OOM cannot poison the next), then a table, one
           RESULT line per configuration and a "best" line: the fastest that fits.
deepspeed  ZeRO-3 with parameters and optimizer offloaded to pinned CPU memory (when importable; the box
           lacks it: `bash bench/peer_wheels.sh` builds the wheels to carry).

The training recipe is the same for every system: `--grad-clip` (global-norm clipping, torch's
clip_grad_norm_), `--grad-accum K` (K micro-batches of `--batch` per update), `--lr-schedule` (warm-up then
cosine or linear decay, Hugging Face's formulas; torch: LambdaLR). `--clip-sweep 1e9,1e-3` (pstar_fx) then
runs `--steps` more steps on the same compiled engine at each clip threshold — one that never triggers and
one that always does — and reports each phase's step time and breakdown under "sweep"; a point's @RATE fixes
the expected trigger rate its steps run at (0 speculate, 1 defer where the plan may), @nolate turns late binding off,
@undo corrects by undo-then-redo (the kernel before the one-pass rescale), @split writes host chunks' 16-bit copies
first after the verdict (`HostWorker.COPIES_FIRST`). `--expected-trigger-rate` makes the plan for a rate.

Steps run back to back, as a training loop runs them: each step's time runs from the last step's end to its own
(its loss read as a number, the loop's only wait for the device); the device is synchronized only before the first
and after the last step (window_s: the whole run, to the device idle after it).

Fields: params, tokens, step_s (median of the steps after the first two), tflops (6 * params * tokens /
step_s), steps_s, window_s, gc_s (each step's seconds in Python's garbage collections, by generation),
gpu_peak_bytes (torch.cuda.max_memory_allocated), host_rss_bytes (largest RSS seen
after a step), host_max_rss_bytes (the process's peak RSS, compile included), host_anon_huge_bytes (its memory in
transparent huge pages at the end), and for pstar_fx the plan's
predicted GPU and host peaks, a per-phase breakdown, compile_phases_s (seconds per compile phase) and
time_to_first_step_s (compile() plus the first step); for torch, checkpoint (none|half|all),
checkpointed_blocks, compile (bool) and compile_s (with --compile: the first two steps' time above step_s,
i.e. dynamo + inductor for forward and backward). A model that does not fit prints a RESULT with "error"
(and "fits": false when it ran out of memory, "oom_tried_bytes" the allocation that failed) instead of a
traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import gc
import json
import logging
import math
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback

import psutil
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # bench/trace_summary.py
import pstar_fx  # noqa: E402
import trace_summary  # noqa: E402
import copy_waits  # noqa: E402
from pinned_alloc import anon_huge_bytes  # noqa: E402
from pstar_fx.models import GPT, Llama, gpt_config, llama_config  # noqa: E402


class Checkpointed(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


CHECKPOINT_CHOICES = ("none", "half", "all")


def checkpointed_indices(n_blocks: int, checkpoint: str) -> list[int]:
    """Which blocks --checkpoint wraps: none, half (the even ones: 0, 2, 4, ...) or all."""
    step = {"none": None, "half": 2, "all": 1}[checkpoint]
    return list(range(0, n_blocks, step)) if step else []


def checkpoint_blocks(model, checkpoint: str = "all") -> list[int]:
    """Wrap the blocks `checkpoint` selects in Checkpointed, in place; returns their indices."""
    name = "h" if hasattr(model, "h") else "layers"
    blocks = list(getattr(model, name))
    chosen = checkpointed_indices(len(blocks), checkpoint)
    setattr(model, name, torch.nn.ModuleList(Checkpointed(b) if i in chosen else b for i, b in enumerate(blocks)))
    return chosen


def checkpointed_gpt(cfg, device: str, checkpoint: str = "all") -> GPT:
    """The peers' model: built on meta, initialized on `device`, activation checkpointing of the blocks
    `checkpoint` selects (checkpointed_indices)."""
    with torch.device("meta"):
        model = build(cfg)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    checkpoint_blocks(model, checkpoint)
    return model


def hf_llama_config(cfg):
    """transformers.LlamaConfig of our LlamaConfig's shape."""
    import transformers
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
        max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2)


def model_config(model: str, seq: int, layers: int | None = None):
    """(config, hf) of a --model name: NAME our GPT, llama:NAME our LLaMA, hf-llama:NAME Hugging Face's
    LlamaForCausalLM of that LLaMA's shape (hf True); / works as : too (gpu_run.sh splits its stages on :).
    block_size is the sequence length; `layers` overrides n_layer."""
    overrides = {"block_size": max(seq, 1)} | ({"n_layer": layers} if layers else {})
    family, _, name = model.replace("/", ":").rpartition(":")
    return (llama_config if family else gpt_config)(name, **overrides), family == "hf-llama"


def build(cfg, hf: bool = False):
    if hf:
        import transformers
        return transformers.LlamaForCausalLM(hf_llama_config(cfg))
    return Llama(cfg) if hasattr(cfg, "ffn_hidden") else GPT(cfg)


def parse_schedule(text: str | None):
    """cosine:WARMUP:TOTAL[:MIN_LR] or linear:... -> Config.lr_schedule dict (None stays None)."""
    if not text:
        return None
    kind, warmup, total, *rest = text.split(":")
    return {"type": kind, "warmup_steps": int(warmup), "total_steps": int(total),
            "min_lr": float(rest[0]) if rest else 0.0}


def torch_system(cfg, args):
    model = checkpointed_gpt(cfg, args.device, args.checkpoint)
    n_checkpointed = sum(isinstance(m, Checkpointed) for m in model.modules())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=True)
    if args.compile:
        # the whole forward (embeddings, blocks with their checkpoints, loss) and so its backward; the fused
        # AdamW step stays eager: it is already a few multi-tensor kernels over all parameters
        model = torch.compile(model, backend=args.compile_backend)
    spec = parse_schedule(args.lr_schedule)
    sched = None
    if spec:
        from pstar_fx.optim import LrSchedule
        sched = torch.optim.lr_scheduler.LambdaLR(opt, LrSchedule(spec, args.lr).multiplier)
    k = args.grad_accum

    def step(idx, tgt):
        total = 0.0
        for i, t in zip(idx.chunk(k), tgt.chunk(k)):
            with torch.autocast(args.device, dtype=torch.bfloat16):
                loss = model(i, t)
            (loss / k).backward()
            total = total + loss.detach() / k
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched:
            sched.step()
        return total

    extra = {"checkpoint": args.checkpoint, "checkpointed_blocks": n_checkpointed, "compile": args.compile}
    if args.compile and args.compile_backend != "inductor":
        extra["compile_backend"] = args.compile_backend
    return step, extra


CHAT_KEYS = ("input_ids", "labels", "attention_mask")


def chat_batches(vocab: int, rows: int, seq: int, device: str, n: int = 2) -> list[tuple]:
    """`n` batches of `rows` rows of packed chat data: synthetic records (a user turn, then an assistant turn, their
    lengths drawn) rendered by a chat template with a word-level tokenizer built here over the model's vocabulary
    (no network), encoded and packed into rows of `seq` tokens by pstar_fx.records, as `pstar-fx train --data
    chat.jsonl` does: (input_ids, labels (-100 off the assistant turns and on padding), attention_mask) each."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pstar_fx import records
    special = ["<|user|>", "<|assistant|>"]
    words = {"[UNK]": 0, "<eos>": 1, "<pad>": 2, special[0]: 3, special[1]: 4,
             **{f"w{i}": i for i in range(5, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>",
                                        pad_token="<pad>", additional_special_tokens=special)
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos> {% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    rng = random.Random(0)
    say = lambda k: " ".join(f"w{rng.randrange(5, vocab)}" for _ in range(k))  # noqa: E731
    examples, got = [], None
    while got is None or len(got) < rows * n:
        for _ in range(64):
            record = {"messages": [{"role": "user", "content": say(rng.randint(16, max(17, seq // 8)))},
                                   {"role": "assistant", "content": say(rng.randint(32, max(33, seq // 3)))}]}
            examples.append(records.Example(*records.encode_record(record, tokenizer), len(examples) + 1))
        got = records.pack_rows(examples, seq, records.pad_id(tokenizer))
    return [tuple(getattr(got, k)[i * rows:(i + 1) * rows].to(device) for k in CHAT_KEYS) for i in range(n)]


def pstar_system(cfg, args, example):
    with torch.device("meta"):
        model = build(cfg, hf=args.hf)
    if args.hf:
        example = (dict(zip(CHAT_KEYS, example)) if args.chat_packed else
                   {"input_ids": example[0], "labels": example[0]})   # HF shifts the labels itself
    sweep = [float(x.partition("@")[0]) for x in (args.clip_sweep or "").split(",") if x and x[:4] != "none"]
    clip = args.grad_clip or (max(sweep) if sweep else None)
    config = pstar_fx.Config(device="cuda", dtype="bf16", host_memory=args.host_memory,
                             device_memory=args.device_memory,
                             optimizer={"type": "adamw", "lr": args.lr, "weight_decay": 0.1},
                             grad_clip=clip, grad_accum=args.grad_accum,
                             lr_schedule=parse_schedule(args.lr_schedule), transaction=args.transaction,
                             compute=args.compute, optimizer_state=args.optimizer_state,
                             expected_trigger_rate=args.expected_trigger_rate)
    t0 = time.perf_counter()
    engine = pstar_fx.compile(model, config, example_inputs=example)
    compile_s = time.perf_counter() - t0
    print(f"compiled in {compile_s:.1f} s", file=sys.stderr, flush=True)
    print(engine.explain(), file=sys.stderr)
    extra = {"compile_s": round(compile_s, 2),
             "compile_phases_s": {k: round(v, 2) for k, v in engine.phases.seconds.items()},
             "region_builds": getattr(engine, "region_build_times", None) or None,
             "predicted_gpu_peak_bytes": engine.plan.device_peak_bytes,
             "predicted_host_peak_bytes": engine.plan.host_peak_bytes, "host_memory": args.host_memory,
             "chunk_size": engine.lowered.layout.chunk_size,
             "estimated_step_s": round(engine.plan.estimated_step_seconds, 3),
             "estimated_triggered_step_s": round(engine.plan.estimated_triggered_step_seconds, 3),
             "estimated_deferred_step_s": engine.plan.estimate.deferred_step_seconds and
             round(engine.plan.estimate.deferred_step_seconds, 3),
             "estimate_parts_s": {k: round(getattr(engine.plan.estimate, k + "_seconds"), 4)
                                  for k in ("compute", "copies_exposed", "grad_slot_waits", "host_adam_exposed")},
             "estimated_host_adam_rate": round(engine.plan.estimate.host_adam_rate),
             "host_grad_buffers": engine.plan.host_grad_buffers, "compute_slots": engine.plan.slots,
             "grad_slots": engine.plan.grad_slots,
             "host_shipping": {k: engine.plan.shipping.ship.count(k) for k in set(engine.plan.shipping.ship)},
             "host_order": engine.plan.chunks.host_order,
             "defer_above": engine.plan.defer_above, "kept_on_device": engine.plan.kept_on_device,
             "kept_in_activations": engine.plan.kept_in_activations,
             "rates": dataclasses.asdict(engine.plan.rates) if engine.plan.rates else None,
             "placement_device_chunks": engine.plan.placement.count("device"),
             "chunks": len(engine.plan.placement), "recompute": engine.plan.recompute,
             "recompute_tries": list(engine.plan.tried),
             "transaction": engine.plan.transaction, "transaction_cost": engine.plan.transaction_cost,
             "compute": "inductor" if engine.config.compiles_compute else "eager",
             "regions": next((n for n in engine.plan.notes if n.startswith("compute:")), None),
             "updates_by_block": len(engine.plan.moves.updates_after),
             "optimizer_state": engine.config.optimizer_state,
             "planned_trigger_rate": engine.config.expected_trigger_rate}
    step = ((lambda *b: engine.step(**dict(zip(CHAT_KEYS, b)))) if args.chat_packed else
            (lambda idx, tgt: engine.step(input_ids=idx, labels=idx)) if args.hf else engine.step)
    return step, extra, engine


def deepspeed_system(cfg, args):
    import deepspeed  # noqa: F401  (ImportError is reported as the result)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29511")):
        os.environ.setdefault(key, value)   # one process, no launcher
    model = checkpointed_gpt(cfg, "cpu")
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def step(idx, tgt):
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        return loss

    return step, {}


@contextlib.contextmanager
def undo_then_redo(on: bool):
    """With `on` (a sweep point's "@undo"), each correction undoes the speculated update and makes it again (kernels
    adam_undo with a redo: the float64 kernel before issue 24's one-pass rescale) instead of `chunk_rescale`: both
    kernels in one process, on one engine."""
    from pstar_fx.runtime.undo import Undo
    if not on:
        yield
        return
    new = Undo._correct_one

    def old(self, log, c, grad, speculated, hyper, shadow=True):
        log.hyper_of[c] = speculated
        self._chunk_undo(c, grad, speculated, redo=hyper, shadow=shadow)
        log.hyper_of[c] = hyper
    Undo._correct_one = old
    try:
        yield
    finally:
        Undo._correct_one = new


@contextlib.contextmanager
def copies_first(on: bool):
    """With `on` (a sweep point's "@split"), host chunks' jobs after the verdict (corrections, deferred updates)
    write their 16-bit shadows first and their masters and moments after (runtime/host_worker.py
    `HostWorker.COPIES_FIRST`): both ways in one process, on one engine."""
    from pstar_fx.runtime.host_worker import HostWorker
    before = HostWorker.COPIES_FIRST
    HostWorker.COPIES_FIRST = on
    try:
        yield
    finally:
        HostWorker.COPIES_FIRST = before


@contextlib.contextmanager
def late_binding(on: bool):
    """With `on` False (a sweep point's "@nolate"), every host update the worker runs is speculated and then corrected,
    as before late binding (runtime/undo.py `correct`: an update the worker has not started at the verdict applies the
    verdict's coefficient itself, `StepLog.verdict_hyper`): both ways in one process, on one engine."""
    from pstar_fx.runtime.step_log import StepLog
    if on:
        yield
        return
    StepLog.verdict_hyper = property(lambda self: None, lambda self, value: None)   # never set: never bound late
    try:
        yield
    finally:
        StepLog.verdict_hyper = None                                                  # the dataclass default again


def _oom_tried_bytes(message: str) -> int | None:
    """The allocation a CUDA OOM message says failed ("Tried to allocate 2.00 GiB"), in bytes."""
    m = re.search(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)", message)
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    return int(float(m.group(1)) * units[m.group(2)]) if m else None


def _without(argv: list[str], options: dict[str, bool]) -> list[str]:
    """argv less the options named (option -> takes a value), in either `--opt V` or `--opt=V` form."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in options:
            skip = options[name] and "=" not in a
            continue
        out.append(a)
    return out


TORCH_BEST_CONFIGS = [(c, ck) for c in (False, True) for ck in CHECKPOINT_CHOICES]


def child_result(cmd: list[str], timeout_s: float) -> tuple[dict | None, str]:
    """Run `cmd` (a bench run in a fresh process) and return (its last RESULT line, None) or (None, why there is
    none: a timeout, an exit without one)."""
    # its own session so a timeout ends the child and the compile workers it started, and nothing else
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    # a `timeout` around this process sends SIGTERM: end the child's session too, or it keeps the GPU (its own
    # session does not get the signal)
    main = threading.current_thread() is threading.main_thread()     # (signal handlers: the main thread's only)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)) if main else None
    try:
        out, _ = p.communicate(timeout=timeout_s)
        reason = f"exited with {p.returncode} without a RESULT line"
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        reason = f"timeout: no result within {timeout_s:.0f} s"
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    try:
        os.killpg(p.pid, signal.SIGKILL)      # stragglers of a child that exited (compile workers)
    except (ProcessLookupError, PermissionError):
        pass
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    return (json.loads(lines[-1][len("RESULT "):]), None) if lines else (None, reason)


def run_config(argv: list[str], compile_: bool, checkpoint: str, timeout_s: float) -> dict:
    """`--system torch` with this configuration in a fresh process (its own CUDA context and allocator);
    its RESULT line, or an "error" saying why there is none (timeout, crash)."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--system", "torch", "--checkpoint", checkpoint]
    cmd += ["--compile"] if compile_ else []
    print(f"torch-best: {' '.join(cmd[1:])} (limit {timeout_s:.0f} s)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    result, reason = child_result(cmd, timeout_s)
    if result is None:
        result = {"system": "torch", "checkpoint": checkpoint, "compile": compile_, "error": reason}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["fits"] = result.get("fits", "error" not in result and "step_s" in result)
    result["sweep"] = "torch-best"
    return result


def torch_best(args, argv: list[str], base: dict) -> dict:
    """Run TORCH_BEST_CONFIGS one after another, emitting each one's line as it ends (a sweep cut short keeps
    what it measured); print the table and return the "best" line: the fastest configuration that fits."""
    child_argv = _without(argv, {"--system": True, "--checkpoint": True, "--compile": False, "--json": True})
    deadline = time.monotonic() + args.sweep_timeout
    results = []
    for compile_, checkpoint in TORCH_BEST_CONFIGS:
        left = deadline - time.monotonic()
        if left < 10:
            r = {"system": "torch", "checkpoint": checkpoint, "compile": compile_, "fits": False,
                 "sweep": "torch-best", "error": f"not run: --sweep-timeout {args.sweep_timeout:.0f} s spent"}
        else:
            r = run_config(child_argv, compile_, checkpoint, min(args.config_timeout, left))
        results.append(r)
        emit(r, args.json)
    print(format_table(results), flush=True)
    best = dict(base, system="torch-best", gpu=next((r["gpu"] for r in results if r.get("gpu")), None), configs=[
        {k: r.get(k) for k in ("compile", "checkpoint", "fits", "step_s", "tflops", "gpu_peak_bytes", "compile_s",
                               "oom", "oom_tried_bytes", "error")} for r in results])
    fitting = [r for r in results if r["fits"]]
    if fitting:
        winner = min(fitting, key=lambda r: r["step_s"])
        best.update({k: v for k, v in winner.items() if k not in ("system", "sweep", "fits", "wall_s")})
        best["best"] = {"compile": winner["compile"], "checkpoint": winner["checkpoint"]}
    else:
        best["error"] = "no configuration fits"
    return best


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f}" if n else "-"


def _dash(x) -> str:
    return "-" if x is None else str(x)


def format_table(results: list[dict]) -> str:
    """One row per configuration: an OOM reads "does not fit (tried X GiB more at Y GiB)"."""
    gib, dash = _gib, _dash
    rows = ["compile  checkpoint  fits  step_s   tflops  gpu_peak_GiB  compile_s  note"]
    for r in results:
        if r["fits"]:
            note = ""
        elif r.get("oom"):
            note = (f"does not fit (tried {gib(r.get('oom_tried_bytes'))} GiB more at "
                    f"{gib(r.get('gpu_peak_bytes'))} GiB allocated)")
        else:
            note = r.get("error", "")[:100]
        rows.append(f"{'yes' if r['compile'] else 'no':<8} {r['checkpoint']:<11} {'yes' if r['fits'] else 'no':<5} "
                    f"{dash(r.get('step_s')):<8} {dash(r.get('tflops')):<7} {gib(r.get('gpu_peak_bytes')):<13} "
                    f"{dash(r.get('compile_s')):<10} {note}")
    return "\n".join(rows)


def _max_rss() -> int:
    """The process's peak resident set since it started (compile included), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_profile_step(step, batch, sync) -> dict:
    """One step under cProfile: where the launching thread's time goes (what it does while the GPU has no work
    queued shows as the GPU idle at the step's ends). The 30 functions of most own time, and the step's wall
    time under the profiler (cProfile slows Python; compare functions with each other, not with step_s)."""
    import cProfile
    import pstats
    sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    step(*batch)
    sync()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    rows = sorted(((tt, ct, nc, f"{fn[0].rsplit('/', 2)[-1]}:{fn[1]} {fn[2]}") for fn, (_, nc, tt, ct, _) in
                   stats.stats.items()), reverse=True)[:30]
    print(f"cpu profile of one step: {wall:.3f} s under cProfile", file=sys.stderr)
    for tt, ct, nc, name in rows[:15]:
        print(f"  own {tt * 1e3:8.2f} ms  cum {ct * 1e3:8.2f} ms  x{nc:<6d} {name}", file=sys.stderr)
    return {"wall_s": round(wall, 4), "top_own": [{"own_ms": round(tt * 1e3, 3), "cum_ms": round(ct * 1e3, 3),
                                                    "calls": nc, "function": name} for tt, ct, nc, name in rows]}


ANNOTATIONS = ("bench.", "pstar_fx.")   # the steps' and the runtime's profiler ranges: the device shows them too


def all_threads() -> dict:
    """torch.profiler.profile's keywords that record every thread's ranges, not only the one that starts it: the host
    worker's jobs (`pstar_fx.host_job cN`, which bench/copy_waits.py reads) ran on a thread of their own and were
    missing from session 32's traces. {} where this torch has no such option."""
    from torch._C._profiler import _ExperimentalConfig
    try:
        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except TypeError:
        return {}


def profile_steps(step, batches, n: int, label: str = "") -> dict:
    """GPU kernel time of `n` steps by kind, every kernel (the 25 largest printed), the stretches when no
    kernel ran on any stream, with the kernels either side, and each step stream by stream (torch.profiler;
    bench/trace_summary.py: the compute stream's idle stretches with what the launching thread was doing).
    With PSTAR_FX_TRACE_DIR set, the trace is kept there, gzipped (`label` names it)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], **all_threads()) as prof:
        for k in range(n):
            with record_function(f"bench.step{k}"):     # each step's span, back to back as `timed` runs them:
                float(step(*batches[k % 2]))            # the device work a step leaves runs in the next one's
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total
        if not us or e.device_type != torch.autograd.DeviceType.CUDA or e.key.startswith(ANNOTATIONS):
            continue
        name = e.key.lower()
        kind = ("attention" if any(k in name for k in ("flash", "fmha", "attention", "sdpa")) else
                "matmul" if any(k in name for k in ("gemm", "cutlass", "sm90", "nvjet", "cublas")) else
                "copy" if "memcpy" in name or "memset" in name else
                "adam" if "adam" in name else
                "triton" if name.startswith("triton") else "other")
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e6 / n
        rows.append((us / 1e6 / n, e.count // n, e.key[:90]))
    rows.sort(reverse=True)
    # the union of kernel intervals over every stream: busy time; the kernels' sum less it: what ran side by side
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
                   and not e.name.startswith(ANNOTATIONS))
    busy, end, last, gaps = 0.0, -math.inf, "", []
    for a, b, name in spans:
        if a > end > -math.inf:     # no kernel on any stream between `last` ending and `name` starting
            gaps.append(((a - end) / 1e3, last, name))
        if b > end:
            busy += b - max(a, end)
            end, last = b, name
    gaps.sort(reverse=True)
    wall = (spans[-1][1] - spans[0][0]) / 1e6 / n if spans else 0.0
    print(f"idle stretches inside the span: {sum(g for g, _, _ in gaps) / n:.2f} ms per step, the longest: "
          + "; ".join(f"{g:.2f} ms {x} -> {y}" for g, x, y in gaps[:5]), file=sys.stderr)
    busy = busy / 1e6 / n
    overlap = sum(kinds.values()) - busy
    print("profile, GPU seconds per step by kind: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(kinds.items()))
          + f"; busy {busy:.4f} of {wall:.4f} (first kernel to last), side by side {overlap:.4f}", file=sys.stderr)
    for s_, c, name in rows[:25]:
        print(f"  {s_:8.4f} s  x{c:<5d} {name}", file=sys.stderr)
    timeline = _stream_timeline(prof, label)
    return {"by_kind_s": {k: round(v, 4) for k, v in kinds.items()}, "busy_s": round(busy, 4),
            "timeline": timeline,
            "kernel_span_s": round(wall, 4), "side_by_side_s": round(overlap, 4),
            "top": [{"s": round(s_, 5), "calls": c, "kernel": name} for s_, c, name in rows[:25]],
            "kernels": [{"s": round(s_, 6), "calls": c, "kernel": name} for s_, c, name in rows],
            # the idle stretches (every stream idle) of all n steps, longest first: what ran before and after
            "idle_gaps_ms": [{"ms": round(g, 3), "after": x, "before": y} for g, x, y in gaps[:40]],
            "idle_gaps_total_ms_per_step": round(sum(g for g, _, _ in gaps) / n, 3)}


def _stream_timeline(prof, label: str) -> list:
    """Each profiled step stream by stream (bench/trace_summary.py), printed and returned; the trace kept, gzipped,
    in $PSTAR_FX_TRACE_DIR when set."""
    import gzip
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        data = trace_summary.read(path)
        summary = trace_summary.summarize(trace_summary.complete(data))
        waits = copy_waits.analyze(data)                      # why the compute stream waited for copies
        keep = os.environ.get("PSTAR_FX_TRACE_DIR")
        if keep:
            os.makedirs(keep, exist_ok=True)
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", label or "steps").strip("_") or "steps"
            with open(path, "rb") as src, gzip.open(os.path.join(keep, f"trace-{name}.json.gz"), "wb") as dst:
                dst.write(src.read())
    print(f"profile {label}:", file=sys.stderr)
    trace_summary.print_summary(summary)
    print(f"copy waits {label}:", file=sys.stderr)
    copy_waits.print_report(waits, show=12, file=sys.stderr)
    return summary["steps"]


def _timed_switch(engine) -> str | None:
    """What the step that may defer has timed so far (runtime/timed_switch.py), or None without one."""
    switch = getattr(engine.stepper.transaction, "switch", None)
    return switch.summary() if switch is not None else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)   # torch-best rewrites its argv for the children
    ap.add_argument("--model", required=True)
    ap.add_argument("--system", choices=("pstar_fx", "torch", "torch-best", "deepspeed"), required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=None, help="override the model's n_layer (e.g. the largest "
                    "GPT3_18B-shaped model that trains: --model GPT3_18B --layers 96)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--host-memory", default=None, help="pstar_fx host budget, e.g. 120GiB")
    ap.add_argument("--device-memory", default=None, help="pstar_fx device budget (default: free GPU memory)")
    ap.add_argument("--json", default=None, help="append the result to this file")
    ap.add_argument("--dump-after", type=float, default=0, help="print every thread's stack after this many s")
    ap.add_argument("--grad-clip", type=float, default=None, help="max global gradient norm (clip_grad_norm_)")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches of --batch per update")
    ap.add_argument("--chat-packed", action="store_true",
                    help="hf-llama: packed chat rows (loss on assistant turns, padding masked) instead of random ids")
    ap.add_argument("--lr-schedule", default=None, help="cosine:WARMUP:TOTAL[:MIN_LR] or linear:...")
    ap.add_argument("--transaction", default="auto", help="pstar_fx Config.transaction")
    ap.add_argument("--expected-trigger-rate", type=float, default=None,
                    help="pstar_fx Config.expected_trigger_rate at compile (the plan is made for it; a --clip-sweep "
                    "point's @RATE fixes the rate its steps run at)")
    ap.add_argument("--compute", default="auto", choices=("auto", "eager", "inductor"),
                    help="pstar_fx Config.compute: the compute between chunk nodes eager or compiled by Inductor")
    ap.add_argument("--optimizer-state", default="fp32", choices=("fp32", "bf16", "int8"),
                    help="pstar_fx Config.optimizer_state (the Adam moments' format)")
    ap.add_argument("--profile", type=int, default=0, help="after the steps (and each --clip-sweep point's), this "
                    "many more under torch.profiler: GPU time per kernel (the top 25, and totals by kind), and each "
                    "step stream by stream (bench/trace_summary.py; PSTAR_FX_TRACE_DIR keeps the traces)")
    ap.add_argument("--cpu-profile", action="store_true", help="after the steps, one more under cProfile: the "
                    "launching thread's own time by function (what keeps the GPU waiting at a step's ends)")
    ap.add_argument("--clip-sweep", default=None, help="pstar_fx: after the steps, --steps more at each of these "
                    "clip thresholds on the same engine (e.g. 1e9,1e-3: never / always triggers); THRESHOLD@RATE "
                    "also fixes Config.expected_trigger_rate (1.0@0: speculate and correct; 1.0@1: defer); "
                    "THRESHOLD@RATE@nolate runs that point without late binding (every host update corrected), "
                    "@undo with corrections by undo-then-redo (the float64 kernel before the one-pass rescale), "
                    "@split with host jobs after the verdict writing their 16-bit copies first")
    ap.add_argument("--checkpoint", choices=CHECKPOINT_CHOICES, default="all",
                    help="torch: activation checkpointing (torch.utils.checkpoint, non-reentrant) of every block "
                    "(all, the default), of the even blocks 0, 2, 4, ... (half) or of none")
    ap.add_argument("--compile", action="store_true",
                    help="torch: torch.compile (default mode) the whole model's forward -- embeddings, blocks "
                    "with their checkpoints, loss -- and so its backward; the fused AdamW step stays eager. "
                    "The first two steps (excluded from step_s) pay the compile: compile_s")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch --compile: the torch.compile backend (tests use 'eager' for speed)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="torch: cpu only for smoke tests of this script (bf16 autocast on CPU)")
    ap.add_argument("--config-timeout", type=float, default=240,
                    help="torch-best: seconds each configuration's subprocess may run")
    ap.add_argument("--sweep-timeout", type=float, default=540,
                    help="torch-best: seconds for the whole sweep; configurations it leaves no time for are "
                    "reported as not run (the best line is still written)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the whole run, in seconds (the interpreter's default: 0.005): an "
                    "A/B of the host worker's and the launching thread's turns at the GIL during the steps")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.switch_interval is not None:
        if not args.switch_interval > 0:
            ap.error(f"--switch-interval: seconds above 0, got {args.switch_interval}")
        sys.setswitchinterval(args.switch_interval)
    if args.device != "cuda" and args.system not in ("torch", "torch-best"):
        ap.error("--device cpu: --system torch only (smoke tests)")
    logging.basicConfig(stream=sys.stderr, format="%(relativeCreated)8.0f ms %(message)s")
    logging.getLogger("pstar_fx").setLevel(logging.INFO)     # compile phases as they happen
    if args.dump_after and args.system != "torch-best":   # torch-best's children get it; it only waits
        faulthandler.dump_traceback_later(args.dump_after, repeat=True)

    cfg, args.hf = model_config(args.model, args.seq, args.layers)
    if args.hf and args.system != "pstar_fx":
        ap.error("hf-llama: models run with --system pstar_fx only")
    if args.chat_packed and not args.hf:
        ap.error("--chat-packed: an hf-llama model only (its forward takes labels and an attention mask)")
    with torch.device("meta"):
        params = sum(p.numel() for p in build(cfg, hf=args.hf).parameters())
    tokens = args.batch * args.seq * args.grad_accum
    result = {"system": args.system, "model": args.model, "n_layer": cfg.n_layer, "params": params, "batch": args.batch,
              "seq": args.seq, "tokens": tokens, "switch_interval_s": sys.getswitchinterval()}
    if args.system == "torch-best":   # the parent touches no GPU: its context would take memory from the children
        emit(torch_best(args, argv, result), args.json)
        return
    cuda = args.device == "cuda"
    result["gpu"] = torch.cuda.get_device_name() if cuda and torch.cuda.is_available() else None
    if args.system == "torch":
        result.update(checkpoint=args.checkpoint, compile=args.compile)
    proc = psutil.Process()
    rss = 0

    def sync():
        if cuda:
            torch.cuda.synchronize()

    try:
        if cuda and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        g = torch.Generator(device=args.device).manual_seed(0)
        rows = args.batch * args.grad_accum
        batches = [(torch.randint(0, cfg.vocab_size, (rows, args.seq), device=args.device, generator=g),
                    torch.randint(0, cfg.vocab_size, (rows, args.seq), device=args.device, generator=g))
                   for _ in range(2)]
        if args.chat_packed:
            batches = chat_batches(cfg.vocab_size, rows, args.seq, args.device)
            result.update(data="chat-packed", trained_tokens=[int((b[1] != -100).sum()) for b in batches],
                          real_tokens=[int(b[2].sum()) for b in batches])
        engine = None
        if args.system == "torch":
            step, extra = torch_system(cfg, args)
        elif args.system == "deepspeed":
            step, extra = deepspeed_system(cfg, args)
        else:
            step, extra, engine = pstar_system(cfg, args, tuple(x[:args.batch] for x in batches[0]))
        result.update(extra)
        def timed(n, label=""):
            """`n` steps back to back, as a training loop runs them: a step's end is when it returned its loss as a
            number (the loss read is the loop's only wait for the device), and its time runs from the last step's
            end. The device is synchronized before the first step and after the last (`window` gets the whole);
            synchronizing after every step would add to each the device work a step leaves to overlap the next
            forward (a correction's or a deferred step's updates, bench/RESULTS.md session 21)."""
            nonlocal rss
            times, losses, extra = [], [], []
            sync()
            start = t0 = time.perf_counter()
            for k in range(n):
                with collections_timed() as gc_s:
                    loss = step(*batches[k % 2])
                    losses.append(float(loss))
                t1 = time.perf_counter()
                times.append(t1 - t0)
                gc_seconds.append(gc_s)
                t0 = t1
                rss = max(rss, proc.memory_info().rss)
                if engine is not None and engine.last_step is not None:
                    r = engine.last_step
                    extra.append({"grad_norm": r.grad_norm and round(r.grad_norm, 4), "clip_coef": round(r.clip_coef, 5),
                                  "lr": r.lr, "skipped": r.skipped, "deferred": r.deferred})
                print(f"{label}step {k}: {times[-1]:.3f} s loss {losses[-1]:.4f} {extra[-1] if extra else ''}",
                      file=sys.stderr, flush=True)
            sync()
            window.append(round(time.perf_counter() - start, 4))
            return times, losses, extra

        window: list[float] = []     # each timed run's seconds, first step to the device idle after the last
        gc_seconds: list[dict] = []  # each timed step's seconds in Python's garbage collections, by generation

        times, losses, reports = timed(args.steps)
        steady = times[2:] if len(times) > 2 else times
        step_s = statistics.median(steady)
        result.update(step_s=round(step_s, 4), tflops=round(6 * params * tokens / step_s / 1e12, 1),
                      steps_s=[round(t, 3) for t in times], window_s=window[0], losses=[round(x, 4) for x in losses],
                      gpu_peak_bytes=torch.cuda.max_memory_allocated() if cuda else None, host_rss_bytes=rss,
                      host_max_rss_bytes=_max_rss(), gc_s=gc_seconds[:len(times)])
        if args.profile and cuda:
            result["profile"] = profile_steps(step, batches, args.profile, label="steps")
        if args.cpu_profile:
            result["cpu_profile"] = cpu_profile_step(step, batches[0], sync)
        if args.system == "torch" and args.compile:
            # dynamo + inductor run in the first step (forward, then backward); what the warm-up steps took
            # beyond a steady step is the compile
            result["compile_s"] = round(sum(max(0.0, t - step_s) for t in times[:2]), 2)
            print(f"compile_s {result['compile_s']}", file=sys.stderr, flush=True)
        if engine is not None:
            # the "time to the first step": compile() called -> the first step's end
            result["time_to_first_step_s"] = round(result.get("compile_s", 0.0) + times[0], 2)
            result["phases"] = engine.rt.timing() if hasattr(engine.rt, "timing") else {}
            # the host Adam's rate in training against the plan's; learned: what a later compile here plans with
            result["host_adam_rate_measured"] = engine.host_rate.measured
            result["host_adam_rate_learned"] = engine.host_rate.learned
            result["memory_stats"] = engine.memory_stats()
            result["reports"] = reports
            result["timed_switch"] = _timed_switch(engine)
            if args.clip_sweep:
                result["sweep"] = []
                for point in args.clip_sweep.split(","):
                    # THRESHOLD[@RATE[@FLAG...]]: the same compiled engine, another threshold (the plan depends on
                    # clipping being on, not its value) and, with @RATE, Config.expected_trigger_rate fixed (0:
                    # speculate, 1: defer where the plan may; without it the rate is measured as the run goes);
                    # @nolate: without late binding (`late_binding`); @undo: corrections by undo-then-redo;
                    # @split: host jobs after the verdict write their 16-bit copies first (`copies_first`)
                    x, *rest = point.split("@")
                    rate, flags = (rest[0] if rest else ""), set(rest[1:])
                    if not flags <= {"nolate", "undo", "split"}:
                        raise ValueError(f"--clip-sweep point {point!r}: expected "
                                         "THRESHOLD[@RATE[@nolate][@undo][@split]]")
                    flag = "nolate" if "nolate" in flags else ""
                    threshold = None if x == "none" else float(x)
                    engine.stepper.config = dataclasses.replace(engine.stepper.config, grad_clip=threshold,
                                                                expected_trigger_rate=float(rate) if rate else None)
                    before = dict(engine.rt.telemetry.seconds)
                    n0 = engine.rt.telemetry.steps
                    with late_binding(flag != "nolate"), undo_then_redo("undo" in flags), \
                            copies_first("split" in flags):
                        t, _, rep = timed(args.steps, label=f"clip {threshold}{' nolate' if flag else ''}"
                                                            f"{' undo' if 'undo' in flags else ''}"
                                                            f"{' split' if 'split' in flags else ''} ")
                    engine.rt.timing()
                    n = max(1, engine.rt.telemetry.steps - n0)
                    phases = {k: round((v - before[k]) / n, 4) for k, v in engine.rt.telemetry.seconds.items()}
                    med = statistics.median(t[1:] if len(t) > 1 else t)
                    prof = None
                    if args.profile and cuda:       # after the timed steps: the profiler slows them
                        with late_binding(flag != "nolate"), undo_then_redo("undo" in flags), \
                                copies_first("split" in flags):
                            prof = profile_steps(step, batches, args.profile, label=f"clip-{x}-{rate or 'measured'}")
                    result["sweep"].append({"profile": prof, "grad_clip": threshold,
                                            "expected_trigger_rate": rate or None,
                                            "late_binding": flag != "nolate",
                                            "correction": "undo" if "undo" in flags else "rescale",
                                            "copies_first": "split" in flags,
                                            "step_s": round(med, 4),
                                            "steps_s": [round(x, 3) for x in t], "window_s": window[-1],
                                            "phases": phases,
                                            "clipped": sum(r["clip_coef"] < 1 for r in rep), "reports": rep,
                                            "timed_switch": _timed_switch(engine)})
    except Exception as e:  # noqa: BLE001 - a model that does not fit is a result, not a crash
        result["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        traceback.print_exc(file=sys.stderr)
        # an OOM may come wrapped (inductor's BackendCompilerFailed), so the message decides
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            result.update(fits=False, oom=True, oom_tried_bytes=_oom_tried_bytes(str(e)))
        if cuda and torch.cuda.is_available():
            result["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
        result["host_rss_bytes"] = max(rss, proc.memory_info().rss)
        result["host_max_rss_bytes"] = _max_rss()
    result["host_anon_huge_bytes"] = anon_huge_bytes()
    if cuda and torch.cuda.is_available():
        # the caching allocator's retries (a cudaMalloc that failed, its cache freed and tried again: each a device
        # sync) and reserved peak, for buffers allocated in the step (Plan.kept_in_activations)
        stats = torch.cuda.memory_stats()
        result["alloc_retries"] = stats.get("num_alloc_retries")
        result["gpu_reserved_peak_bytes"] = stats.get("reserved_bytes.all.peak")
    emit(result, args.json)


@contextlib.contextmanager
def collections_timed():
    """Seconds the launching thread spends in Python's garbage collections inside the block, by generation
    ({"0": s, "1": s, "2": s}, filled as the block runs): a full collection walks every object alive, the
    engine's graph and plan among them, and stalls the launches meanwhile."""
    seconds: dict[str, float] = {}
    started: list[float] = []

    def callback(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            gen = str(info.get("generation"))
            seconds[gen] = round(seconds.get(gen, 0.0) + time.perf_counter() - started.pop(), 4)

    gc.callbacks.append(callback)
    try:
        yield seconds
    finally:
        gc.callbacks.remove(callback)


def emit(result: dict, json_path: str | None):
    print("RESULT " + json.dumps(result), flush=True)
    if json_path:
        with open(json_path, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
