"""bench/gpt.py's pstar_fx step on one GPU as a pytest-benchmark case (marked gpu; skipped, saying so, without
CUDA). The model is built on meta and compiled by bench/gpt.py's own `pstar_system`, as
`python bench/gpt.py --system pstar_fx` does (bf16, the GPU's free memory as the device budget, AdamW); each
round is one step up to its loss read as a number, alternating its two random batches — steps back to back, as
gpt.py times them (the device work a step leaves to overlap the next forward runs in the next round) — so the
table's mean is gpt.py's step_s and a saved baseline gates it like the CPU cases. Compiling is outside the time;
extra_info holds the compile's fields (predicted peaks, placement, recompute), tflops, the measured GPU peak and bytes moved per step.

    pstar-fx bench --gpu [--save NAME | --compare NAME --fail 10]          # on the GPU machine
    python -m pytest bench/test_bench_gpu.py --benchmark-only -rs          # the same, by hand
    PSTAR_BENCH_GPU_MODEL=GPT3_10B PSTAR_BENCH_GPU_BATCH=16 pstar-fx bench --gpu    # another model

Default: GPT_h3072_L36 (4.2B), batch 16 x 1024, host_memory 110GiB (gpu_run.sh's): the README's first row
(0.80 s a step on an H200, compile about 6 s). 2 warm-up steps (gpt.py's median skips the first two), then
PSTAR_BENCH_GPU_ROUNDS (default 6).
"""
import argparse
import importlib.util
import os
import sys

import pytest
import torch

from pstar_fx.models import gpt_config, num_params

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (run on the GPU machine: pstar-fx bench --gpu); this machine has none")]

MODEL = os.environ.get("PSTAR_BENCH_GPU_MODEL", "GPT_h3072_L36")
BATCH = int(os.environ.get("PSTAR_BENCH_GPU_BATCH", "16"))
SEQ = int(os.environ.get("PSTAR_BENCH_GPU_SEQ", "1024"))
HOST_MEMORY = os.environ.get("PSTAR_BENCH_GPU_HOST_MEMORY", "110GiB")
ROUNDS = int(os.environ.get("PSTAR_BENCH_GPU_ROUNDS", "6"))
DEVICE = "cuda"


def _bench_gpt():
    """bench/gpt.py as a module (it is a script, not part of the package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt.py")
    spec = importlib.util.spec_from_file_location("bench_gpt", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpt"] = module
    spec.loader.exec_module(module)
    return module


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.fixture(scope="module")
def gpt_step():
    gpt = _bench_gpt()
    cfg = gpt_config(MODEL, block_size=SEQ)
    # the flags pstar_system reads, at bench/gpt.py's defaults (no clipping, no schedule, one micro-batch)
    args = argparse.Namespace(hf=False, clip_sweep=None, grad_clip=None, host_memory=HOST_MEMORY, device_memory=None,
                              lr=1e-4, grad_accum=1, lr_schedule=None, transaction="auto")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    batches = [tuple(torch.randint(0, cfg.vocab_size, (BATCH, SEQ), device=DEVICE, generator=gen) for _ in range(2))
               for _ in range(2)]
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step, extra, engine = gpt.pstar_system(cfg, args, batches[0])
    yield step, extra, engine, batches, cfg
    del step, engine
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def test_gpu_step_bench_gpt(benchmark, gpt_step):
    step, extra, engine, batches, cfg = gpt_step
    params = num_params(cfg)
    calls = iter(range(10**9))

    def next_batch():
        return batches[next(calls) % 2], {}

    def one_step(idx, tgt):
        float(step(idx, tgt))

    _sync()
    before = engine.memory_stats()
    benchmark.pedantic(one_step, setup=next_batch, rounds=ROUNDS, warmup_rounds=2, iterations=1)
    _sync()
    engine.drain()
    after = engine.memory_stats()
    steps = max(1, after["steps"] - before["steps"])
    tokens = BATCH * SEQ
    benchmark.extra_info.update(
        model=MODEL, batch=BATCH, seq=SEQ, params=params, tokens=tokens, **extra,
        gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else None,
        gpu_peak_bytes=after["device_peak_bytes"],
        h2d_bytes_per_step=(after["h2d_bytes"] - before["h2d_bytes"]) // steps,
        d2h_bytes_per_step=(after["d2h_bytes"] - before["d2h_bytes"]) // steps)
    stats = getattr(benchmark, "stats", None)
    if stats is not None and getattr(stats, "stats", None) is not None:  # absent under --benchmark-disable
        mean = stats.stats.mean
        tflops = 6 * params * tokens / mean / 1e12
        benchmark.extra_info.update(step_s=round(mean, 4), tflops=round(tflops, 1))
        print(f"\nbench/gpt.py step, GPT {MODEL} batch {BATCH} x {SEQ}: {mean:.3f} s ({tflops:.0f} TFLOPs, "
              f"6 * params * tokens); GPU peak {after['device_peak_bytes'] / 2**30:.1f} GiB; compile "
              f"{extra['compile_s']} s")
