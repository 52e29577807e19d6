"""explain: `pstar-fx explain` — compile like train, print engine.explain() (and engine.graph.code with --code,
the plan along the step as an image with --plot)."""
from __future__ import annotations

import sys

from .adapt import add_flags
from .args import TRAIN_SEQ_CAP, common, config_flag, positive_int
from .train import compile_model


def add_parser(sub) -> None:
    explain = sub.add_parser("explain", help="compile like train and print the plan and schedule")
    common(explain, "small")
    explain.add_argument("--seq", type=positive_int,
                         help=f"sequence length (default the model's block_size, at most {TRAIN_SEQ_CAP})")
    config_flag(explain, "seed", "Here it also seeds the model's own weights (default 0).", default=0)
    add_flags(explain)
    explain.add_argument("--code", action="store_true", help="also print engine.graph.code")
    explain.add_argument("--plot", metavar="OUT.png", help="also draw the plan along the step to this image: "
                         "bytes per tier against the budgets, chunk moves, each chunk's tier (needs matplotlib: "
                         "pip install pstar_fx[plot])")


def run(args, parser) -> int:
    _, engine, _ = compile_model(args, parser, TRAIN_SEQ_CAP)
    print(engine.explain())
    if args.code:
        print(engine.graph.code)
    if args.plot:
        try:
            print(f"plot: {engine.plot_memory(args.plot, title=str(args.model))}")
        except ImportError as e:          # matplotlib is an optional extra
            print(f"pstar-fx explain: error: {e}", file=sys.stderr)
            return 1
    return 0
