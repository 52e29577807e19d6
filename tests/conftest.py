import os

import pytest
import torch

# Triton reads this when its kernels are decorated, so it must be set before anything imports triton
# (importing torch does not). Without a GPU the kernels run in Triton's interpreter, which is how CI tests
# them; with one they must not: interpreted kernels on CUDA tensors are orders of magnitude slower (a
# GPU test once sat for minutes in the interpreter because this was set unconditionally).
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
# The plan cache (pipeline/plan_cache.py) is off unless a test turns it on (tests/test_plan_cache.py, in a
# temporary folder): a test's plan must not depend on what an earlier run left in ~/.cache/pstar_fx.
os.environ.setdefault("PSTAR_FX_PLAN_CACHE", "0")
# Region build workers (passes/region_builders.py) are off unless a test asks for them (tests/test_region_cache.py):
# a many-core CI box would otherwise start Python processes for each cold Inductor compile of the suite.
os.environ.setdefault("PSTAR_FX_BUILD_WORKERS", "0")


_CAPTURES: dict = {}      # every step the suite has traced, by what its trace depends on (test_engine._capture_key)


@pytest.fixture(autouse=True)
def one_trace_per_step(request):
    """Each step is traced once in the suite and every later compile or plan of it takes a copy of that capture
    (test_engine.captured_once): hundreds of compiles of a few tiny models, each trace up to 2 s on a 2-core CI box.
    A test about the trace itself is marked `own_trace` and traces every time."""
    if request.node.get_closest_marker("own_trace"):
        yield
        return
    from test_engine import captured_once
    with captured_once(_CAPTURES):
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cache_folder(tmp_path, monkeypatch):
    """A fresh cache folder (PSTAR_FX_CACHE) holding only the suite's CPU rates, the plan cache on. The rates are
    copied in so that nothing is measured again: a new measurement would differ from the one a test's budget was
    probed with, and would stand for the rest of the process (costs._MEASURED), changing later tests' plans."""
    import dataclasses
    import json

    from pstar_fx.planning import costs
    cpu = torch.device("cpu")
    rates = costs.calibrate(cpu, torch.float32)
    monkeypatch.setattr(costs, "_MEASURED", dict(costs._MEASURED))
    monkeypatch.setenv("PSTAR_FX_CACHE", str(tmp_path))
    with open(costs._cache_path(costs._device_key(cpu) + "-float32"), "w") as f:
        json.dump(dataclasses.asdict(rates), f)
    assert costs.calibrate(cpu, torch.float32) == rates
    monkeypatch.setenv("PSTAR_FX_PLAN_CACHE", "1")
    return tmp_path
