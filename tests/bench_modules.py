"""bench/*.py scripts loaded as modules for their CPU tests (bench/ is not a package; each script puts bench/ and
the repository on sys.path itself)."""
import importlib.util
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def load(script: str, name: str):
    """bench/`script`.py as module `name`, registered in sys.modules (Dynamo looks a model's module up by name)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{script}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
