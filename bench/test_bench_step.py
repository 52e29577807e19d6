"""The whole training step of the "small" GPT on the CPU tier, chunks moving every step, as a pytest-benchmark
regression gate: steps/s is the table's OPS column (1 / mean), and extra_info holds the bytes moved
host->device and device->host per step, the placement and the budget.

    python -m pytest bench/test_bench_step.py --benchmark-only -rs
    pstar-fx bench -k step                    # the same through the command line (README: "Guarding speed")

The CPU plays the device tier under a budget that holds the step's working set (the plan with every chunk's
state on the host) plus a quarter of the chunks' fp32 state, so most chunks live on the host and are fetched,
updated and offloaded in every step: the runtime's moves, the Adam updates and the model's ops are all in the time.
Compiling is outside the time. About 0.1 s a step on 2 cores; timings on a shared VM swing, so gate on the
mean with a generous threshold.
"""
import os

import pytest
import torch

import pstar_fx
from pstar_fx.models import GPT, gpt_config

MODEL, BATCH, SEQ = "small", 4, 64
ROUNDS = int(os.environ.get("PSTAR_BENCH_ROUNDS", "10"))
OPTIMIZER = {"type": "adamw", "lr": 1e-3, "weight_decay": 0.1}


def _moving_budget_bytes(model, inputs) -> int:
    """The device budget: the working set with every chunk on the host, plus a quarter of the chunks' state."""
    on_host = pstar_fx.plan(model, pstar_fx.Config(device="cpu", placement="host"), inputs)
    n_chunks = len(on_host.placement)
    chunk_state_bytes = on_host.host_breakdown["chunk state"] // n_chunks
    return on_host.device_peak_bytes + n_chunks // 4 * chunk_state_bytes


@pytest.fixture(scope="module")
def engine_and_batch():
    torch.manual_seed(0)
    model = GPT(gpt_config(MODEL))
    gen = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=gen) for _ in range(2))
    budget = _moving_budget_bytes(model, batch)
    engine = pstar_fx.compile(model, {"device": "cpu", "device_memory": budget, "optimizer": OPTIMIZER}, batch)
    return engine, batch, budget


def test_step_gpt_small_cpu_tier(benchmark, engine_and_batch):
    engine, batch, budget = engine_and_batch
    placement = engine.plan.placement
    assert "host" in placement, placement              # the budget must make chunks move, or this measures nothing
    before = engine.memory_stats()
    benchmark.pedantic(engine.step, args=batch, rounds=ROUNDS, warmup_rounds=2, iterations=1)
    engine.drain()
    after = engine.memory_stats()
    steps = after["steps"] - before["steps"]           # warm-up rounds included: they moved bytes too
    h2d, d2h = ((after[k] - before[k]) // steps for k in ("h2d_bytes", "d2h_bytes"))
    assert h2d > 0 and d2h > 0
    benchmark.extra_info.update(model=MODEL, batch=BATCH, seq=SEQ, device_budget_bytes=budget,
                                chunks=len(placement), host_chunks=placement.count("host"),
                                h2d_bytes_per_step=h2d, d2h_bytes_per_step=d2h, threads=torch.get_num_threads())
    stats = getattr(benchmark, "stats", None)
    if stats is not None and getattr(stats, "stats", None) is not None:  # absent under --benchmark-disable
        mean = stats.stats.mean
        benchmark.extra_info.update(steps_per_s=round(1 / mean, 3), tokens_per_s=round(BATCH * SEQ / mean))
        print(f"\nGPT {MODEL!r} step, batch {BATCH} x {SEQ}, {placement.count('host')} of {len(placement)} chunks on "
              f"the host: {mean * 1e3:.1f} ms ({1 / mean:.2f} steps/s); moved per step: host->device "
              f"{h2d / 2**20:.2f} MiB, device->host {d2h / 2**20:.2f} MiB")
