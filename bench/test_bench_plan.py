"""Planning time and memory, as a pytest-benchmark regression gate: a mid-size problem in several rounds
(a mean to compare), and big models once each.

    python -m pytest bench/test_bench_plan.py --benchmark-only [--benchmark-compare-fail=median:50%]

The issue's bar: GPT_175B plans in <= 60 s with <= 6 GiB peak RSS on the 2-core, 24 GiB development
machine, says it does not fit one H200 + 126 GiB host, and accounts >= 12 B/param.
"""
import resource

import torch

import pstar_fx
from pstar_fx.models import GPT, gpt_config, num_params

H200_BOX = {"device": "cuda", "device_memory": "141GB", "host_memory": "126GiB", "dtype": "bf16"}


def _plan(name, batch=8, seq=1024, box=H200_BOX):
    with torch.device("meta"):
        model = GPT(gpt_config(name))
        inputs = (torch.zeros(batch, seq, dtype=torch.long), torch.zeros(batch, seq, dtype=torch.long))
    return pstar_fx.plan(model, box, inputs)


def test_plan_gpt_small_tight_gpu(benchmark):
    """The whole planner in about a second: capture, layout, the recompute search and placement, for "small"
    at batch 16 x 256 on a 100 MiB GPU (meta, no GPU needed), where the activations need recompute and most
    chunks' state goes to the host."""
    box = {**H200_BOX, "device_memory": "100MiB"}
    plan = benchmark.pedantic(_plan, args=("small", 16, 256, box), rounds=3, warmup_rounds=1, iterations=1)
    benchmark.extra_info.update(chunks=len(plan.placement), host_chunks=plan.placement.count("host"),
                                recompute=str(plan.recompute))
    assert plan.fits and "host" in plan.placement, plan.summary()


def test_plan_gpt_175b(benchmark):
    plan = benchmark.pedantic(_plan, args=("GPT_175B",), rounds=1, iterations=1)
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    state = plan.device_breakdown["chunk state"] + plan.host_breakdown["chunk state"]
    per_param = state / num_params(gpt_config("GPT_175B"))
    benchmark.extra_info.update(max_rss_gib=round(rss_gib, 2), state_bytes_per_param=round(per_param, 2),
                                fits=plan.fits)
    assert not plan.fits and "host_memory is too small" in plan.why     # (2.1 TB of state for 126 GiB)
    assert per_param >= 12
    assert rss_gib <= 6
    assert benchmark.stats.stats.max <= 60


def test_plan_gpt3_10b(benchmark):
    plan = benchmark.pedantic(_plan, args=("GPT3_10B",), rounds=1, iterations=1)
    assert plan.fits, plan.summary()
