"""cli: the `pstar-fx` command line, one module per subcommand (main.py assembles them)."""
import pstar_fx  # noqa: F401  (tests patch cli.pstar_fx.__file__: an installed wheel has no bench/ beside it)

from .main import STEPS_ENV, _Progress, flops_per_token, main

__all__ = ["main", "STEPS_ENV", "flops_per_token"]
