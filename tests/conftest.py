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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
