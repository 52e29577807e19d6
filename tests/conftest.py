import os

# Triton reads this when its kernels are decorated, so it must be set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
