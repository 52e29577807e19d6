"""Where the plan's memory model and the CUDA allocator disagree, op by op.

    python bench/peak_probe.py [--model GPT2small] [--placement host] [--batch 8] [--seq 512]

Compiles the model, then runs one step node by node. After each node it records the allocator's bytes
(torch.cuda.memory_allocated, less what was allocated before the step: chunk pools and inputs) and the
plan's predicted live bytes of graph values at that node (plan.activation_profile on the lowered graph).
Prints both peaks and the nodes where the prediction grows most beyond the measurement.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.fx as fx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pstar_fx  # noqa: E402
from pstar_fx.fxutil import role_nodes  # noqa: E402
from pstar_fx.models import GPT, gpt_config  # noqa: E402
from pstar_fx.planning import CUDA_BLOCK_BYTES, activation_profile, last_uses  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="GPT2small")
    ap.add_argument("--placement", default="host")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = gpt_config(args.model, block_size=args.seq)
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
    engine = pstar_fx.compile(model, {"device": "cuda", "dtype": "bf16", "placement": args.placement}, (idx, idx))
    engine.step(idx, idx)
    torch.cuda.synchronize()
    gm = engine.graph
    g = gm.graph
    skip = set(role_nodes(g, "rt")) | set(role_nodes(g, "buffer")) | {n for n in g.nodes if n.op == "call_method"}
    predicted, _ = activation_profile(g, skip, round_to=CUDA_BLOCK_BYTES)

    rt = engine.rt
    measured, names = [], []

    def run_measured(inputs, tangent):
        """The step's graph run node by node (the engine's own step drives it: the transaction is real)."""
        args_ = [rt, *engine._buffers, *inputs, tangent.to("cuda")]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        env: dict[fx.Node, object] = {}
        frees = last_uses(g)
        it = iter(args_)
        loss = None
        for n in g.nodes:
            load = lambda a: fx.node.map_arg(a, lambda x: env[x])  # noqa: E731
            if n.op == "placeholder":
                env[n] = next(it)
            elif n.op == "call_function":
                env[n] = n.target(*load(n.args), **load(n.kwargs))
            elif n.op == "call_method":
                obj, *rest = load(n.args)
                env[n] = getattr(obj, n.target)(*rest, **load(n.kwargs))
            else:
                loss = load(n.args[0])[0].detach()
                break
            measured.append(torch.cuda.memory_allocated() - base)
            names.append(n)
            for v in frees.get(n, []):
                env.pop(v, None)
            if n.op != "placeholder" and not n.users:
                env.pop(n, None)
        env.clear()
        return loss

    engine.stepper._run = run_measured
    engine.step(idx, idx)
    pred = predicted[: len(measured)]
    i_m = max(range(len(measured)), key=measured.__getitem__)
    i_p = max(range(len(pred)), key=pred.__getitem__)
    gib = 2**30
    print(f"measured peak of graph values {measured[i_m] / gib:.3f} GiB at {names[i_m].name}; "
          f"predicted {pred[i_p] / gib:.3f} GiB at {names[i_p].name}; predicted at the measured peak "
          f"{pred[i_m] / gib:.3f} GiB")
    diff = [p - m for p, m in zip(pred, measured)]
    jumps = sorted(range(1, len(diff)), key=lambda i: diff[i] - diff[i - 1], reverse=True)[:25]
    print("nodes where the prediction grows beyond the allocator (MiB of growth, op, output shape/dtype):")
    for i in sorted(jumps):
        n = names[i]
        v = n.meta.get("val")
        desc = (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else type(v).__name__
        print(f"  {(diff[i] - diff[i - 1]) / 2**20:9.1f}  {n.name:40s} {str(n.target)[:60]:60s} {desc}")
    drops = sorted(range(1, len(diff)), key=lambda i: diff[i] - diff[i - 1])[:10]
    print("nodes where the allocator grows beyond the prediction:")
    for i in sorted(drops):
        n = names[i]
        print(f"  {(diff[i] - diff[i - 1]) / 2**20:9.1f}  {n.name:40s} {str(n.target)[:60]}")


if __name__ == "__main__":
    main()
