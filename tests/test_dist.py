"""Data parallelism on the CPU with gloo: N processes started by the test, each its share of the batch, equal one
process (torch.optim.AdamW) training on the whole batch as N micro-batches of loss / N."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from test_engine import assert_losses_close, assert_weights_close
from test_transaction import OPT, gpt_batches, reference, tiny_gpt

HERE = os.path.dirname(os.path.abspath(__file__))

_RANK = r"""
import json, os, sys, torch
sys.path.insert(0, sys.argv[1])
import pstar_fx
from test_transaction import OPT, gpt_batches, tiny_gpt
out, steps, clip, accum = sys.argv[2], int(sys.argv[3]), float(sys.argv[4]) or None, int(sys.argv[5])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
mine = [tuple(x.chunk(world)[rank] for x in whole) for whole in gpt_batches(steps, accum=world * accum)]
engine = pstar_fx.compile(tiny_gpt(), {"device": "cpu", "placement": "host", "chunk_size": 16384, "optimizer": OPT,
                                       "grad_clip": clip, "grad_accum": accum, "dist_timeout": 60},
                          tuple(x[: x.shape[0] // accum] for x in mine[0]))
assert "all_reduce" in engine.graph.code
if os.environ.get("DIE_AT_RANK") == str(rank):
    os._exit(3)                                      # a rank that dies before its first step
reports = []
for b in mine:
    engine.step(*b)
    r = engine.last_step
    reports.append([r.loss, r.grad_norm])
torch.save(engine.state_dict(), f"{out}.{rank}.pt")
json.dump(reports, open(f"{out}.{rank}.json", "w"))
if os.environ.get("SAVE_TO"):
    engine.save(os.environ["SAVE_TO"])             # collective: rank 0 writes, every rank waits for it
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, out: str, steps: int, clip: float | None, accum: int, timeout: int = 240, extra_env=None,
            check=True):
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, "-c", _RANK, HERE, out, str(steps), str(clip or 0), str(accum)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    errors, results = [], []
    for rank, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append((p.returncode, err))
        if p.returncode:
            errors.append(f"rank {rank} exited {p.returncode}: {err[-2000:]}")
    if check:
        assert not errors, "\n".join(errors)
    return results


@pytest.mark.parametrize("world,clip,accum", [(2, None, 1), (2, 0.05, 1), (2, 0.05, 2), (4, 0.05, 1)])
def test_replicated_ranks_equal_one_process_on_the_whole_batch(tmp_path, world, clip, accum):
    steps = 3
    out = str(tmp_path / "run")
    _launch(world, out, steps, clip, accum)
    ref, _, ref_out = reference(tiny_gpt(), gpt_batches(steps, accum=world * accum), grad_clip=clip,
                                accum=world * accum)
    sds = [torch.load(f"{out}.{r}.pt") for r in range(world)]
    reports = [json.load(open(f"{out}.{r}.json")) for r in range(world)]
    for r in range(1, world):                        # every rank holds the same model, bit for bit
        assert reports[r] == reports[0]
        assert all(torch.equal(sds[r][k], sds[0][k]) for k in sds[0])
    assert_losses_close([x[0] for x in reports[0]], [o[0] for o in ref_out], ref.__dict__["float64_truth"][2])
    if clip is not None:
        assert all(o[1] > clip for o in ref_out)     # clipping triggered on every step
        torch.testing.assert_close(torch.tensor([x[1] for x in reports[0]]), torch.tensor([o[1] for o in ref_out]),
                                   rtol=1e-5, atol=0)
    assert_weights_close(sds[0], ref)


def test_chunked_data_parallel_is_said_to_be_missing(tmp_path, monkeypatch):
    """Not built yet: asking for it is an error that says so, not a silent fallback."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    idx = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="chunked"):
        import pstar_fx
        pstar_fx.compile(tiny_gpt(), {"device": "cpu", "data_parallel": "chunked"}, (idx, idx))


def test_a_dead_rank_ends_the_others_with_an_error(tmp_path):
    """Rank 1 dies after compiling; rank 0's first collective fails (within dist_timeout), it does not hang."""
    import time
    t0 = time.monotonic()
    results = _launch(2, str(tmp_path / "run"), 2, None, 1, timeout=120, extra_env={"DIE_AT_RANK": "1"},
                      check=False)
    assert results[1][0] == 3
    assert results[0][0] != 0, "rank 0 finished although rank 1 died"
    assert "Error" in results[0][1], results[0][1][-2000:]
    assert time.monotonic() - t0 < 110


def test_a_checkpoint_saved_at_two_ranks_loads_in_one_process(tmp_path):
    import pstar_fx
    from pstar_fx.checkpoint import OPTIMIZER
    from safetensors.torch import load_file
    out, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    _launch(2, out, 2, 0.05, 1, extra_env={"SAVE_TO": ckpt})
    saved = torch.load(f"{out}.0.pt")
    x = gpt_batches(1)[0]
    one = pstar_fx.compile(tiny_gpt(), {"device": "cpu", "chunk_size": 32768, "optimizer": OPT, "grad_clip": 0.05},
                           x, resume=ckpt)
    assert one.steps == 2
    sd = one.state_dict()
    assert all(torch.equal(sd[k], saved[k]) for k in saved)
    moments = load_file(os.path.join(ckpt, OPTIMIZER))
    store = one.rt.store
    for i, p in enumerate(one.lowered.capture.params):
        slot = store.layout.slots[i]
        got = store.exp_avg[slot.chunk][slot.offset: slot.offset + slot.numel].view(p.shape)
        assert torch.equal(got, moments[f"{p.name}.exp_avg"]), p.name


def test_cli_nproc_trains_like_one_process_on_the_whole_batch(tmp_path):
    """`pstar-fx train --nproc 2` (torchrun, gloo): 2 ranks of --batch 2 print what one process of --batch 4 does."""
    import re

    def run(*extra):
        out = subprocess.run([sys.executable, "-m", "pstar_fx.cli", "train", "--model", "tiny", "--steps", "3",
                              "--log-every", "1", "--device", "cpu", "--seq", "32", *extra], capture_output=True,
                             text=True, timeout=240, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert out.returncode == 0, out.stderr[-3000:]
        return [(float(a), float(b)) for a, b in re.findall(r"^step +\d+ +loss ([\d.]+) .* grad norm ([\d.]+)",
                                                              out.stdout, re.M)], out.stdout
    dp, text = run("--batch", "2", "--nproc", "2")
    one, _ = run("--batch", "4")
    assert "2 ranks of 64" in text and len(dp) == 3
    assert text.count("done: 3 steps") == 1                  # one rank reports
    torch.testing.assert_close(torch.tensor(dp), torch.tensor(one), rtol=2e-4, atol=0)   # 4 printed digits
