"""Measured against predicted GPU peak for small models (issue 11: 608 MiB measured, 367 MiB predicted for the
small GPT), and where the allocator's bytes at the peak come from.

    python bench/small_peak.py [--snapshot DIR]

For each case: compile on CUDA (all state on the device), 3 steps; measured = torch.cuda.max_memory_allocated
above what was allocated before compile; predicted = plan.device_peak_bytes. With --snapshot, the first
case's allocations are recorded (torch.cuda.memory._record_memory_history) and dumped for offline reading.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pstar_fx  # noqa: E402
from pstar_fx.models import GPT, Llama, gpt_config, llama_config  # noqa: E402

CASES = [("gpt", "small", "fp32", 8, 128), ("gpt", "tiny", "fp32", 8, 64), ("gpt", "small", "bf16", 8, 256),
         ("llama", "small", "bf16", 8, 256), ("gpt", "GPT2small", "bf16", 8, 128), ("gpt", "GPT2small", "bf16", 8, 512)]


def run(family, name, dtype, batch, seq, snapshot=None):
    cfg = (gpt_config if family == "gpt" else llama_config)(name, block_size=seq)
    torch.manual_seed(0)
    model = (GPT if family == "gpt" else Llama)(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200000)
    engine = pstar_fx.compile(model, {"device": "cuda", "dtype": dtype, "optimizer": {"lr": 1e-3}}, (idx, idx))
    after_compile = torch.cuda.max_memory_allocated() - base
    for _ in range(3):
        engine.step(idx, idx)
    torch.cuda.synchronize()
    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    measured = torch.cuda.max_memory_allocated() - base
    p = engine.plan
    out = {"case": f"{family}:{name}:{dtype}:{batch}x{seq}", "measured": measured, "predicted": p.device_peak_bytes,
           "ratio": round(measured / p.device_peak_bytes, 3), "after_compile_peak": after_compile,
           "breakdown": p.device_breakdown, "chunks": len(p.placement), "chunk_size": engine.lowered.layout.chunk_size,
           "memory_stats_peak": engine.memory_stats()["device_peak_bytes"], "base": base}
    del engine
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--snapshot", default=None, help="a directory for the first case's memory snapshot")
    ap.add_argument("--cases", default=None, help="comma-separated family:name:dtype:BxT (default: all)")
    args = ap.parse_args()
    cases = CASES
    if args.cases:
        cases = [(f, n, d, int(bt.split("x")[0]), int(bt.split("x")[1]))
                 for f, n, d, bt in (c.split(":") for c in args.cases.split(","))]
    for k, case in enumerate(cases):
        snap = os.path.join(args.snapshot, "snapshot.pickle") if (args.snapshot and k == 0) else None
        try:
            print("RESULT " + json.dumps(run(*case, snapshot=snap)), flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            print("RESULT " + json.dumps({"case": str(case), "error": f"{type(e).__name__}: {e}"[:500]}), flush=True)


if __name__ == "__main__":
    main()
