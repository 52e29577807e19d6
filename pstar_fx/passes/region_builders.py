"""region_builders: a cold compile's regions built side by side in worker processes, to fill Inductor's caches.

Inductor builds one graph at a time in a process (Dynamo holds a global compile lock), so the 23 distinct regions
of an 18B GPT took 47-74 s one after another. Its on-disk caches (FX graph cache, AOTAutograd cache, autotune
results) are keyed by the graph, its inputs' layouts and Inductor's config, not by the process: so fresh Python
processes (`python -m pstar_fx.passes.region_worker`, never a fork of this one, which may hold CUDA and threads)
each build a share of the regions (in the step's order) on zeros laid out as the step's, and `build_regions` builds
every region in this process, in the step's order, from the cache: each as soon as its worker says it has built
it (a file per region in the job folder), while the workers go on with the others. A region whose inputs another
region makes is built in a worker on its fake layout; where the real one differs, this process builds it itself
(correct, only not sped up).

Where the caches live: Inductor's own `TORCHINDUCTOR_CACHE_DIR` where it is set, else `inductor-<cpu capability>/`
beside the plan cache (`costs.cache_root()`). A second compile of the same regions starts no worker: a marker named
by a hash of the regions, device, backend and torch version says they were built (the marker only skips the workers;
whether a region loads or compiles is Inductor's cache's decision, as always).

Workers: `PSTAR_FX_BUILD_WORKERS` (0 or 1: none), else one per 4 host cores, at most 8, never more than there
are regions to build. On CUDA they share 80% of the device memory free once the chunks are allocated, each capped at
its share, and build only the regions a share has room for (`fit_workers`); this process builds the rest. Where a
compile will likely build cold (`probably_built`: no earlier compile of the same model, inputs and config built its
regions here), they start at `compile()` already, on standby (`Standby`, `PSTAR_FX_BUILD_STANDBY`), and are handed
their shares here. Each worker's times come back in its regions' files (`Builders.times`, `said`: the compile's log
and `engine.region_build_times`). An artifact that fails at its first call once loaded back (torch 2.11) is noted
beside it by the worker, which builds the region through Dynamo instead (`artifact_failed`).

Artifacts (`PSTAR_FX_REGION_ARTIFACTS`, default 1; 0: Dynamo's `torch.compile` of each region, as before): the regions
are built as standalone Inductor artifacts (`save_artifact`), by the workers or this process, saved by region key and
loaded by `build_regions` without Dynamo. A warm GPT3_18B compile on the H200 box built its 24 regions in 3.3-6.3 s
this way (session 18) against 9.4-14.1 s through Dynamo (sessions 17 and 26); on torch 2.11 one of them fails at its
first call and goes back to Dynamo (compile_regions.Region.compiled), which builds it as before.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time

import torch

from ..config import parse_count, parse_flag
from ..planning.costs import cache_root, write_entry, written_aside

log = logging.getLogger("pstar_fx")


def inductor_cache_dir() -> str:
    """Where Inductor caches what it builds: its own setting (TORCHINDUCTOR_CACHE_DIR, which Inductor itself sets
    for the process when it first runs), or set now to `inductor-<cpu capability>/` beside our caches (pstar_fx sets
    it at import). The capability (ATen's: AVX512, AVX2, DEFAULT, ..., which ATEN_CPU_CAPABILITY lowers) is in the
    name because Inductor's own keys leave part of it out: a cache filled under AVX512 and read under DEFAULT failed
    to compile its C++ (`at::vec` undeclared), and one home folder may serve machines of several CPU kinds."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        capability = torch.backends.cpu.get_cpu_capability().lower()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root(), f"inductor-{capability}")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


WORKER = "pstar_fx.passes.region_worker"     # the module a worker process runs
WORKERS_SHARE = 0.8     # of the device memory free when the workers start, theirs together


def workers_for(n_regions: int) -> int:
    env = os.environ.get("PSTAR_FX_BUILD_WORKERS")
    if env is not None:
        wanted = parse_count(env, "PSTAR_FX_BUILD_WORKERS", "processes")
    else:
        wanted = min(8, (os.cpu_count() or 1) // 4)
    return max(0, min(wanted, n_regions)) if wanted > 1 else 0


def artifacts_on() -> bool:
    """Whether regions are built as `torch._inductor.standalone_compile` artifacts, saved in the cache folder by
    region key and loaded from there without Dynamo (PSTAR_FX_REGION_ARTIFACTS, default 1: on the VM a warm region
    loads in ~5 ms instead of ~0.14 s, bench/region_artifacts.py; the H200 figures in the module docstring)."""
    return parse_flag(os.environ.get("PSTAR_FX_REGION_ARTIFACTS", "1"), "PSTAR_FX_REGION_ARTIFACTS")


def artifact_path(key: str, specs: list, device: torch.device) -> str:
    """Where the artifact of the region with `key`, built on inputs laid out as `specs`, lives: named by a hash of
    both (an input another region returns may lie otherwise than its fake value, the key's, says), the torch
    version and the device kind (and a GPU's compute capability). Alignment counts: Inductor's code for aligned
    inputs is another."""
    return os.path.join(inductor_cache_dir(), "pstar_fx-artifacts", _region_name(key, specs, device) + ".bin")


def _region_name(key: str, specs: list, device: torch.device, *more: str) -> str:
    arch = torch.cuda.get_device_capability(device) if device.type == "cuda" and torch.cuda.is_available() else ()
    layouts = [None if s is None else (s[0], tuple(s[1].shape), tuple(s[1].stride), str(s[1].dtype),
                                       ((s[2] if s[0] == "param" else s[1].storage_offset) * s[1].dtype.itemsize) % 16)
               for s in specs]
    return _digest([torch.__version__, device.type, repr(arch), key, repr(layouts), *more])[:40]


def _extra_path(key: str, specs: list, device: torch.device) -> str:
    return os.path.join(inductor_cache_dir(), "pstar_fx-extra",
                        _region_name(key, specs, device, "artifact" if artifacts_on() else "dynamo") + ".json")


def recorded_extra(key: str, specs: list, device: torch.device) -> int | None:
    """The device bytes a compiled region held beyond its ops one by one, as an earlier build measured them for the
    same region, input layouts, device, torch and build path (compile_regions._fits_compiled); None: not yet."""
    try:
        with open(_extra_path(key, specs, device)) as f:
            extra = json.load(f)["extra_bytes"]
        return extra if isinstance(extra, int) and extra >= 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_extra(key: str, specs: list, device: torch.device, extra: int) -> None:
    """Keep a measured `extra` for the next build; a cache folder that cannot be written costs the next build the
    measurement, nothing more."""
    path = _extra_path(key, specs, device)
    try:
        write_entry(path, {"extra_bytes": int(extra)})
    except OSError as e:
        log.debug("%s could not be written (%s); the next build measures again", path, e)


def artifact_failed(path: str) -> bool:
    """Whether the artifact at `path` failed at a first call before (`mark_artifact_failed`): its region is then built
    and run by Dynamo from the start."""
    return os.path.exists(path + ".fails")


def mark_artifact_failed(path: str, why: str) -> None:
    """Remember that the artifact at `path` failed at its first call (torch 2.11 on the H100 and H200 boxes: an
    IndexError inside Inductor's `copy_misaligned_inputs` for one region of the 4.2B and of GPT3_18B), so that no
    later build loads it only to fall back to Dynamo then (~2.7 s of a cold 4.2B compile's end, in this process)."""
    try:
        write_entry(path + ".fails", {"why": why})
    except OSError as e:
        log.debug("%s could not be written (%s)", path + ".fails", e)


def load_artifact(path: str):
    """The artifact saved at `path`, as the engine's process loads it."""
    from torch._inductor import CompiledArtifact
    return CompiledArtifact.load(path=path, format="binary")


def save_artifact(gm: torch.fx.GraphModule, examples: list, path: str):
    """The region compiled by Inductor alone on `examples` (its layouts specialized: the artifact's code asserts
    every input's size and strides), saved at `path` (written aside, then renamed: a reader never sees half)."""
    from torch._inductor import standalone_compile
    art = standalone_compile(gm, examples, dynamic_shapes="from_example_inputs")
    with written_aside(path) as part:
        art.save(path=part, format="binary")
    return art


def _digest(parts: list[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def marker(keys: list[str], device: torch.device, backend: str) -> str:
    how = "artifacts" if artifacts_on() else ""
    name = _digest([torch.__version__, str(device), backend, how, *sorted(keys)])[:32]
    return os.path.join(inductor_cache_dir(), f"pstar_fx-regions-{name}")


class Builders:
    """Worker processes building a share of the regions each (started by `start`). Each says when it has built a
    region (a file in the job folder), so this process can load that region while the workers build others:
    `wait_for(key)` returns once the region with `key` is built (or its worker has ended); `wait()` -> how many
    regions they built (0 when one failed: this process then builds the rest itself, slower, never wrong)."""

    def __init__(self, procs: list[subprocess.Popen], tmp: tempfile.TemporaryDirectory, marker: str, n_jobs: int,
                 owner: dict[str, int] | None = None, device_shared: bool = False, started: float | None = None,
                 ops: dict[str, int] | None = None):
        self._procs, self._tmp, self._marker, self._n = procs, tmp, marker, n_jobs
        self._owner = owner or {}                  # region key -> the worker building it
        self._device_shared = device_shared        # the workers hold shares of the device memory until they end
        self._built: int | None = None
        self._started = time.time() if started is None else started     # (wall clock: the workers' too)
        self._handed = time.time()                 # when they were given their shares (later, for standby ones)
        self._ops = ops or {}                      # region key -> its ops
        self.times: list[dict] = []                # per region a worker built: `wait()` fills it (`said`)

    def make_room(self, key: str) -> None:
        """Before this process builds the region with `key` itself: where the workers share the device memory and
        none builds that region (no share had room for it), wait until they have ended and given their shares
        back. Built beside them, a 70B LoRA's largest region ran out of device memory compiled and then op by
        op, which the plan counts on (two workers held 7.5 GiB each)."""
        if self._device_shared and key not in self._owner:
            self.wait()

    def wait_for(self, key: str) -> None:
        """Until the region with `key` is built by its worker, or that worker has ended (a region no worker builds:
        at once)."""
        w = self._owner.get(key)
        if w is None or self._built is not None:
            return
        done, proc = os.path.join(self._tmp.name, done_name(key)), self._procs[w]
        while not os.path.exists(done) and proc.poll() is None:
            time.sleep(0.02)

    def running(self) -> bool:
        """Whether any worker is still at work (its share of the device memory still held)."""
        return self._built is None and any(p.poll() is None for p in self._procs)

    def _end(self) -> None:
        """No worker left behind (one still running is killed), and their job files gone."""
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            p.wait()
        self._tmp.cleanup()

    def stop(self) -> None:
        """Kill the workers (the compile failed meanwhile): nothing is marked built."""
        self._built = 0
        self._end()

    def wait(self) -> int:
        if self._built is not None:
            return self._built
        failed = []
        try:
            for w, p in enumerate(self._procs):
                if p.wait():
                    with open(os.path.join(self._tmp.name, f"err{w}.txt"), errors="replace") as f:
                        failed.append(f.read().strip().splitlines()[-1:] or ["(no message)"])
            self.times = self._read_times()
        finally:
            self._end()                     # (an interrupted wait too)
        log.info("%s", self.said())
        if failed:
            log.warning("%d of %d region build workers failed (%s); building here", len(failed), len(self._procs),
                        failed[0][0])
            self._built = 0
            return 0
        with open(self._marker, "w"):
            pass
        self._built = self._n
        return self._n

    def _read_times(self) -> list[dict]:
        """What each worker wrote in its regions' files: when it was ready (imports done), when it began and ended
        each region, in seconds from the workers' start."""
        times = []
        for key, w in self._owner.items():
            try:
                with open(os.path.join(self._tmp.name, done_name(key))) as f:
                    t = json.load(f)
                times.append({"worker": w, "ops": self._ops.get(key, 0), "built": bool(t["built"]),
                              **{k: round(t[k] - self._started, 2) for k in ("ready", "began", "ended")},
                              **_startup(t.get("startup"), self._started)})
            except (OSError, ValueError, KeyError, TypeError):
                continue                    # (a worker that ended before it: nothing to say)
        return sorted(times, key=lambda t: t["began"])

    def said(self) -> str:
        """One line: when each worker was ready and done, and its regions (ops, seconds) in the order it built them."""
        if not self.times:
            return "region build workers: no times"
        by: dict[int, list[dict]] = {}
        for t in self.times:
            by.setdefault(t["worker"], []).append(t)
        parts = []
        for w, ts in sorted(by.items()):
            spans = ", ".join(f"{t['ops']} ops {t['ended'] - t['began']:.1f} s" + ("" if t["built"] else " (not built)")
                              for t in ts)
            how = ""
            if "imported" in ts[0]:
                how = (f" (began at {ts[0]['spawned']:.1f} s, " if "spawned" in ts[0] else " (") + (
                    f"torch and pstar_fx imported at {ts[0]['imported']:.1f} s, {ts[0]['ready_cpu_s']:.1f} s "
                    "of CPU by ready)")
            parts.append(f"worker {w} ready at {ts[0]['ready']:.1f} s{how}, done at {ts[-1]['ended']:.1f} s: {spans}")
        handed = self._handed - self._started
        return (f"region build workers ({len(by)}), seconds from their start"
                + (f" (their shares handed at {handed:.1f} s)" if handed >= 0.1 else "") + ": " + "; ".join(parts))


def _startup(said, started: float) -> dict:
    """A worker's start (region_worker.STARTUP) in seconds from the workers' start: when its process began, when
    torch and pstar_fx were imported, its CPU seconds by then and by ready. Where a slow start goes on the box:
    its imports' CPU (a slow core), or waiting beside the compile (cores or disk busy)."""
    if not isinstance(said, dict):
        return {}
    try:
        out = {"imported": round(said["imported"] - started, 2), "imported_cpu_s": round(said["imported_cpu"], 2),
               "ready_cpu_s": round(said["ready_cpu"], 2)}
        if said.get("began") is not None:
            out["spawned"] = round(said["began"] - started, 2)
        return out
    except (KeyError, TypeError):
        return {}


def done_name(key: str) -> str:
    """The file a worker writes in its job folder once it has built the region with `key`."""
    return "done-" + _digest([key])[:24]


def _worker_env(threads: int) -> dict[str, str]:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # pstar_fx's parent
    return dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=str(threads), PSTAR_FX_BUILD_WORKERS="0",
                PYTHONPATH=os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))


class Standby:
    """Build workers started before the capture (`python -m pstar_fx.passes.region_worker --standby JOB`), importing
    and warming up while the step is captured and planned, for `start` to hand their shares to. On the H100 box a
    worker was ready 3.5 s after it started and its first region took ~4 s more than later ones of its size: with
    the workers started after the regions pass, ~7 s of a cold 4.2B compile's 24 s of builds. `close()` kills every
    worker not handed a share (a standby worker also exits by itself once this process is gone)."""

    def __init__(self, workers: int):
        self.tmp = tempfile.TemporaryDirectory(prefix="pstar_fx-regions-")
        self.started = time.time()
        self.procs: list[subprocess.Popen] = []
        self._taken = 0
        env = _worker_env(max(1, (os.cpu_count() or 1) // workers))
        try:
            for w in range(workers):
                with open(os.path.join(self.tmp.name, f"err{w}.txt"), "wb") as err:
                    self.procs.append(subprocess.Popen([sys.executable, "-m", WORKER, "--standby", self.job(w)],
                                                       env=env, stdout=subprocess.DEVNULL, stderr=err))
        except BaseException:
            self.close()
            raise

    def job(self, w: int) -> str:
        return os.path.join(self.tmp.name, f"job{w}.pkl")

    def take(self, workers: int) -> int:
        """Up to `workers` of them for `start` (how many it gets); the others are sent away."""
        self._taken = min(workers, len(self.procs))
        self._send_away(self._taken)
        return self._taken

    def _send_away(self, first: int) -> None:
        """The workers from `first` on killed and reaped at once: one still importing would take seconds to read a
        note, and the compile must not wait for it (its compile processes end with it: they watch their parent)."""
        for p in self.procs[first:]:
            if p.poll() is None:
                p.kill()
            p.wait()

    def close(self) -> None:
        """Every worker not taken sent away; the folder removed unless some were taken (the Builders made of them
        own it then)."""
        self._send_away(self._taken)
        if not self._taken:
            self.tmp.cleanup()


def _compile_memo(key: str) -> str:
    return os.path.join(inductor_cache_dir(), "pstar_fx-compiles", f"{key}.json")


def remember_built(key: str, marker_path: str) -> None:
    """A compile known by `key` before its capture (reserve_cache.key: model, inputs, config, device, torch) built
    the regions that `marker_path` marks: its next compile starts no standby workers while that marker stands."""
    try:
        write_entry(_compile_memo(key), {"marker": marker_path})
    except OSError as e:
        log.debug("%s could not be written (%s)", _compile_memo(key), e)


def probably_built(key: str) -> bool:
    """Whether the compile known by `key` built its regions here before (`remember_built`): then they load from the
    cache and standby workers would start for nothing. A guess: where wrong, the workers start after the regions
    pass, as without a standby."""
    try:
        with open(_compile_memo(key)) as f:
            return os.path.exists(json.load(f)["marker"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def standby_on() -> bool:
    """PSTAR_FX_BUILD_STANDBY (default 1; 0: the workers start after the regions pass, an A/B of the head start)."""
    return parse_flag(os.environ.get("PSTAR_FX_BUILD_STANDBY", "1"), "PSTAR_FX_BUILD_STANDBY")


def standby_workers() -> int:
    """How many build workers a cold compile would start (`workers_for` with regions to spare): what `Standby`
    starts."""
    return workers_for(1 << 20)


def start(jobs: list[tuple[str, torch.fx.GraphModule, list]], device: torch.device, backend: str,
          standby: Standby | None = None) -> Builders | None:
    """Start building `jobs` ((key, region graph, input specs) of the regions whose inputs' layouts are known) in
    worker processes, filling Inductor's caches for this process to load; None where none start (the cache has
    them already, there are too few, or workers are off). The caller goes on meanwhile (the engine writes the
    initial weights) and calls `wait()` before it builds the regions itself. `standby`: workers started ahead
    (`Standby`), handed the shares instead of new ones; those not needed are sent away."""
    try:
        return _start(jobs, device, backend, standby)
    finally:
        if standby is not None:
            standby.close()


def _start(jobs, device: torch.device, backend: str, standby: Standby | None) -> Builders | None:
    if backend != "inductor" or not jobs:
        return None
    marker_path = marker([k for k, _, _ in jobs], device, backend)
    if os.path.exists(marker_path):
        return None
    workers = workers_for(len(jobs))
    # The chunk memory is allocated; the step's activations are not yet. The workers share most of what is free
    # (each capped at its part: one overrunning it loses that region alone, never the engine), the rest is left to
    # this process's init; each gets the regions it has room for, this process builds the others. Uncapped, four
    # workers ran a 70B LoRA's GPU out of memory; capped at a quarter each (5.9 GiB), all four failed on its largest.
    fraction = None
    if device.type == "cuda" and workers >= 2:
        free, total = torch.cuda.mem_get_info(device)
        workers, room, chosen = fit_workers([room_needed(specs) for _, _, specs in jobs], WORKERS_SHARE * free,
                                            workers)
        jobs = [jobs[i] for i in chosen]
        workers = min(workers, len(jobs))
        fraction = room / total
    if workers < 2 or len(jobs) < 2:
        return None
    threads = max(1, (os.cpu_count() or 1) // workers)          # Inductor's own kernel-compile pool, per worker
    ready = standby.take(workers) if standby is not None else 0   # workers started ahead: the first shares theirs
    if ready:
        procs, tmp, started = standby.procs[:ready], standby.tmp, standby.started
    else:
        procs, tmp, started = [], tempfile.TemporaryDirectory(prefix="pstar_fx-regions-"), time.time()
    env, owner = _worker_env(threads), {}
    try:
        for w, share in enumerate(shares(jobs, workers)):
            path = os.path.join(tmp.name, f"job{w}.pkl")
            with written_aside(path) as part, open(part, "wb") as f:     # (whole once it exists: a standby waits)
                pickle.dump({"regions": [(gm, specs) for _, gm, specs in share], "device": str(device),
                             "artifacts": [artifact_path(k, sp, device) if artifacts_on() else None
                                           for k, _, sp in share],
                             "done": [os.path.join(tmp.name, done_name(k)) for k, _, _ in share],
                             "inductor_config": torch._inductor.config.save_config(), "threads": threads,
                             "memory_fraction": fraction}, f)
            owner.update({k: w for k, _, _ in share})
            if w < ready:
                continue                    # a standby worker: it was waiting for this file
            # (its messages to a file: a pipe nobody reads until the end could fill and stall the worker)
            with open(os.path.join(tmp.name, f"err{w}.txt"), "wb") as err:
                procs.append(subprocess.Popen([sys.executable, "-m", WORKER, path], env=env,
                                              stdout=subprocess.DEVNULL, stderr=err))
    except BaseException:                   # the ones started must not mark a partial set built
        Builders(procs, tmp, marker_path, len(jobs)).stop()
        raise
    return Builders(procs, tmp, marker_path, len(jobs), owner, device_shared=fraction is not None, started=started,
                    ops={k: n_ops(gm) for k, gm, _ in jobs})


def shares(jobs: list[tuple[str, torch.fx.GraphModule, list]], workers: int) -> list[list]:
    """`jobs` split over `workers` so that they finish together: the largest region first, each to the worker with
    the least work so far, counting a region's work as its ops (what Inductor lowers and generates kernels for).
    Regions differ (an 18B GPT's 24 distinct ones hold 5 to 110 ops): dealt out in turn, one of 4 workers got 445 of
    their 1304 ops; shared this way, at most 332. Each share is then built in `jobs`' order (the step's: the
    compiling process loads the regions in that order, each as soon as it is built)."""
    load = [0] * workers
    out: list[list] = [[] for _ in range(workers)]
    at = {id(job): i for i, job in enumerate(jobs)}
    for job in sorted(jobs, key=lambda j: -n_ops(j[1])):
        w = load.index(min(load))
        out[w].append(job)
        load[w] += n_ops(job[1])
    return [sorted(share, key=lambda j: at[id(j)]) for share in out]


def fit_workers(needs: list[int], free: float, most: int) -> tuple[int, float, list[int]]:
    """(workers, each one's bytes, the regions they build) for regions needing `needs` bytes each, `free` bytes
    shared equally: the count (2 to `most`) whose share has room for the most regions, the more workers on a tie.
    An 18B GPT's regions all fit four shares; a 70B LoRA's largest fit none, its smaller ones do."""
    best = None
    for w in range(most, 1, -1):
        room = free / w
        fits = [i for i, n in enumerate(needs) if n <= room]
        if best is None or len(fits) > len(best[2]):
            best = (w, room, fits)
    return best if best is not None else (0, 0.0, [])


def room_needed(specs: list) -> int:
    """Device bytes a worker needs to build a region, guessed: its inputs (the zeros it is built on) three times
    over, for what it returns and makes in between (a guess errs only in speed: a region a worker has no room for
    is built by the engine's process)."""
    inputs = 0
    for spec in specs:
        if spec is not None:
            kind, layout, _ = spec
            elems = math.prod(layout.shape) if kind == "param" else layout.storage_elems
            inputs += elems * layout.dtype.itemsize
    return 3 * inputs


def n_ops(gm: torch.fx.GraphModule) -> int:
    """The ops a region's graph calls (what `Region`'s repr counts too)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")
