"""region_worker: one build worker process (`python -m pstar_fx.passes.region_worker JOB`), started by
region_builders.start: builds its share of the regions, in the step's order, on zeros laid out as the step's,
filling Inductor's caches (or saving standalone artifacts), and says so region by region (a file each), built or not.
"""
from __future__ import annotations

import json
import pickle
import sys
import time

import torch

from .compile_regions import Region, _example
from ..planning.costs import written_aside
from .region_builders import save_artifact


def work(path: str) -> None:
    ready = time.time()                         # (its imports done: what a worker costs before its first build)
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
        region = None if artifact is not None else Region(gm, f"region_w{i}", "inductor", specs)
        began, built = time.time(), False
        try:
            examples = [_example(s, device) for s in specs]
            if region is None:
                save_artifact(gm, examples, artifact)
            else:
                region(*examples)
            del examples
            built = True
        except torch.OutOfMemoryError:          # the others are still worth building; the parent builds this one
            torch.cuda.empty_cache()
            print(f"region_w{i} not built: out of device memory", file=sys.stderr, flush=True)
        finally:                                # built or not, the parent may go on with it (its times in it)
            with written_aside(done) as part, open(part, "w") as f:
                json.dump({"ready": ready, "began": began, "ended": time.time(), "built": built}, f)
        if region is not None and region.eager_because is not None:
            print(f"region_w{i} not built: {region.eager_because}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    import pstar_fx  # noqa: F401  (its custom ops, which a region may call)
    work(sys.argv[1])
