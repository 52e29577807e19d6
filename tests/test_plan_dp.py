"""Planning chunk-partitioned data parallelism without launching ranks: `pstar_fx.plan(..., world=N, rank=r)`,
the rates it assumes (`costs.assumed`) and `pstar-fx plan --gpus N`. CPU, the tiny GPT, a few seconds."""
import math

import pytest
import torch
from test_engine import batch
from test_transaction import CHUNK, OPT, tiny_gpt

import pstar_fx
from pstar_fx.planning import costs
from pstar_fx.cli import main

WORLDS = (1, 2, 4)


def host_config(**cfg):
    return pstar_fx.Config(device="cpu", placement="host", chunk_size=CHUNK, optimizer=OPT, **cfg)


@pytest.fixture(scope="module")
def plans():
    """{(world, rank): Plan} of the tiny GPT with every owned chunk's state on the host."""
    model = tiny_gpt()
    return {(w, r): pstar_fx.plan(model, host_config(), batch(), world=w, rank=r) for w in WORLDS for r in range(w)}


@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_holds_exactly_the_chunks_it_owns(plans, world):
    n = len(plans[1, 0].placement)
    assert n >= 2 * max(WORLDS), "the tiny GPT must have a few chunks per rank for this test to say anything"
    for r in range(world):
        p = plans[world, r]
        assert len(p.placement) == n and p.world == world and p.rank == r
        held = [c for c, where in enumerate(p.placement) if where != "remote"]
        assert held == list(range(r, n, world)), (world, r, p.placement)
        assert all(p.placement[c] == "host" for c in held)     # placement "host": every owned chunk there
        assert all(p.owner(c) == c % world for c in range(n))
        assert p.fits, p.why


@pytest.mark.parametrize("world", WORLDS)
def test_host_chunk_state_shrinks_with_the_ranks(plans, world):
    n = len(plans[1, 0].placement)
    whole = plans[1, 0].host_breakdown["chunk state"]
    assert whole > 0
    # rank 0 owns the most chunks, ceil(n / world), in whole chunks of state
    rank0 = plans[world, 0].host_breakdown["chunk state"]
    assert rank0 * n == whole * math.ceil(n / world)
    assert plans[world, 0].device_breakdown["chunk state"] == 0
    # another rank's plan is rank 0's applied to it: its peaks may count rank 0's chunk count, never less than
    # its own or more than rank 0's
    for r in range(1, world):
        own = whole * len(range(r, n, world)) // n
        assert own <= plans[world, r].host_breakdown["chunk state"] <= rank0


def test_assumed_collective_bandwidth_reaches_the_plan():
    model = tiny_gpt()
    nominal = pstar_fx.plan(model, host_config(), batch(), world=2)
    with costs.assumed(coll_bw=1e6):       # 1 MB/s: the collectives dominate the step
        slow = pstar_fx.plan(model, host_config(), batch(), world=2)
    assert nominal.rates.coll_bw == costs.NOMINAL_COLL_BW["cpu"] and slow.rates.coll_bw == 1e6
    assert costs.calibrate(torch.device("cpu"), torch.float32).coll_bw == costs.NOMINAL_COLL_BW["cpu"]  # block over
    assert any("at a bus bandwidth of 0 GB/s" in note for note in slow.notes)
    # every chunk broadcast and reduce, 64 KiB at 1 MB/s: the step takes at least their sum
    n_coll = len(slow.placement) * 2
    assert slow.estimated_step_seconds >= n_coll * CHUNK * 4 / 2 / 1e6 * 0.99 > 10 * nominal.estimated_step_seconds
    assert slow.placement == nominal.placement
    with pytest.raises(TypeError, match="unknown rate.*coll_bw"), costs.assumed(coll_bandwidth=1e9):
        pass


def test_cli_plans_one_rank_of_several_and_says_what_each_holds(capsys):
    argv = ["plan", "--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--gpus", "2", "--batch", "2",
            "--seq", "32", "--chunk-size", str(CHUNK), "--host-memory", "1GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "batch 2 x seq 32 per rank" in out and "host_memory 1.00 GiB per rank; 2 data-parallel ranks" in out
    assert "owned by the other 1 rank(s) (rank 0 of 2" in out                 # the plan summary: rank 0's
    assert "data parallel: 2 ranks, chunks partitioned" in out
    assert "rank 0: 7 chunks" in out and "rank 1: 6 chunks" in out           # the tiny GPT: 13 chunks
    assert "predicted: 128 tokens per step (2 x 64)" in out and "tokens/s" in out and "TFLOPs" in out
    assert "collective bus 2 GB/s (nominal" in out and out.rstrip().endswith("answer: fits")
    assert main([*argv, "--coll-bw", "45"]) == 0
    assert "collective bus 45 GB/s (--coll-bw)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "tiny", "--coll-bw", "45"])
    assert e.value.code == 2 and "needs --gpus 2 or more" in capsys.readouterr().err
