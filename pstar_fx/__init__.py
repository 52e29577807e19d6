"""pstar_fx: train models far larger than device memory, planned from the graph of the training step."""
from .capture import CaptureError
from .config import Config
from .engine import Engine, compile, plan
from .pipeline.shapes import pad_to_bucket
from .planning import BudgetError, Plan
from .runtime import StepRolledBack
from .runtime.step import StepReport
from .passes.region_builders import inductor_cache_dir

# Inductor fixes its cache folder for the process when it first needs one (/tmp/torchinductor_<user> unless
# TORCHINDUCTOR_CACHE_DIR is set): set before that, it is beside the plan cache, and lasts as long
inductor_cache_dir()

__version__ = "0.1.0"
__all__ = ["Config", "Engine", "Plan", "StepReport", "compile", "plan", "BudgetError", "CaptureError", "StepRolledBack",
           "pad_to_bucket"]
