"""`python -m pstar_fx.cli ...`: what the `pstar-fx` console script runs (torchrun relaunches this way)."""
import sys

from .main import main

sys.exit(main())
