"""cli: the `pstar-fx` command line, one module per subcommand; main.py assembles them (see its docstring)."""
import pstar_fx  # noqa: F401  (cli.pstar_fx: tests patch its __file__, as an installed wheel has no bench/ beside it)

from .args import STEPS_ENV
from .main import main
from .train import flops_per_token

__all__ = ["main", "STEPS_ENV", "flops_per_token"]
