"""The plan's estimate against recorded steps, re-planned on this machine at each record's rates (the cost model's
A/B without a GPU: issue 27's "estimate within 7%"). Each row: a bench/gpt.py record (file, call, setting, model,
depth, moments), planned on the meta device for CUDA (CUDA's autocast norms, bench/plan_at_rates.py) at the
record's rates, device budget and host memory, under the environment given; printed beside the record's measured
step (median of steps 2 on) and its own estimate.

    python bench/estimates_at_rates.py [--env NAME=VALUE] [--only GPT3_18B]

A plan made here is not always the box's: this machine's torch traces for the CPU (its attention, its activation
sizes), so a row's placement may differ from the recorded one (printed beside it); read such a row's estimate as the
model's, not as the box's plan. Session 30: the copies slowed beside the host Adam (the host's memory shared in
proportion to what each asks: copies 0.75x, the H200 box's limits 0.72x) moved no row's estimate by more than
0.03 s: GPT3_18B with fp32 moments's schedule hides a 1.33x slower copy, so its 0.38 s of copy waits a step on the
box come from elsewhere.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plan_at_rates  # noqa: E402

import pstar_fx  # noqa: E402
from pstar_fx.models import GPT, gpt_config  # noqa: E402
from pstar_fx.planning.costs import assumed  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# (file, call, setting or None, model, layers, moments, environment the run had)
ROWS = [
    ("2026-12-05-h200-s26.jsonl", 2, None, "GPT3_18B", 90, "fp32", {}),
    ("2026-12-05-h200-s26.jsonl", 2, None, "GPT3_18B", 99, "fp32", {}),
    ("2026-12-05-h200-s26.jsonl", 2, None, "GPT3_18B", 90, "bf16", {}),
    ("2026-12-06-h100-s29.jsonl", 2, "0-PSTAR_FX_BLOCK_SPANS_0", "GPT3_18B", 90, "bf16",
     {"PSTAR_FX_BLOCK_SPANS": "0"}),
    ("2026-12-06-h100-s29.jsonl", 2, "1-PSTAR_FX_BLOCK_SPANS_1", "GPT3_18B", 90, "bf16",
     {"PSTAR_FX_SPANS_MAY_COST": "1"}),
    ("2026-12-06-h100-s30.jsonl", 1, "1-PSTAR_FX_BLOCK_SPANS_1", "GPT_h3072_L36", 36, "fp32",
     {"PSTAR_FX_BLOCK_SPANS": "0"}),
    ("2026-12-06-h100-s30.jsonl", 3, "0-PSTAR_FX_SPANS_MAY_COST_1_PSTAR_FX_REGION_KERNELS_0", "GPT_h3072_L36", 36,
     "fp32", {"PSTAR_FX_SPANS_MAY_COST": "1"}),
]


@contextlib.contextmanager
def environment(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def record(file, call, setting, model, layers, moments):
    for line in open(os.path.join(HERE, file)):
        r = json.loads(line)
        if (r.get("call") == call and r["model"] == model and r.get("n_layer") == layers
                and r.get("optimizer_state") == moments and (setting is None or r.get("setting") == setting)
                and r.get("run") in (None, "cold")):
            return r
    raise LookupError(f"no record {file} {call} {setting} {model} {layers} {moments}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for every row's plan")
    ap.add_argument("--only", default=None, help="rows of this model only")
    a = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in a.env)
    plan_at_rates.cuda_autocast_norms()
    os.environ["PSTAR_FX_PLAN_CACHE"] = "0"
    for file, call, setting, model, layers, moments, env in ROWS:
        if a.only and model != a.only:
            continue
        r = record(file, call, setting, model, layers, moments)
        rates = {k: v for k, v in r["rates"].items() if k != "device"}
        measured = statistics.median(r["steps_s"][1:])
        with torch.device("meta"):
            net = GPT(gpt_config(model, n_layer=layers))
        idx = torch.randint(0, 50304, (16, 1024), device="meta")
        cfg = dict(device="cuda", dtype="bf16", device_memory=r["memory_stats"]["device_budget_bytes"],
                   host_memory=r["host_memory"], compute="inductor", optimizer_state=moments)
        t0 = time.perf_counter()
        with environment({**env, **extra}), assumed(**rates):
            p = pstar_fx.plan(net, cfg, example_inputs=(idx, idx))
        e = p.estimate
        by_block = any(n.startswith("planned by block") for n in p.notes)
        print(f"{file[11:-6]} call {call} {model} L{layers} {moments} {env or ''}: "
              f"{p.placement.count('device')}/{len(p.placement)} on the device (recorded "
              f"{r['placement_device_chunks']}), {p.transaction}{', by block' if by_block else ''}; estimate "
              f"{p.estimated_step_seconds:.3f} s (copies {e.copies_exposed_seconds:.3f}, host Adam "
              f"{e.host_adam_exposed_seconds:.3f}) against measured {measured:.3f}: "
              f"{p.estimated_step_seconds / measured:.3f} (recorded estimate {r['estimated_step_s']:.3f}: "
              f"{r['estimated_step_s'] / measured:.3f}) [{time.perf_counter() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
