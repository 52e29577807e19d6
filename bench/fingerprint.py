"""Fingerprints of a few fixed-seed CPU runs: the lowered graph's code, the plan's text and every chunk's final
state (fp32 masters and moments) after a few steps, each as a sha256.

A refactor that must change no result records them before (`--record FILE`) and checks after (`--check FILE`).
The figures are bits of floating-point results, so they hold only on one machine and one SIMD level: the file
records the machine's CPU capability, and a check on another refuses to compare.

    python bench/fingerprint.py --record bench/results/fingerprint-cf02e0f.json
    python bench/fingerprint.py --check bench/results/fingerprint-cf02e0f.json

Recorded: `fingerprint-cf02e0f.json` (before the house step) and `fingerprint-house.json` (after it, with the
triggered-step estimate in the clipped runs' plan text: the only field that differs between the two).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import pstar_fx  # noqa: E402
import pstar_fx.passes.compile_regions  # noqa: E402,F401
from pstar_fx.models import GPT, Llama, gpt_config, llama_config  # noqa: E402

CHUNK = 16384
OPT = {"type": "adamw", "lr": 3e-3, "weight_decay": 0.1}
STEPS = 3

# name -> (model, config): each a different transaction, dtype or planner decision
RUNS = {
    "fp32_kept_grads_clip": ("gpt", {"grad_clip": 0.05, "transaction": "kept_grads"}),
    "fp32_replay_clip": ("gpt", {"grad_clip": 0.05, "transaction": "replay"}),
    "fp32_two_pass_clip": ("gpt", {"grad_clip": 0.05, "transaction": "two_pass"}),
    "fp32_none": ("gpt", {"transaction": "none"}),
    "fp32_accumulate_cosine": ("gpt", {"grad_accum": 2, "grad_clip": 0.05,
                                       "lr_schedule": {"type": "cosine", "warmup_steps": 1, "total_steps": 5}}),
    "bf16_deferred_bf16_moments": ("gpt", {"dtype": "bf16", "optimizer_state": "bf16", "grad_clip": 0.05}),
    "bf16_int8_moments": ("gpt", {"dtype": "bf16", "optimizer_state": "int8"}),
    "llama_recompute": ("llama", {"device_memory": "1400KiB"}),
    "llama_segments": ("llama", {"device_memory": "600KiB"}),            # cheap values, then forward segments
    "bf16_regions": ("llama", {"dtype": "bf16", "compute": "inductor"}),   # regions built by Dynamo alone
}


def model_of(kind: str) -> tuple[torch.nn.Module, int, int]:
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(gpt_config("tiny")), 256, 32
    return Llama(llama_config("tiny")), 256, 32


def batches(vocab: int, seq: int, n: int, accum: int):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (2 * accum, seq + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def sha(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, torch.Tensor):
            h.update(p.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        else:
            h.update(str(p).encode())
    return h.hexdigest()[:16]


def run(name: str) -> dict:
    kind, extra = RUNS[name]
    sys.modules["pstar_fx.passes.compile_regions"].BACKEND = "eager"    # Dynamo alone: the same ops, no build
    model, vocab, seq = model_of(kind)
    accum = extra.get("grad_accum", 1)
    data = batches(vocab, seq, STEPS, accum)
    config = {"device": "cpu", "chunk_size": CHUNK, "optimizer": OPT, "placement": "auto",
              "device_memory": "600KiB", "seed": 0, **extra}
    small = tuple(t[: t.shape[0] // accum] for t in data[0])
    engine = pstar_fx.compile(model, config, example_inputs=small)
    losses = [float(engine.step(*b)) for b in data]
    engine.drain()
    store = engine.rt.store
    state = [t for c in range(len(store.master)) if store.holds(c)
             for t in (store.master[c], store.exp_avg[c], store.exp_avg_sq[c])]
    return {"graph": sha(engine.graph.code), "plan": sha(engine.plan.summary()), "recompute": engine.plan.recompute,
            "placement": "".join(p[0] for p in engine.plan.placement), "transaction": engine.plan.transaction,
            "losses": [f"{x:.9g}" for x in losses], "state": sha(*state)}


def machine() -> str:
    return torch.backends.cpu.get_cpu_capability()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--record", metavar="FILE")
    g.add_argument("--check", metavar="FILE")
    p.add_argument("--only", nargs="*", default=None, help="run these names alone")
    args = p.parse_args()
    names = args.only or list(RUNS)
    if args.check:
        with open(args.check) as f:
            recorded = json.load(f)
        if recorded["cpu_capability"] != machine():
            print(f"recorded at CPU capability {recorded['cpu_capability']}, this machine is {machine()}: "
                  "bits are comparable only at one level", file=sys.stderr)
            return 2
    out, bad = {}, []
    for name in names:
        out[name] = got = run(name)
        if args.check:
            want = recorded["runs"][name]
            diff = [k for k in want if want[k] != got.get(k)]
            print(f"{name}: {'identical' if not diff else 'DIFFERS in ' + ', '.join(diff)}", flush=True)
            if diff:
                bad.append(name)
                for k in diff:
                    print(f"    {k}: recorded {want[k]}  now {got.get(k)}")
        else:
            print(f"{name}: {got}", flush=True)
    if args.record:
        with open(args.record, "w") as f:
            json.dump({"cpu_capability": machine(), "torch": torch.__version__, "runs": out}, f, indent=1)
            f.write("\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
