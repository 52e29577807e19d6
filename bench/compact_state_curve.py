"""Loss curves with fp32 against bf16 and int8 Adam moments (Config.optimizer_state), on the CPU (issue 13 item 5).

    python bench/compact_state_curve.py [--model small] [--steps 300] [--batch 4] [--seq 128] [--lr 1e-3]
                                        [--modes fp32,bf16,int8]

Trains our GPT once per mode from the same initial weights on the same batches — byte-level tokens of this
repository's own Python sources, so the loss has something to learn — with AdamW and grad_clip 1.0, and
prints per mode the final loss, the mean of the last 50 losses, the chunk state in bytes per parameter (the
plan's) and the time per step; then, per compact mode, the largest |loss - loss_fp32| over the last 50 steps.
The compact modes run the deferred transaction (their moments cannot be undone; 1x compute, the gradients kept
until the verdict). One line RESULT {json} at the end.

Measured on the 2-core CPU box (shared with other jobs, so the s/step are not comparable between modes):
  small, 300 steps of 4x128: final loss fp32 2.9307, bf16 2.9173; mean of the last 50 2.8000 vs 2.8008;
    max |gap| over the last 50 steps 0.107 (per batch: the losses printed at step 50 agree to 4 digits, from
    step 100 the two runs differ by a few 1e-3 to 1e-2 per step, as any change of rounding makes them drift);
    12 vs 8 B/param.
  tiny (--model tiny --seq 64 --batch 8): final loss 2.5598 vs 2.5597, max |gap| over the last 50 0.0021.
  (int8: bench/RESULTS.md, 2026-12-01.)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import pstar_fx  # noqa: E402
from pstar_fx.models import GPT, gpt_config  # noqa: E402


def corpus() -> torch.Tensor:
    files = sorted(p for d in ("pstar_fx", "kernels", "models", "tests") for p in (ROOT / d).rglob("*.py"))
    data = b"".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(tokens: torch.Tensor, steps: int, batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([tokens[s: s + seq] for s in starts])
        y = torch.stack([tokens[s + 1: s + seq + 1] for s in starts])
        yield x, y


def curve(mode: str, args, tokens) -> dict:
    torch.manual_seed(0)
    model = GPT(gpt_config(args.model))
    data = list(batches(tokens, args.steps, args.batch, args.seq))
    engine = pstar_fx.compile(model, {"device": "cpu", "optimizer": {"type": "adamw", "lr": args.lr,
                                                                      "weight_decay": 0.1},
                                      "grad_clip": 1.0, "optimizer_state": mode}, data[0])
    losses, t0 = [], time.perf_counter()
    for k, (x, y) in enumerate(data):
        losses.append(float(engine.step(x, y)))
        if (k + 1) % 50 == 0:
            print(f"  {mode} step {k + 1}: loss {losses[-1]:.4f} ({(time.perf_counter() - t0) / (k + 1):.3f} s/step)",
                  flush=True)
    return {"losses": losses, "bytes_per_param": engine.plan.state_bytes_per_param,
            "transaction": engine.plan.transaction, "s_per_step": (time.perf_counter() - t0) / args.steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--modes", default="fp32,bf16,int8", help="optimizer_state values, fp32 first")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if modes[0] != "fp32":
        ap.error("--modes: fp32 comes first (the others are compared with it)")
    tokens = corpus()
    print(f"GPT {args.model}, {args.steps} steps of {args.batch}x{args.seq} byte tokens, AdamW lr {args.lr}, "
          f"grad_clip 1.0, {torch.get_num_threads()} threads (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})")
    runs = {mode: curve(mode, args, tokens) for mode in modes}
    tail = min(50, args.steps)
    gaps = {m: max(abs(a - b) for a, b in zip(runs["fp32"]["losses"][-tail:], runs[m]["losses"][-tail:]))
            for m in modes[1:]}
    means = {m: sum(r["losses"][-tail:]) / tail for m, r in runs.items()}
    for mode, r in runs.items():
        print(f"{mode}: final loss {r['losses'][-1]:.4f}, mean of the last {tail} {means[mode]:.4f}, "
              f"{r['bytes_per_param']:.3g} B/param of chunk state, transaction {r['transaction']}, "
              f"{r['s_per_step']:.3f} s/step")
    for mode, gap in gaps.items():
        print(f"max |loss_{mode} - loss_fp32| over the last {tail} steps: {gap:.4f}")
    print("RESULT " + json.dumps({"model": args.model, "steps": args.steps, "batch": args.batch, "seq": args.seq,
                                  "tail": tail, **{f"{m}_max_gap_last": g for m, g in gaps.items()},
                                  **{f"{m}_{k}": r[k] for m, r in runs.items()
                                     for k in ("bytes_per_param", "s_per_step")},
                                  **{f"{m}_mean_last": means[m] for m in runs},
                                  **{f"{m}_final_loss": r["losses"][-1] for m, r in runs.items()}}))


if __name__ == "__main__":
    main()
