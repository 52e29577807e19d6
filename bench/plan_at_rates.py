"""Plan h4096 GPTs (GPT3_18B's shape, any depth) on the meta device at the H200 rates measured on the GPU, from a
machine without one: what fits one H200 box, and the step the cost model estimates.

    python bench/plan_at_rates.py 108,fp32,transaction=replay,host_memory=116GiB 148,int8
    python bench/plan_at_rates.py --cuda-autocast --rates-from bench/results/2026-12-05-h200-s20.jsonl 148,int8

Each argument: LAYERS,OPTIMIZER_STATE[,CONFIG_KEY=VALUE...] (Config fields; strings as written), and
rates.FIELD=FLOAT for a rate other than the H200's below, e.g. 90,bf16,rates.host_adam_bf16=5.5e9.
`--rates-from FILE.jsonl`: the rates the file's bench/gpt.py record of GPT3_18B's shape nearest that depth was
planned at.
`--cuda-autocast`: layer norms run in fp32, as CUDA's autocast runs them (a CPU-only torch traces on the CPU, whose
autocast keeps them in bf16): the graph then holds CUDA's casts and fp32 norm outputs, as the box's does (the 30.0B
int8 plan's cheap values: 1039 here, 1040 on the box; its activations 3 GiB under the box's, whose attention is
cuDNN's).
"""
import sys
import time

import torch

import pstar_fx
from pstar_fx.planning.costs import assumed
from pstar_fx.models import GPT, gpt_config

# calibrated on the lent H200 (RESULTS, session 6): matmul rate, HBM, PCIe each way, host Adam by moments; the host
# correction at session 9's ratio to the host Adam (bench/host_undo_bench.py: 0.96x, 5.21 G params/s at 16 threads)
H200 = dict(flops=561.2e12, mem_bw=3.73e12, h2d_bw=53.8e9, d2h_bw=54.2e9, host_adam=5.82e9, host_adam_bf16=7.28e9,
            host_adam_int8=4.15e9, workspace_bytes=34603008, host_undo=0.96 * 5.82e9)
BOX = dict(device="cuda", dtype="bf16", device_memory=149553283072, host_memory="110GiB", compute="inductor")


def plan(layers: int, state: str, rates: dict | None = None, **overrides):
    with torch.device("meta"):
        model = GPT(gpt_config("GPT3_18B", n_layer=layers))
    n = sum(p.numel() for p in model.parameters())
    idx = torch.randint(0, 50304, (16, 1024), device="meta")
    t0 = time.perf_counter()
    with assumed(**{**H200, **(rates or {})}):
        p = pstar_fx.plan(model, dict(BOX, optimizer_state=state, **overrides), example_inputs=(idx, idx))
    est = p.estimated_step_seconds
    gib = 2**30
    print(f"L{layers} {n / 1e9:.2f}B {state} {overrides}: fits={not p.why} estimated {est:.3f} s, "
          f"{6 * n * 16384 / est / 1e12:.0f} TFLOPs; {p.placement.count('device')}/{len(p.placement)} chunks on the "
          f"device (host chunks: {p.chunks.host_order}), {p.transaction}, "
          f"device peak {p.device_peak_bytes / gib:.1f} GiB, host "
          f"{p.host_peak_bytes / gib:.1f} GiB ({time.perf_counter() - t0:.0f} s to plan)\n  recompute: {p.recompute}"
          + (f"\n  why: {p.why}" if p.why else ""), flush=True)
    return p


def _value(text: str):
    """A Config value as written: a number where it reads as one (grad_clip=1.0), else the string."""
    try:
        return int(text) if text.lstrip("-").isdigit() else float(text)
    except ValueError:
        return text


def cuda_autocast_norms() -> None:
    """nn.LayerNorm computes in fp32 on an fp32 copy of its input and parameters, as under CUDA's autocast."""
    import torch.nn as nn
    import torch.nn.functional as F

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)
    nn.LayerNorm.forward = forward


def recorded_rates(path: str, layers: int) -> dict:
    """The rates of a bench/gpt.py record of GPT3_18B's shape in `path` nearest `layers` layers deep."""
    import json
    with open(path) as f:
        records = [r for r in map(json.loads, f) if r.get("rates") and r.get("model") == "GPT3_18B"]
    record = min(records, key=lambda r: abs(r.get("n_layer", 0) - layers))
    return {k: v for k, v in record["rates"].items() if k != "device"}


if __name__ == "__main__":
    args, rates_from = sys.argv[1:], None
    if "--cuda-autocast" in args:
        args.remove("--cuda-autocast")
        cuda_autocast_norms()
    if "--rates-from" in args:
        i = args.index("--rates-from")
        rates_from = args[i + 1]
        del args[i:i + 2]
    for arg in args:
        layers, state, *rest = arg.split(",")
        fields = {k: _value(v) for k, v in (r.split("=", 1) for r in rest)}
        rates = recorded_rates(rates_from, int(layers)) if rates_from else {}
        rates |= {k.removeprefix("rates."): float(fields.pop(k)) for k in list(fields) if k.startswith("rates.")}
        plan(int(layers), state, rates, **fields)
