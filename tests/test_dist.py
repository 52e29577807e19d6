"""Data parallelism on the CPU with gloo: N processes started by the test, each its share of the batch, equal one
process (torch.optim.AdamW) training on the whole batch as N micro-batches of loss / N; chunk-partitioned
(each rank holding 1/N of the chunks' state) and replicated."""
import copy
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import pstar_fx

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
mode, first = os.environ.get("DP", "chunked"), int(os.environ.get("FIRST_STEP", 0))
whole_batches = gpt_batches(first + steps, accum=int(os.environ.get("WHOLE", world * accum)))
mine = [tuple(x.chunk(world)[rank] for x in whole) for whole in whole_batches][first:]
config = {"device": os.environ.get("DEVICE", "cpu"), "placement": "host", "chunk_size": 16384, "optimizer": OPT,
          "grad_clip": clip, "grad_accum": accum, "dist_timeout": 60, "data_parallel": mode}
if os.environ.get("TRANSACTION"):
    config["transaction"] = os.environ["TRANSACTION"]
if os.environ.get("REGIONS"):                    # compiled regions, built by this torch.compile backend
    import pstar_fx.passes.compile_regions
    sys.modules["pstar_fx.passes.compile_regions"].BACKEND = os.environ["REGIONS"]
    config["compute"] = "inductor"
if os.environ.get("DEVICE_MEMORY"):              # some chunks on the CPU playing the device tier, some on the host
    config.update(placement="auto", device_memory=int(os.environ["DEVICE_MEMORY"]))
engine = pstar_fx.compile(tiny_gpt(), config, tuple(x[: x.shape[0] // accum] for x in mine[0]),
                          resume=os.environ.get("LOAD_FROM") or None)
assert ("rt.reduce(" if mode == "chunked" else "all_reduce") in engine.graph.code
placement = engine.plan.placement
if mode == "chunked":                            # this rank holds its own chunks' state, and only those
    assert all((p == "remote") == (c % world != rank) for c, p in enumerate(placement)), placement
if os.environ.get("SAVE_FIRST"):
    engine.save(os.environ["SAVE_FIRST"])            # what was loaded, written again at this world size
if os.environ.get("DIE_AT_RANK") == str(rank):
    os._exit(3)                                      # a rank that dies before its first step
reports = []
for b in mine:
    engine.step(*b)
    r = engine.last_step
    reports.append([r.loss, r.grad_norm])
evaluated = float(engine.evaluate(*mine[0])) if os.environ.get("EVAL") else None   # collective when chunked
torch.save(engine.state_dict(), f"{out}.{rank}.pt")   # collective when chunked: every rank gets the whole model
json.dump({"reports": reports, "placement": placement, "steps": engine.steps, "evaluated": evaluated,
           "state_bytes": engine.rt.stats.host_bytes + engine.rt.stats.device_bytes}, open(f"{out}.{rank}.json", "w"))
if os.environ.get("SAVE_TO"):
    engine.save(os.environ["SAVE_TO"])               # collective: each rank writes its own chunks (replicated: rank 0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, out: str, steps: int = 0, clip: float | None = None, accum: int = 1, timeout: int = 240,
            extra_env=None, check=True, mode="chunked", script=None):
    """`world` processes of `script` (default _RANK, given out, steps, clip, accum) as ranks of one gloo group."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", DP=mode)
        env.update(extra_env or {})
        argv = [HERE, out] if script else [HERE, out, str(steps), str(clip or 0), str(accum)]
        procs.append(subprocess.Popen([sys.executable, "-c", script or _RANK, *argv],
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


def _results(out: str, world: int):
    return ([torch.load(f"{out}.{r}.pt") for r in range(world)],
            [json.load(open(f"{out}.{r}.json")) for r in range(world)])


# (clipping with the plan's transaction at 2 ranks is the "mixed" case; 4 ranks: the checkpoint test below)
CASES = [("chunked", 2, None, 1, None), ("chunked", 2, 0.05, 2, None), ("chunked", 2, 0.05, 1, "mixed"),
         ("replicated", 2, 0.05, 1, None), ("chunked", 2, 0.05, 1, "replay"), ("chunked", 2, 0.05, 1, "two_pass"),
         ("replicated", 2, 0.05, 2, None)]


def assert_ranks_agree(sds, runs, mode: str) -> None:
    """Every rank holds (or gathers) the same model, bit for bit, and reports the same steps; chunked: rank r
    holds chunks r, r + world, ... and no other."""
    world = len(runs)
    for r in range(1, world):
        assert runs[r]["reports"] == runs[0]["reports"]
        assert all(torch.equal(sds[r][k], sds[0][k]) for k in sds[0])
    if mode == "chunked":
        n = len(runs[0]["placement"])
        for r, run in enumerate(runs):
            assert [c for c, p in enumerate(run["placement"]) if p != "remote"] == list(range(r, n, world))


_REFERENCES: dict = {}


def _reference(steps: int, clip: float | None, accum: int):
    """torch's run (test_transaction.reference) of the tiny GPT on `steps` whole batches of `accum` micro-batches:
    (the model, its per-step outputs). Several cases train on the same batches with the same recipe (they differ
    in how the ranks split the work), so each recipe's reference is computed once; the cases only read it."""
    key = (steps, clip, accum)
    if key not in _REFERENCES:
        ref, _, ref_out = reference(tiny_gpt(), gpt_batches(steps, accum=accum), grad_clip=clip, accum=accum)
        _REFERENCES[key] = ref, ref_out
    return _REFERENCES[key]


@pytest.mark.parametrize("mode,world,clip,accum,variant", CASES)
def test_ranks_equal_one_process_on_the_whole_batch(tmp_path, mode, world, clip, accum, variant):
    """variant: "mixed" (each rank's chunks on both tiers, and compiled regions traced by Dynamo alone: the
    broadcasts in prefetches move up to a region's start, the same on every rank), or the step's transaction
    (else the plan's choice)."""
    steps = 3
    out = str(tmp_path / "run")
    env = {"TRANSACTION": variant} if variant in ("replay", "two_pass") else {}
    env["EVAL"] = "1" if clip is None else ""
    if variant == "mixed":                    # regions, and a device budget that holds some of each rank's chunks
        env["REGIONS"] = "eager"
        local = tuple(x.chunk(world)[0] for x in gpt_batches(1, accum=world * accum)[0])
        on_host = pstar_fx.plan(tiny_gpt(), {"device": "cpu", "placement": "host", "chunk_size": 16384,
                                             "optimizer": OPT, "grad_clip": clip}, local, world=world)
        env["DEVICE_MEMORY"] = str(on_host.device_peak_bytes + 16384 * 12)
    _launch(world, out, steps, clip, accum, mode=mode, extra_env=env)
    ref, ref_out = _reference(steps, clip, world * accum)
    sds, runs = _results(out, world)
    assert_ranks_agree(sds, runs, mode)
    if variant == "mixed":
        assert all({"device", "host"} <= set(run["placement"]) for run in runs), [run["placement"] for run in runs]
    reports = runs[0]["reports"]
    assert_losses_close([x[0] for x in reports], [o[0] for o in ref_out],
                        [o[0] for o in ref.__dict__["float64_truth"][2]])
    if clip is not None:
        assert all(o[1] > clip for o in ref_out)     # clipping triggered on every step
        torch.testing.assert_close(torch.tensor([x[1] for x in reports]), torch.tensor([o[1] for o in ref_out]),
                                   rtol=1e-5, atol=0)
    assert_weights_close(sds[0], ref)
    if clip is None:                                 # each rank's eval loss of its own first batch, as torch's
        ref = copy.deepcopy(ref).eval()              # the shared reference itself stays as it trained
        with torch.no_grad():
            for r, run in enumerate(runs):
                mine = tuple(x.chunk(world)[r] for x in gpt_batches(1, accum=world * accum)[0])
                want = float(ref(*mine))
                assert abs(run["evaluated"] - want) <= 1e-5 * abs(want), (r, run["evaluated"], want)


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


_SKIP_RANK = r"""
import json, os, sys, warnings, torch
sys.path.insert(0, sys.argv[1])
import pstar_fx
from test_transaction import OPT, Regression, regression_batches
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.manual_seed(0)
batches = [tuple(x.chunk(world)[rank] for x in b) for b in regression_batches(4, overflow_at=(2,))]
engine = pstar_fx.compile(Regression(), {"device": "cpu", "placement": "host", "chunk_size": 4096, "optimizer": OPT,
                                         "grad_clip": 5.0, "dist_timeout": 60}, batches[0])
skipped = []
for b in batches:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.step(*b)
    skipped.append(engine.last_step.skipped)
torch.save(engine.state_dict(), f"{sys.argv[2]}.{rank}.pt")
json.dump({"skipped": skipped, "steps": engine.steps}, open(f"{sys.argv[2]}.{rank}.json", "w"))
"""


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """Only rank 0's half of step 2's batch holds an inf: the verdict is global, so both ranks skip that step
    (rolled back where speculated), and the run equals one process skipping it on the whole batch."""
    from test_transaction import OPT, Regression, regression_batches
    out = str(tmp_path / "skip")
    _launch(2, out, script=_SKIP_RANK)
    runs = [json.load(open(f"{out}.{r}.json")) for r in range(2)]
    sds = [torch.load(f"{out}.{r}.pt") for r in range(2)]
    assert runs[0] == runs[1] == {"skipped": [False, False, True, False], "steps": 3}
    assert all(torch.equal(sds[0][k], sds[1][k]) for k in sds[0])
    torch.manual_seed(0)
    batches = regression_batches(4, overflow_at=(2,))
    one = pstar_fx.compile(Regression(), {"device": "cpu", "placement": "host", "chunk_size": 4096, "optimizer": OPT,
                                          "grad_clip": 5.0, "grad_accum": 2}, tuple(x[:4] for x in batches[0]))
    with pytest.warns(RuntimeWarning, match="skipped"):
        for b in batches:
            one.step(*b)
    ref = one.state_dict()
    for k in ref:
        torch.testing.assert_close(sds[0][k], ref[k], rtol=1e-5, atol=1e-7)


def _tensors(ckpt: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory by name (weights and moments, whatever its sharding)."""
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(ckpt, f)))
    return out


@pytest.mark.parametrize("mode", ["chunked"])
def test_a_checkpoint_saved_at_two_ranks_resumes_at_four_and_at_one(tmp_path, mode):
    """Saved at 2 ranks (chunked: each writes its own chunks), loaded at 4 (re-partitioned) and at 1: the same
    weights and moments bit for bit, and training goes on as one process would on the whole batch (at 4 ranks:
    the same losses and clipped norms as it, every rank agreeing)."""
    import pstar_fx
    out, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    _launch(2, out, 2, 0.05, 1, mode=mode, extra_env={"SAVE_TO": ckpt, "WHOLE": "2"})
    saved = _tensors(ckpt)
    if mode == "chunked":
        assert any(f.startswith("model-00002-of-") for f in os.listdir(ckpt))     # rank 1 wrote a shard
        assert os.path.exists(os.path.join(ckpt, "optimizer.safetensors.index.json"))
    ref, _, ref_out = reference(tiny_gpt(), gpt_batches(4, accum=2), grad_clip=0.05, accum=2)

    again = str(tmp_path / "again4")
    _launch(4, out + "4", 2, 0.05, 1, extra_env={"LOAD_FROM": ckpt, "SAVE_FIRST": again, "FIRST_STEP": "2",
                                                 "WHOLE": "2"})
    reloaded = _tensors(again)
    assert set(reloaded) == set(saved) and all(torch.equal(reloaded[k], saved[k]) for k in saved)
    sds, runs = _results(out + "4", 4)
    assert runs[0]["steps"] == 4
    assert_ranks_agree(sds, runs, "chunked")
    reports = runs[0]["reports"]
    assert_losses_close([x[0] for x in reports], [o[0] for o in ref_out],
                        [o[0] for o in ref.__dict__["float64_truth"][2]], first_step=2)
    assert all(o[1] > 0.05 for o in ref_out)         # clipping triggered on every step
    torch.testing.assert_close(torch.tensor([x[1] for x in reports]), torch.tensor([o[1] for o in ref_out[2:]]),
                               rtol=1e-5, atol=0)
    assert_weights_close(sds[0], ref)

    whole = gpt_batches(4, accum=2)
    one = pstar_fx.compile(tiny_gpt(), {"device": "cpu", "chunk_size": 32768, "optimizer": OPT, "grad_clip": 0.05},
                           whole[0], resume=ckpt)
    assert one.steps == 2
    sd = one.state_dict()
    store = one.rt.store
    for i, p in enumerate(one.lowered.capture.params):
        assert torch.equal(sd[p.name], saved[p.name]), p.name
        slot = store.layout.slots[i]
        got = store.exp_avg_sq[slot.chunk][slot.offset: slot.offset + slot.numel].view(p.shape)
        assert torch.equal(got, saved[f"{p.name}.exp_avg_sq"]), p.name
    for b in whole[2:]:
        one.step(*b)
    assert_weights_close(one.state_dict(), ref)


def _beside_one_process(tmp_path, monkeypatch, capsys, ranks_args: list[str], one_args: list[str]) -> tuple[str, str]:
    """`pstar-fx` run as 2 ranks (`ranks_args`, with --nproc) and as one process (`one_args`), at once: (the one
    process's stdout, the ranks' stdout). The 2-rank run is its own process tree (the command, torchrun, the ranks);
    while its launcher starts up on one core, the one-process run goes on the other, in this process through the same
    `main` the console script calls, with one intra-op thread as OMP_NUM_THREADS=1 gives the ranks."""
    from pstar_fx.cli import main
    proc = subprocess.Popen([sys.executable, "-m", "pstar_fx.cli", *ranks_args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        monkeypatch.chdir(tmp_path)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert main(one_args) == 0
        finally:
            torch.set_num_threads(threads)
        one = capsys.readouterr().out
        text, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    return one, text


def test_cli_nproc_trains_like_one_process_on_the_whole_batch(tmp_path, monkeypatch, capsys):
    """`pstar-fx train --nproc 2` (torchrun, gloo): 2 ranks of --batch 2 print what one process of --batch 4 does,
    held-out loss included (each rank evaluates its half of the same held-out batch), and one rank writes the
    metrics file."""
    import re

    common = ["train", "--model", "tiny", "--steps", "3", "--log-every", "1", "--device", "cpu", "--seq", "32",
              "--eval-every", "3"]

    def steps(stdout):
        return [(float(a), float(b)) for a, b in re.findall(r"^step +\d+ +loss ([\d.]+) .* grad norm ([\d.]+)",
                                                            stdout, re.M)]
    one_text, text = _beside_one_process(tmp_path, monkeypatch, capsys,
                                         [*common, "--batch", "2", "--nproc", "2", "--metrics", "dp.jsonl"],
                                         [*common, "--batch", "4"])
    one, dp = steps(one_text), steps(text)
    assert "2 ranks of 64" in text and len(dp) == 3
    assert text.count("done: 3 steps") == 1                  # one rank reports
    torch.testing.assert_close(torch.tensor(dp), torch.tensor(one), rtol=2e-4, atol=0)   # 4 printed digits

    def evals(stdout):
        return [float(x) for x in re.findall(r"^step +3  eval loss ([\d.]+) ", stdout, re.M)]
    assert len(evals(text)) == len(evals(one_text)) == 1
    torch.testing.assert_close(torch.tensor(evals(text)), torch.tensor(evals(one_text)), rtol=2e-4, atol=0)
    records = [json.loads(line) for line in (tmp_path / "dp.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]                   # each step once: rank 0 writes the file
    assert round(records[-1]["eval_loss"], 4) == evals(text)[0] and round(records[0]["loss"], 4) == dp[0][0]


def test_cli_nproc_on_chat_records_equals_micro_batches_of_one_process(tmp_path, monkeypatch, capsys):
    """`--nproc 2` on JSONL records: each rank's loss is the mean over its own rows' trained tokens, averaged over
    the ranks, which is what one process does with the same rows as 2 micro-batches (--grad-accum 2); the
    held-out loss is the mean over every held-out token either way."""
    import re

    from test_records import chat_jsonl, tiny_llama_dir
    hf = tiny_llama_dir(tmp_path / "llama")
    data = chat_jsonl(tmp_path / "chat.jsonl", 40)
    common = ["train", "--model", f"hf:{hf}", "--data", str(data), "--seq", "32", "--batch", "2", "--steps", "2",
              "--log-every", "1", "--eval-every", "2", "--device", "cpu", "--device-memory", "512KiB"]

    def printed(stdout, key):
        return [float(x) for x in re.findall(rf"^step +\d+  {key} ([\d.]+)", stdout, re.M)]
    one, text = _beside_one_process(tmp_path, monkeypatch, capsys, [*common, "--nproc", "2"],
                                    [*common, "--grad-accum", "2"])
    assert "held out: 2 records in 1 row(s)" in text and text.count("done: 2 steps") == 1
    for key in ("loss", "eval loss"):
        assert len(printed(text, key)) == (2 if key == "loss" else 1)
        torch.testing.assert_close(torch.tensor(printed(text, key)), torch.tensor(printed(one, key)), rtol=2e-4,
                                   atol=0)                                   # 4 printed digits
