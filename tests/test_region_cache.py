"""A second compile() of the same model in a fresh process loads its Inductor regions from the cache beside the plan
cache instead of building them, and trains bit-identically to the first; a cold cache's regions are built by
worker processes (passes/region_builders.py) and loaded from there by the compiling process.

Evidence without timing: Inductor's own counters (torch._dynamo.utils.counters["inductor"]: fxgraph_cache_hit /
fxgraph_cache_miss) in each process, and the cache folder's place."""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import hashlib, json, logging, torch, pstar_fx
from torch import nn
from torch._dynamo.utils import counters

said = []                               # the engine's log lines about the build workers' times
class Said(logging.Handler):
    def emit(self, record):
        if "region build workers" in record.getMessage():
            said.append(record.getMessage())
logging.getLogger("pstar_fx").addHandler(Said())
logging.getLogger("pstar_fx").setLevel(logging.INFO)

class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x, y):
        return (self.b(nn.functional.gelu(self.a(x))) - y).pow(2).mean()

torch.manual_seed(0)
model = TwoLinear()
g = torch.Generator().manual_seed(0)
x, y = torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)
engine = pstar_fx.compile(model, pstar_fx.Config(device="cpu", compute="inductor", chunk_size=2048,
                                                 placement="host"), (x, y))
losses = [engine.step(x, y).item() for _ in range(2)]
sd = engine.state_dict()
print(json.dumps({"losses": losses, "regions": len(engine.graph.meta["regions"]),
                  "state": hashlib.sha256(b"".join(sd[k].numpy().tobytes() for k in sorted(sd))).hexdigest(),
                  "hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"],
                  "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
                  "aot_misses": counters["aot_autograd"]["autograd_cache_miss"],
                  "dynamo_graphs": counters["stats"]["unique_graphs"],
                  "cache": __import__("os").environ["TORCHINDUCTOR_CACHE_DIR"], "workers_said": said,
                  "build_times": engine.region_build_times,
                  "explained": [l for l in engine.explain().splitlines() if l.startswith("region builds:")]}))
"""


def compile_in_a_fresh_process(cache: Path, workers: int, artifacts: bool = False,
                               capability: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    env.update(PSTAR_FX_CACHE=str(cache), PSTAR_FX_BUILD_WORKERS=str(workers),
               PSTAR_FX_REGION_ARTIFACTS="1" if artifacts else "0",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """One compile in a fresh process of a cache of its own, no workers, no artifacts (today's torch.compile
    regions, this machine's CPU capability), started at once beside the first test that asks for it: its folder and
    (a future of) what it said. The reference of the artifacts' bits, and the cache another CPU capability reads."""
    folder = tmp_path_factory.mktemp("plain")
    with ThreadPoolExecutor(1) as pool:
        yield folder, pool.submit(compile_in_a_fresh_process, folder, workers=0)


def test_second_compile_loads_the_regions_the_workers_built_and_trains_the_same_bits(tmp_path):
    cold = compile_in_a_fresh_process(tmp_path, workers=2)
    assert cold["regions"] == 2
    inductor = Path(cold["cache"])
    assert inductor.parent == tmp_path and inductor.name.startswith("inductor-")    # beside the plan cache
    # the workers built both regions; this process only loaded them, Inductor's graphs and AOTAutograd's (which
    # missed before the regions were compiled from their pickled copies, as the workers compile them)
    assert (cold["hits"], cold["misses"]) == (2, 0), cold
    assert (cold["aot_hits"], cold["aot_misses"]) == (2, 0), cold
    assert list(inductor.glob("pstar_fx-regions-*")), "no marker of the built regions"
    # where the cold build's time went: each worker's start, and each region's seconds (one region a worker here)
    # (the workers were started before the capture, on standby: handed their shares once the regions were known)
    said = cold["workers_said"]
    assert len(said) == 1 and said[0].count("ready at") == 2 and said[0].count(" ops ") == 2, said
    assert "shares handed at" in said[0], said
    times = cold["build_times"]                         # the same, for a record (bench/gpt.py's region_builds)
    assert len(cold["explained"]) == 1 and "2 regions on 2 worker(s)" in cold["explained"][0], cold["explained"]
    assert sorted(t["worker"] for t in times) == [0, 1] and all(t["ready"] <= t["began"] <= t["ended"] and t["built"]
                                                               for t in times), times
    # and where each worker's start went: its imports (torch, pstar_fx), then Inductor's, in CPU seconds too
    assert all(t["imported"] <= t["ready"] and 0 < t["imported_cpu_s"] <= t["ready_cpu_s"] for t in times), times
    assert "torch and pstar_fx imported at" in said[0], said
    warm = compile_in_a_fresh_process(tmp_path, workers=2)          # the marker: no worker starts, none on standby
    assert (warm["hits"], warm["misses"]) == (2, 0) and (warm["aot_hits"], warm["aot_misses"]) == (2, 0), warm
    assert warm["workers_said"] == [] and warm["build_times"] == [] and warm["explained"] == [], warm
    assert not list(inductor.glob("pstar_fx-compiles/*.json.tmp*"))
    assert len(list((inductor / "pstar_fx-compiles").glob("*.json"))) == 1     # what told it so
    assert warm["losses"] == cold["losses"] and warm["state"] == cold["state"]


def test_workers_get_shares_of_about_equal_ops_and_every_region_once():
    """Regions go to the build workers largest first, each to the least loaded one (`region_builders.shares`): the
    most any worker gets is within one region of an equal share, every region is built exactly once, and the
    split does not depend on the regions' order."""
    import random

    import torch
    import torch.fx as fx

    from pstar_fx.passes.region_builders import n_ops, shares

    def region(count):
        g = fx.Graph()
        x = g.placeholder("x")
        for _ in range(count):
            x = g.call_function(torch.relu, (x,))
        g.output(x)
        return fx.GraphModule(torch.nn.Module(), g)

    sizes = [28, 52, 48, 52, 72, 52, 72, 48, 52, 20, 5, 110, 5, 86, 75, 98, 12, 80, 21, 103, 49, 103, 27, 34]
    jobs = [(f"k{i}", region(n), []) for i, n in enumerate(sizes)]     # an 18B GPT's distinct regions' ops
    split = shares(jobs, 4)
    assert sorted(k for share in split for k, _, _ in share) == sorted(k for k, _, _ in jobs)
    order = [k for k, _, _ in jobs]                                     # each share built in the step's order
    assert all([k for k, _, _ in share] == sorted((k for k, _, _ in share), key=order.index) for share in split)
    loads = [sum(n_ops(gm) for _, gm, _ in share) for share in split]
    assert max(loads) <= sum(sizes) / 4 + max(sizes) and max(loads) == 332
    shuffled = jobs[:]
    random.Random(0).shuffle(shuffled)
    assert sorted(sum(n_ops(gm) for _, gm, _ in share) for share in shares(shuffled, 4)) == sorted(loads)


def test_a_worker_out_of_device_memory_on_one_region_builds_the_others(tmp_path, monkeypatch, capsys):
    """A build worker that runs out of device memory on one region (the largest come first) goes on to the others,
    says which it left (the engine's process builds that one), and exits normally; the room a region needs is
    guessed from its inputs (the zeros it is built on), three times over."""
    import pickle

    import torch
    import torch.fx as fx

    from pstar_fx.passes import compile_regions, region_builders, region_worker

    def region(n):
        g = fx.Graph()
        x = g.placeholder("x")
        g.output((g.call_function(torch.ops.aten.mul.Tensor, (x, float(n))),))
        return fx.GraphModule(torch.nn.Module(), g)

    spec = ("value", compile_regions._Layout((4, 8), (8, 1), 0, 32, torch.float32, torch.device("cpu")), None)
    param = ("param", compile_regions._Layout((2, 8), (8, 1), 0, 16, torch.bfloat16, torch.device("cpu")), 40)
    assert region_builders.room_needed([spec, None, param]) == 3 * (32 * 4 + 16 * 2)
    built = []
    call = compile_regions.Region.__call__

    def short_of_memory(self, *args):
        if self.__name__ == "region_w0":
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        built.append(self.__name__)
        return call(self, *args)

    monkeypatch.setattr(compile_regions.Region, "__call__", short_of_memory)
    monkeypatch.setattr(compile_regions, "BACKEND", "eager")
    job = tmp_path / "job.pkl"
    done = [str(tmp_path / "done-0"), str(tmp_path / "done-1")]
    job.write_bytes(pickle.dumps({"regions": [(region(2), [spec]), (region(3), [spec])], "device": "cpu",
                                  "done": done, "inductor_config": torch._inductor.config.save_config(),
                                  "threads": 1, "memory_fraction": None}))
    saved = torch._inductor.config.save_config()       # work loads the job's Inductor config into this process
    try:
        region_worker.work(str(job))
    finally:
        torch._inductor.config.load_config(saved)
    assert built == ["region_w1"]
    assert "region_w0 not built: out of device memory" in capsys.readouterr().err
    assert all(os.path.exists(d) for d in done)          # each said done, built or not: the parent goes on


def test_workers_are_as_many_as_have_room_for_the_most_regions_and_build_only_those():
    """`fit_workers`: the free device memory shared equally; the worker count (2 to the most) whose share holds the
    most regions, the more workers on a tie; a region no share holds is left to the engine's process."""
    from pstar_fx.passes.region_builders import fit_workers
    GiB = 2**30
    assert fit_workers([3 * GiB] * 24, 52 * GiB, 4) == (4, 13 * GiB, list(range(24)))     # an 18B GPT: all fit
    lora = [20 * GiB, 20 * GiB, 5 * GiB, 5 * GiB, 5 * GiB, 5 * GiB, 3 * GiB]
    assert fit_workers(lora, 23 * GiB, 4) == (4, 23 * GiB / 4, [2, 3, 4, 5, 6])            # the two largest: here
    assert fit_workers([6 * GiB, 11 * GiB, 11 * GiB], 23 * GiB, 4) == (2, 11.5 * GiB, [0, 1, 2])
    assert fit_workers([30 * GiB], 23 * GiB, 4)[2] == []


def test_region_artifacts_train_the_same_bits_without_dynamo(tmp_path, plain):
    """PSTAR_FX_REGION_ARTIFACTS=1: each region is built as a standalone Inductor artifact (by this process, or by
    the build workers), saved by its key beside Inductor's caches and loaded from there by the next compile; no
    region goes through Dynamo, and every run trains the bits of today's torch.compile regions."""
    with ThreadPoolExecutor(1) as pool:         # (processes of their own caches side by side, the plain one too)
        by_workers = pool.submit(compile_in_a_fresh_process, tmp_path / "workers", workers=2, artifacts=True)
        cold = compile_in_a_fresh_process(tmp_path / "here", workers=0, artifacts=True)
        warm = compile_in_a_fresh_process(tmp_path / "here", workers=0, artifacts=True)
        plain, by_workers = plain[1].result(), by_workers.result()
    assert plain["dynamo_graphs"] == 2
    assert len(list((Path(cold["cache"]) / "pstar_fx-artifacts").glob("*.bin"))) == 2
    for run in (cold, warm, by_workers):
        assert run["dynamo_graphs"] == 0, run
        assert run["losses"] == plain["losses"] and run["state"] == plain["state"], run
    assert (warm["hits"], warm["misses"]) == (2, 0) and (by_workers["hits"], by_workers["misses"]) == (2, 0)


def test_the_artifacts_switch_takes_0_or_1_only(monkeypatch):
    """PSTAR_FX_REGION_ARTIFACTS (like PSTAR_FX_HUGE_PAGES, one parser): "0" off, "1" on, anything else a clear
    error naming the variable, never on by accident."""
    import pytest

    from pstar_fx.passes.region_builders import artifacts_on
    from pstar_fx.runtime.host_memory import huge_pages_wanted
    for var, wanted in (("PSTAR_FX_REGION_ARTIFACTS", artifacts_on), ("PSTAR_FX_HUGE_PAGES", huge_pages_wanted)):
        monkeypatch.setenv(var, "0")
        assert wanted() is False
        monkeypatch.setenv(var, "1")
        assert wanted() is True
        monkeypatch.setenv(var, "false")
        with pytest.raises(ValueError, match=f"{var}: expected 0 or 1, got 'false'"):
            wanted()


def test_a_cache_filled_under_one_cpu_capability_serves_another_the_bits_of_its_own(tmp_path, plain):
    """Inductor's caches live in one folder per ATen CPU capability: filled under this machine's (AVX512 on the
    development VM) and then read under ATEN_CPU_CAPABILITY=default, Inductor's keys alone gave a C++ compile error
    (`at::vec` undeclared). Now the second capability trains the bits it trains on a cache of its own."""
    with ThreadPoolExecutor(1) as pool:         # (a process of its own cache beside the one of the shared)
        alone = pool.submit(compile_in_a_fresh_process, tmp_path / "alone", workers=0, capability="default")
        shared, native = plain[0], plain[1].result()        # (filled under this machine's capability)
        lowered = compile_in_a_fresh_process(shared, workers=0, capability="default")
        alone = alone.result()
    assert Path(lowered["cache"]).name == "inductor-default"
    if Path(native["cache"]).name != "inductor-default":    # (a machine whose own capability is DEFAULT shares it)
        assert native["cache"] != lowered["cache"] and (lowered["hits"], lowered["misses"]) == (0, 2), lowered
    assert lowered["losses"] == alone["losses"] and lowered["state"] == alone["state"]


def test_this_process_goes_on_with_a_region_as_soon_as_its_worker_has_built_it(tmp_path):
    """`Builders.wait_for(key)` returns once the worker building that region says so (its file in the job folder),
    while the worker goes on with others; once a worker has ended, whether or not it got to the region; at once for
    a region no worker builds. `wait()` then marks the set built."""
    import tempfile

    from pstar_fx.passes import region_builders

    tmp = tempfile.TemporaryDirectory(dir=tmp_path)
    built = os.path.join(tmp.name, region_builders.done_name("built"))
    go_on = tmp_path / "go-on"
    # worker 0 says it built "built", then waits until told to end (it is busy with its other regions)
    busy = subprocess.Popen([sys.executable, "-c", "import os, sys, time\nopen(sys.argv[1], 'w').close()\n"
                             "while not os.path.exists(sys.argv[2]): time.sleep(0.01)", built, str(go_on)])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])          # worker 1 ends without a word
    for w in (0, 1):
        (Path(tmp.name) / f"err{w}.txt").write_text("")
    marker = str(tmp_path / "marker")
    b = region_builders.Builders([busy, ended], tmp, marker, 3, {"built": 0, "never": 1})
    b.wait_for("built")
    assert busy.poll() is None                  # returned on its word, the worker still at work
    b.wait_for("never")
    assert ended.poll() is not None             # returned once that worker had ended
    b.wait_for("nobody's")                      # no worker builds it
    go_on.write_text("")
    assert b.wait() == 3 and os.path.exists(marker)
    b.wait_for("built")                         # after wait(): at once, the job folder gone


def test_a_region_no_worker_builds_waits_for_the_workers_shares_of_the_device(tmp_path):
    """On CUDA the workers hold their shares of the device memory until they end; a region none of them builds is
    one no share had room for, so this process builds it only once they have ended (`make_room`). Where they share
    no device memory (CPU), it goes on at once."""
    import tempfile
    import threading

    from pstar_fx.passes import region_builders

    def busy_worker(go_on):
        return subprocess.Popen([sys.executable, "-c", "import os, sys, time\n"
                                 "while not os.path.exists(sys.argv[1]): time.sleep(0.01)", str(go_on)])

    for shared in (False, True):
        tmp = tempfile.TemporaryDirectory(dir=tmp_path)
        go_on = tmp_path / f"go-on-{shared}"
        proc = busy_worker(go_on)
        (Path(tmp.name) / "err0.txt").write_text("")
        b = region_builders.Builders([proc], tmp, str(tmp_path / f"marker-{shared}"), 1, {"theirs": 0},
                                     device_shared=shared)
        assert b.running()
        b.make_room("theirs")                   # a worker's region: loaded beside them
        assert b.running()
        if not shared:
            b.make_room("nobody's")
            assert b.running()                  # no device memory held: at once
            go_on.write_text("")
        else:
            threading.Timer(0.3, go_on.write_text, ("",)).start()
            b.make_room("nobody's")
            assert proc.poll() is not None and not b.running()
        assert b.wait() == 1


def test_standby_workers_not_needed_are_killed_at_once_and_leave_nothing(tmp_path, monkeypatch):
    """Workers started on standby before the capture (region_builders.Standby): `take` keeps the ones a cold build
    uses and kills the rest without waiting for their imports; `close` kills the rest and removes their folder."""
    import time

    from pstar_fx.passes import region_builders

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    standby = region_builders.Standby(3)
    folder = standby.tmp.name
    t0 = time.perf_counter()
    assert standby.take(1) == 1
    assert time.perf_counter() - t0 < 5          # (killed, not waited for: importing torch alone takes seconds)
    assert standby.procs[0].poll() is None and all(p.returncode is not None for p in standby.procs[1:])
    standby.procs[0].kill()                       # (the one taken: a Builders would own it)
    standby.procs[0].wait()
    unused = region_builders.Standby(2)
    unused.close()
    assert all(p.returncode is not None for p in unused.procs)
    assert not os.path.exists(unused.tmp.name) and os.path.exists(folder)
    standby.tmp.cleanup()


def test_a_standby_worker_whose_parent_is_gone_exits_without_a_job(tmp_path, monkeypatch):
    """A worker on standby that is never handed its share does not linger: once the process that started it is
    gone (its parent's pid changes), it returns without building anything."""
    from pstar_fx.passes import region_worker

    parents = iter([1234] + [1] * 1000)                  # started by 1234, then re-parented to init
    monkeypatch.setattr(region_worker.os, "getppid", lambda: next(parents))
    monkeypatch.setattr(region_worker, "warm_up", lambda: None)
    monkeypatch.setattr(region_worker, "work", lambda *a: (_ for _ in ()).throw(AssertionError("built")))
    region_worker.standby(str(tmp_path / "job0.pkl"))    # returns: no job, parent gone


def test_an_artifact_that_fails_at_its_first_call_in_a_worker_is_built_by_dynamo_there_and_noted(tmp_path, monkeypatch):
    """torch 2.11's standalone artifacts of some regions failed at their first call (IndexError inside Inductor's
    `copy_misaligned_inputs`, H100 and H200 boxes), which the engine's process found only at its own first call and
    then compiled the region through Dynamo itself (~2.7 s at the end of a cold 4.2B compile). A worker now loads
    back each artifact it saved and calls it once: one that fails is noted beside it and the region is built by
    Dynamo in the worker;
    the engine's process (`_use_artifact`) then goes to Dynamo at once, as does a later compile."""
    import pickle

    import torch
    import torch.fx as fx

    from pstar_fx.passes import compile_regions, region_builders, region_worker

    def region(n):
        g = fx.Graph()
        x = g.placeholder("x")
        g.output((g.call_function(torch.ops.aten.mul.Tensor, (x, float(n))),))
        return fx.GraphModule(torch.nn.Module(), g)

    class Failing:
        def __call__(self, *args):
            raise IndexError("list index out of range (stand-in)")

    saved, dynamo = [], []
    monkeypatch.setattr(region_worker, "save_artifact", lambda gm, examples, path: saved.append(path))
    # (the artifact as loaded back from its file fails, as on torch 2.11, where the one just built ran)
    monkeypatch.setattr(region_worker, "load_artifact", lambda path: (
        Failing() if path.endswith("a0.bin") else (lambda *a: (a[0] * 3,))))
    call = compile_regions.Region.__call__
    monkeypatch.setattr(compile_regions.Region, "__call__",
                        lambda self, *a: dynamo.append(self.__name__) or call(self, *a))
    monkeypatch.setattr(compile_regions, "BACKEND", "eager")
    monkeypatch.setattr(compile_regions.Region, "compiled", lambda self, *a: self.graph_module(*a))
    spec = ("value", compile_regions._Layout((4, 8), (8, 1), 0, 32, torch.float32, torch.device("cpu")), None)
    paths = [str(tmp_path / "a0.bin"), str(tmp_path / "a1.bin")]
    job = tmp_path / "job.pkl"
    job.write_bytes(pickle.dumps({"regions": [(region(2), [spec]), (region(3), [spec])], "device": "cpu",
                                  "artifacts": paths, "done": [str(tmp_path / "d0"), str(tmp_path / "d1")],
                                  "inductor_config": torch._inductor.config.save_config(), "threads": 1,
                                  "memory_fraction": None}))
    before = torch._inductor.config.save_config()
    try:
        region_worker.work(str(job))
    finally:
        torch._inductor.config.load_config(before)
    assert saved == paths and dynamo == ["region_w0"]           # the failing one went to Dynamo, in the worker
    assert region_builders.artifact_failed(paths[0]) and not region_builders.artifact_failed(paths[1])
    assert "IndexError" in open(paths[0] + ".fails").read()
    # the engine's process: no artifact for a region noted so (Dynamo's build), a worker's artifact for the other
    monkeypatch.setattr(region_builders, "artifact_path", lambda key, specs, device: paths[int(key)])
    r0 = compile_regions.Region(region(2), "region_0", "inductor", [spec], key="0")
    compile_regions._use_artifact(r0, [spec], [], torch.device("cpu"))
    assert r0._artifact is None and r0._artifact_path is None
    saved.clear(), dynamo.clear()
    try:                                                    # a later cold build's worker: Dynamo at once for it
        region_worker.work(str(job))
    finally:
        torch._inductor.config.load_config(before)
    assert saved == paths[1:] and dynamo == ["region_w0"]
