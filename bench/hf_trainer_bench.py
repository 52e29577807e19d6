"""PstarTrainer against the engine's own loop: the same model, Config and batches, tokens/s of each and their ratio.

    python bench/hf_trainer_bench.py [--model hf-llama/Llama3_8B] [--steps 20] [--batch 16] [--seq 1024]
                                     [--host-memory 110GiB] [--device cuda] [--json FILE]

Two sides, each on the model bench/gpt.py builds for `--model hf-llama/NAME` (`gpt.model_config` and `gpt.build`:
Hugging Face's LlamaForCausalLM of gpt.py's LLaMA shape NAME, built on the meta device, so its weights are
initialized in chunk memory from Config.seed: random init; our own GPT and LLaMA are not Hugging Face models, whose
config the Trainer writes into):
  engine   pstar_fx.compile, then a plain loop of `engine.step(batch)` (the batch moved to the device in the loop);
  trainer  `PstarTrainer.train()` over a dataset of the same rows, in order (train_sampling_strategy="sequential"),
           logging every step (the Trainer's most frequent logging: the most loop overhead around the step).
Both sides' Config is the one PstarTrainer makes from its TrainingArguments (`config_from_args`: AdamW at --lr,
no weight decay, clipping at --grad-clip, a linear schedule over --steps, --dtype) with `host_memory` /
`device_memory` as pstar_config; so with the same seed and rows both train the same losses: bit for bit on the CPU
(the test holds it to that), on CUDA within what its atomic-add kernels leave to chance ("losses_equal",
"losses_max_rel_diff"; "config_equal" on the trainer's line says the two Configs are the same).

Timing: a step is the time between one step's end and the next one's (CUDA synchronized at each end), so it holds
everything the loop does between steps (the Trainer's data loading, callbacks and logging). The first step is
reported apart (first_step_s, its compile excluded: compile_s), and tokens_per_s = batch * seq * (steps - 1) /
the steps after the first. Each side runs in a subprocess of its own by default (a fresh CUDA context and host
memory: the first side's chunk memory, pinned host memory included, is gone before the second allocates; the
second side's compile finds the Inductor cache the first one filled, so its compile_s is the warmer one);
`--in-process` runs both here one after the other, the first engine dropped (del, gc, torch.cuda.empty_cache)
before the second compiles (the CPU test does that). `--side engine|trainer` runs one side alone and prints its
line.

Output: one line per side, RESULT {json}, with tokens_per_s, step_s_median, steps_s, first_step_s, compile_s,
losses, gpu_peak_bytes, host_max_rss_bytes, and on both lines the ratio (trainer tokens/s over the engine's) and
losses_equal; a side that failed has "error" (and "oom") and the ratio is null.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402  (bench/gpt.py: the model names, the meta build, RESULT lines)

import pstar_fx  # noqa: E402

SIDES = ("engine", "trainer")


def rows(cfg, args) -> list[dict]:
    """steps * batch rows of random tokens (seed 0): input_ids, and the same as labels (the model shifts them);
    the same rows on both sides."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.steps * args.batch, args.seq), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


def training_arguments(args, output_dir: str):
    from transformers import TrainingArguments
    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=args.lr, weight_decay=0.0, max_grad_norm=args.grad_clip or 0.0, optim="adamw_torch",
        lr_scheduler_type="linear", bf16=args.dtype == "bf16", use_cpu=args.device == "cpu", seed=0,
        train_sampling_strategy="sequential", dataloader_num_workers=0, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True)


def pstar_config(args) -> dict:
    """What the TrainingArguments do not say: the budgets."""
    return {k: v for k, v in (("host_memory", args.host_memory), ("device_memory", args.device_memory)) if v}


def meta_model(cfg, hf: bool):
    with torch.device("meta"):
        return gpt.build(cfg, hf=hf)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_side(cfg, hf: bool, args, data: list[dict], output_dir: str) -> tuple[dict, object]:
    """The engine's own loop; (its measurements, the engine)."""
    from pstar_fx.integrations.transformers import config_from_args
    config = config_from_args(training_arguments(args, output_dir), args.steps, pstar_config(args))
    device = config.device
    batches = [{k: torch.stack([r[k] for r in data[i:i + args.batch]]) for k in data[0]}
               for i in range(0, len(data), args.batch)]
    model = meta_model(cfg, hf)
    t0 = time.perf_counter()
    engine = pstar_fx.compile(model, config, example_inputs={k: v.to(device) for k, v in batches[0].items()})
    compile_s = time.perf_counter() - t0
    print(engine.explain(), file=sys.stderr, flush=True)
    ends, losses = [time.perf_counter()], []
    for k, b in enumerate(batches):
        engine.step({key: v.to(device) for key, v in b.items()})
        _sync(device)
        ends.append(time.perf_counter())
        losses.append(engine.last_step.loss)
        print(f"engine step {k}: {ends[-1] - ends[-2]:.3f} s loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    return _timings(compile_s, ends, losses, args) | _plan_fields(engine), engine


def trainer_side(cfg, hf: bool, args, data: list[dict], output_dir: str) -> tuple[dict, object]:
    """PstarTrainer.train(); (its measurements, the engine)."""
    from transformers import TrainerCallback
    from pstar_fx.integrations.transformers import PstarTrainer

    class Timed(PstarTrainer):
        compile_s = 0.0

        def _compile(self, example):
            t0 = time.perf_counter()
            super()._compile(example)
            self.compile_s = time.perf_counter() - t0

    class StepEnds(TrainerCallback):
        """Each step's end (synchronized) and the engine's loss: what the Trainer's loop did between two."""

        def __init__(self):
            self.trainer, self.ends, self.losses = None, [], []

        def on_train_begin(self, targs, state, control, **kw):
            _sync(str(targs.device))
            self.ends.append(time.perf_counter())

        def on_step_end(self, targs, state, control, **kw):
            _sync(str(targs.device))
            self.ends.append(time.perf_counter())
            self.losses.append(self.trainer.engine.last_step.loss)
            print(f"trainer step {len(self.losses) - 1}: {self.ends[-1] - self.ends[-2]:.3f} s loss "
                  f"{self.losses[-1]:.4f}", file=sys.stderr, flush=True)

    steps = StepEnds()
    t0 = time.perf_counter()
    trainer = Timed(model=meta_model(cfg, hf), args=training_arguments(args, output_dir), train_dataset=data,
                    pstar_config=pstar_config(args), callbacks=[steps])
    steps.trainer = trainer
    setup_s = time.perf_counter() - t0
    trainer.train()
    if trainer.engine is None:
        raise RuntimeError("PstarTrainer.train() returned without compiling an engine")
    ends = list(steps.ends)
    ends[0] += trainer.compile_s            # the first step (in which the engine compiles) less its compile
    result = _timings(trainer.compile_s, ends, steps.losses, args) | _plan_fields(trainer.engine)
    result["trainer_setup_s"] = round(setup_s, 2)
    result["config_equal"] = None           # filled by the caller, which has the engine side's
    engine = trainer.engine
    trainer.engine = None
    return result, engine


def _timings(compile_s: float, ends: list[float], losses: list[float], args) -> dict:
    """Step times from the ends (ends[0]: the loop's start, the compile excluded)."""
    times = [b - a for a, b in zip(ends, ends[1:])]
    later = times[1:] or times
    tokens = args.batch * args.seq
    return {"compile_s": round(compile_s, 2), "first_step_s": round(times[0], 3),
            "steps_s": [round(t, 4) for t in times[1:]], "step_s_median": round(statistics.median(later), 4),
            "tokens_per_s": round(tokens * len(later) / sum(later), 1), "losses": losses}


def _plan_fields(engine) -> dict:
    fields = {k: getattr(engine.config, k) for k in engine.config.__dataclass_fields__}
    return {"config": json.loads(json.dumps(fields, default=repr)),     # as a RESULT line carries it
            "chunks": len(engine.plan.placement), "device_chunks": engine.plan.placement.count("device"),
            "estimated_step_s": round(engine.plan.estimated_step_seconds, 3),
            "memory_stats": engine.memory_stats()}


def run_side(side: str, args) -> dict:
    """One side here; its line (with "error" where it failed). The engine is dropped and the device's cached
    memory given back before this returns."""
    cfg, hf = gpt.model_config(args.model, args.seq, args.layers)
    result = {"side": side, "model": args.model, "batch": args.batch, "seq": args.seq, "steps": args.steps,
              "tokens_per_step": args.batch * args.seq, "dtype": args.dtype, "device": args.device,
              "params": sum(p.numel() for p in meta_model(cfg, hf).parameters()),
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else None}
    cuda = args.device == "cuda"
    engine = None
    try:
        if cuda and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        data = rows(cfg, args)
        with tempfile.TemporaryDirectory() as out:
            measured, engine = (engine_side if side == "engine" else trainer_side)(cfg, hf, args, data, out)
        result.update(measured)
        if cuda:
            result["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
    except Exception as e:  # noqa: BLE001 - a side that fails is a result
        result["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        traceback.print_exc(file=sys.stderr)
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            result.update(oom=True, oom_tried_bytes=gpt._oom_tried_bytes(str(e)))
    result["host_max_rss_bytes"] = gpt._max_rss()
    del engine                      # its chunk memory, before another side allocates its own
    gc.collect()
    if cuda and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def run_child(argv: list[str], side: str, timeout_s: float) -> dict:
    """`--side SIDE` in a fresh process (its own CUDA context, allocator and host memory); its RESULT line, or an
    "error" saying why there is none."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--side", side, "--timeout", str(int(timeout_s))]
    print(f"hf_trainer_bench: {' '.join(cmd[1:])} (limit {timeout_s:.0f} s)", file=sys.stderr, flush=True)
    result, reason = gpt.child_result(cmd, timeout_s)
    return result if result is not None else {"side": side, "error": reason}


def compare(engine: dict, trainer: dict) -> None:
    """The ratio and whether the losses agree, on both lines."""
    ok = "error" not in engine and "error" not in trainer
    ratio = round(trainer["tokens_per_s"] / engine["tokens_per_s"], 4) if ok else None
    same = ok and trainer["losses"] == engine["losses"]
    diff = (max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(trainer["losses"], engine["losses"]))
            if ok and len(trainer["losses"]) == len(engine["losses"]) else None)
    for r in (engine, trainer):
        r.update(ratio=ratio, losses_equal=same, losses_max_rel_diff=diff)
    if ok:
        trainer["config_equal"] = trainer["config"] == engine["config"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--model", default="hf-llama/Llama3_8B", help="hf-llama/NAME: Hugging Face's LlamaForCausalLM "
                    "of the shape of bench/gpt.py's llama/NAME (tiny, small, Llama3_8B, ...)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=None, help="override the model's n_layer")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="TrainingArguments bf16=True or not")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="max_grad_norm (0: none)")
    ap.add_argument("--host-memory", default="110GiB", help="pstar_config host_memory")
    ap.add_argument("--device-memory", default=None, help="pstar_config device_memory (default: free GPU memory)")
    ap.add_argument("--side", choices=("both", *SIDES), default="both")
    ap.add_argument("--in-process", action="store_true", help="both sides in this process, one after the other")
    ap.add_argument("--timeout", type=float, default=520, help="seconds for the whole run (both sides' subprocesses)")
    ap.add_argument("--json", default=None, help="append the lines to this file")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps: at least 2 (the first step is reported apart)")
    if not gpt.model_config(args.model, args.seq)[1]:
        ap.error(f"--model {args.model}: PstarTrainer trains a Hugging Face model (the Trainer writes into its "
                 "config): hf-llama/NAME, NAME one of gpt.py's LLaMA shapes (tiny, small, Llama3_8B, ...)")
    if args.device == "cpu":
        args.host_memory = None if args.host_memory == ap.get_default("host_memory") else args.host_memory
    if args.side != "both":
        gpt.emit(run_side(args.side, args), args.json)
        return
    deadline = time.monotonic() + args.timeout
    child_argv = gpt._without(argv, {"--json": True, "--in-process": False, "--timeout": True, "--side": True})
    results = {}
    for side in SIDES:
        if args.in_process:
            results[side] = run_side(side, args)
        else:
            left = deadline - time.monotonic()
            results[side] = (run_child(child_argv, side, left) if left > 10 else
                             {"side": side, "error": f"not run: --timeout {args.timeout:.0f} s spent"})
    compare(results["engine"], results["trainer"])
    for side in SIDES:
        gpt.emit(results[side], args.json)
    e, t = results["engine"], results["trainer"]
    if e.get("ratio") is not None:
        print(f"tokens/s: engine {e['tokens_per_s']:.0f}, PstarTrainer {t['tokens_per_s']:.0f}: ratio "
              f"{e['ratio']:.3f}; losses equal: {e['losses_equal']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
