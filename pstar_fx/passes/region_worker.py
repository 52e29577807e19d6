"""region_worker: one build worker process (`python -m pstar_fx.passes.region_worker JOB`), started by
region_builders.start: builds its share of the regions, in the step's order, on zeros laid out as the step's,
filling Inductor's caches (or saving standalone artifacts), and says so region by region (a file each), built or not.

`--standby JOB`: started at compile() already (region_builders.Standby), before the capture; it imports what a build
needs (torch, Inductor) while the step is captured and planned, then waits for JOB to appear (its share; a worker
not needed is killed); it never touches the GPU before then (the plan's budget is read from what is free). It exits
by itself once the process that started it is gone.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import time

import torch

from ..planning.costs import written_aside
from .compile_regions import Region, _example
from .region_builders import artifact_failed, load_artifact, mark_artifact_failed, save_artifact


def _started() -> float | None:
    """When this process began (wall clock), from Linux's /proc; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


# where a worker's time before its first build goes (torch and pstar_fx imported by now; `Builders.said`)
STARTUP = {"began": _started(), "imported": time.time(), "imported_cpu": time.process_time()}

STANDBY_LIMIT_S = 1800      # a standby worker never handed its job gives up (its parent hung, or forgot it)


def work(path: str, ready: float | None = None) -> None:
    ready = ready or time.time()                # (its imports done: what a worker costs before its first build)
    startup = {**STARTUP, "ready_cpu": STARTUP.get("ready_cpu", time.process_time())}
    with open(path, "rb") as f:
        job = pickle.load(f)
    torch._inductor.config.load_config(job["inductor_config"])
    torch._inductor.config.compile_threads = job["threads"]
    device = torch.device(job["device"])
    if job.get("memory_fraction"):
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(job["memory_fraction"], index)
    artifacts = job.get("artifacts") or [None] * len(job["regions"])
    for i, ((gm, specs), artifact, done) in enumerate(zip(job["regions"], artifacts, job["done"])):
        region = None                           # (Dynamo's build of it, where it has one)
        began, built = time.time(), False
        try:
            examples = [_example(s, device) for s in specs]
            if artifact is not None and not artifact_failed(artifact):
                save_artifact(gm, examples, artifact)
                try:
                    # loaded back and called once here, where a failure costs this worker alone: on torch 2.11 the
                    # loaded artifacts of some regions fail at their first call (the one just built runs: H100 box,
                    # session 28), and the engine would find out only at its own
                    load_artifact(artifact)(*examples)
                except torch.OutOfMemoryError:
                    raise
                except Exception as e:          # noqa: BLE001  (Dynamo's build below is the region's path now)
                    mark_artifact_failed(artifact, f"{type(e).__name__}: {e}")
                    region = Region(gm, f"region_w{i}", "inductor", specs)
            else:
                region = Region(gm, f"region_w{i}", "inductor", specs)
            if region is not None:
                region(*examples)           # Dynamo's build, into Inductor's caches
            del examples
            built = True
        except torch.OutOfMemoryError:          # the others are still worth building; the parent builds this one
            torch.cuda.empty_cache()
            print(f"region_w{i} not built: out of device memory", file=sys.stderr, flush=True)
        finally:                                # built or not, the parent may go on with it (its times in it)
            with written_aside(done) as part, open(part, "w") as f:
                json.dump({"ready": ready, "began": began, "ended": time.time(), "built": built,
                           "startup": startup}, f)
        if region is not None and region.eager_because is not None:
            print(f"region_w{i} not built: {region.eager_because}", file=sys.stderr, flush=True)


def warm_up() -> None:
    """What a worker's first build would otherwise import: Inductor's compile path and its standalone artifacts (a
    worker's first region took ~4 s more than later ones of its size on the H100 box, on top of the 3.5 s of
    importing torch). Not its compile processes: started here, 4 workers' 16 of them importing torch at once made
    the workers ready later, not sooner (session 28). Best effort: a part that fails is left to the build."""
    try:
        import torch._inductor.compile_fx  # noqa: F401
        from torch._inductor import standalone_compile  # noqa: F401
    except Exception:                           # noqa: BLE001  (the build will say what is wrong, if anything)
        pass


def standby(path: str) -> None:
    """Warm up, then wait for the job at `path` (written aside and renamed: whole once it exists) and build it;
    exit if the parent is gone first."""
    parent = os.getppid()
    warm_up()
    ready = time.time()
    STARTUP["ready_cpu"] = time.process_time()
    deadline = time.monotonic() + STANDBY_LIMIT_S
    while not os.path.exists(path):
        if os.getppid() != parent or time.monotonic() > deadline:
            return
        time.sleep(0.02)
    work(path, ready)


if __name__ == "__main__":
    import pstar_fx  # noqa: F401  (its custom ops, which a region may call)
    if sys.argv[1] == "--standby":
        standby(sys.argv[2])
    else:
        work(sys.argv[1])
