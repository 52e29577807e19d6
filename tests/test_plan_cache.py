"""The plan cache (pipeline/plan_cache.py): a second compile of the same step reuses the search's decision and gets
the same plan, graph and training bits; a cached plan for another graph, budget or rates is never used."""
import glob
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import pstar_fx
from pstar_fx.models import GPT, gpt_config
from pstar_fx.pipeline import plan_cache, recompute_search
from pstar_fx.pipeline.lower import Lowered
from pstar_fx.planning import costs

from test_engine import batch, working_set

CHUNK = 16384


@pytest.fixture
def cache(cache_folder, monkeypatch):
    """conftest's `cache_folder` (only the suite's rates, the plan cache on) and a count of the planner's runs in
    the recompute search."""
    calls = []
    real = recompute_search.make_plan

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(recompute_search, "make_plan", counted)
    return cache_folder, calls


def model(n_layer=2):
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", n_layer=n_layer))


def config(budget, **kw):
    return pstar_fx.Config(device="cpu", device_memory=budget, chunk_size=CHUNK, optimizer={"lr": 1e-2}, **kw)


def lowered(m, budget, **kw):
    return Lowered(m, config(budget, **kw), batch())


@pytest.fixture(scope="module")
def budget():
    """A device budget under the working set with nothing recomputed and one chunk: only every cheap value and
    some whole forward segments recomputed fit (a binary search over segment counts), so the cached decision is not
    the trivial one."""
    working, chunk_bytes, _ = working_set(model(), batch(), chunk_size=CHUNK)
    return int(0.6 * (working + chunk_bytes))


def plan_text(plan) -> str:
    return repr(plan)           # every field of the plan but its node profile (repr=False)


def test_second_compile_reuses_the_decision_and_trains_bit_identically(cache, budget, caplog):
    root, calls = cache
    batches = [batch(seed=s) for s in range(3)]
    cold = pstar_fx.compile(model(), config(budget), example_inputs=batches[0])
    searched = len(calls)
    assert searched > 1, "the budget should make the search try more than one variant"
    assert cold.plan.fits and "host" in cold.plan.placement
    assert "forward segments, earliest first" in cold.plan.recompute, cold.plan.recompute
    # every try the search made, in a line each, in the plan and in explain() (a box's record says why the search
    # chose what it chose)
    assert len(cold.plan.tried) == searched, cold.plan.tried
    assert all(t.startswith("recomputing ") for t in cold.plan.tried), cold.plan.tried
    assert sum("fits, estimated" in t for t in cold.plan.tried) >= 1 and any("does not fit" in t
                                                                              for t in cold.plan.tried)
    assert f"recompute search, {searched} tries in the order made:" in cold.explain()
    files = glob.glob(os.path.join(root, "plan-v*.json"))
    assert len(files) == 1, files

    calls.clear()
    with caplog.at_level(logging.INFO, logger="pstar_fx"):
        warm = pstar_fx.compile(model(), config(budget), example_inputs=batches[0])
    assert len(calls) == 1                                   # the one chosen try, no search
    assert f"plan: from cache ({files[0]})" in caplog.text
    assert plan_text(warm.plan) == plan_text(cold.plan)            # the cold search's tries included
    assert warm.plan.summary() == cold.plan.summary()
    assert warm.graph.code == cold.graph.code
    assert warm.graph_before("fuse_optimizer") == cold.graph_before("fuse_optimizer")

    for b in batches:
        assert torch.equal(cold.step(*b), warm.step(*b))
    a, w = cold.state_dict(), warm.state_dict()
    assert a.keys() == w.keys()
    for k in a:
        assert torch.equal(a[k], w[k]), k


def test_a_fresh_process_reads_the_entry(cache, budget):
    """The fingerprint holds from one process to the next (no address or per-process state in it)."""
    root, _ = cache
    lowered(model(), budget)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")]))
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
            f"import test_plan_cache as t; t.lowered(t.model(), {budget})")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    (file,) = glob.glob(os.path.join(root, "plan-v*.json"))
    assert f"plan: from cache ({file})" in run.stderr, run.stderr[-3000:]


def test_another_graph_budget_or_rates_misses(cache, budget, monkeypatch):
    root, calls = cache
    first = lowered(model(), budget)
    assert len(glob.glob(os.path.join(root, "plan-v*.json"))) == 1
    applied = []
    real = plan_cache.load

    def load(key):
        out = real(key)
        applied.append(out is not None)
        return out

    monkeypatch.setattr(recompute_search.plan_cache, "load", load)

    def misses(make):
        calls.clear()
        applied.clear()
        before = set(glob.glob(os.path.join(root, "plan-v*.json")))
        low = make()
        assert applied == [False]                            # no entry was found for it
        assert len(calls) > 1                                # it searched
        assert len(set(glob.glob(os.path.join(root, "plan-v*.json"))) - before) == 1   # and cached its own
        return low

    deeper = misses(lambda: lowered(model(n_layer=3), budget))
    assert len(deeper.layout.chunks) != len(first.layout.chunks) or deeper.graph.code != first.graph.code
    misses(lambda: lowered(model(), budget + 12 * CHUNK))
    with costs.assumed(h2d_bw=costs.calibrate(torch.device("cpu"), torch.float32).h2d_bw / 2):
        misses(lambda: lowered(model(), budget))

    calls.clear()
    applied.clear()
    again = lowered(model(), budget)                         # the first one's entry still stands
    assert applied == [True] and len(calls) == 1
    assert plan_text(again.plan) == plan_text(first.plan)


def test_corrupt_entry_is_ignored_and_rewritten(cache, budget):
    root, calls = cache
    cold = lowered(model(), budget)
    (file,) = glob.glob(os.path.join(root, "plan-v*.json"))
    with open(file, "w") as f:
        f.write('{"format": 1, "fingerprint": ')              # a write cut short
    calls.clear()
    again = lowered(model(), budget)
    assert len(calls) > 1                                    # searched
    assert plan_text(again.plan) == plan_text(cold.plan)
    calls.clear()
    lowered(model(), budget)                                 # rewritten: the next compile reads it
    assert len(calls) == 1

    with open(file) as f:
        entry = json.load(f)
    with open(file, "w") as f:                               # well-formed JSON, a field of the wrong type
        json.dump(dict(entry, decision=dict(entry["decision"], cheap="all")), f)
    calls.clear()
    again = lowered(model(), budget)
    assert len(calls) > 1 and plan_text(again.plan) == plan_text(cold.plan)


def test_entry_for_another_graph_or_plan_is_not_trusted(cache, budget):
    """An entry is checked against the graph it is applied to: its own fingerprint, then the plan it recorded."""
    root, calls = cache
    two = lowered(model(), budget)
    (two_file,) = glob.glob(os.path.join(root, "plan-v*.json"))
    three = lowered(model(n_layer=3), budget)
    (three_file,) = set(glob.glob(os.path.join(root, "plan-v*.json"))) - {two_file}
    with open(two_file) as f:
        two_entry = json.load(f)
    with open(three_file, "w") as f:                         # the 2-layer decision under the 3-layer key
        json.dump(two_entry, f)
    calls.clear()
    again = lowered(model(n_layer=3), budget)
    assert len(calls) > 1 and plan_text(again.plan) == plan_text(three.plan)

    forged = dict(two_entry, decision=dict(two_entry["decision"], runs=two_entry["decision"]["runs"] - 1))
    with open(two_file, "w") as f:                           # right key, but another try than the plan it recorded
        json.dump(forged, f)
    calls.clear()
    again = lowered(model(), budget)
    assert len(calls) > 1 and plan_text(again.plan) == plan_text(two.plan)


def test_off_by_environment(cache, budget, monkeypatch):
    root, calls = cache
    monkeypatch.setenv("PSTAR_FX_PLAN_CACHE", "0")
    lowered(model(), budget)
    lowered(model(), budget)
    assert not glob.glob(os.path.join(root, "plan-v*.json"))


def test_a_decision_round_trips_its_nested_pairs_and_tries(cache):
    """A decision's pairs of runs (recompute_search.Try.nested) and its tries' lines come back as stored."""
    decision = plan_cache.Decision(5, 4, 12, recompute="r", why="", device_peak_bytes=1, fits=True,
                                   estimated_step_seconds=1.0, host_order="spread", tried=("a", "b"), nested=3)
    plan_cache.store("f" * 64, decision)
    loaded, _ = plan_cache.load("f" * 64)
    assert loaded == decision and loaded.nested == 3 and loaded.tried == ("a", "b")
