"""cli: `pstar-fx train | plan | explain | bench`, thin wrappers over `pstar_fx.compile` and `pstar_fx.plan`.

    train    build a model, compile its step, train it on the stdlib's bytes or on --data (pstar_fx.data)
    plan     size a model built on the meta device against budgets: fits or not, and why; allocates nothing
    explain  compile like train, print engine.explain() (and engine.graph.code with --code)
    bench    run the repository's pytest-benchmark cases (bench/test_bench_*.py): save a baseline, compare with it

Models: a GPT from pstar_fx.models (NAME), a LLaMA (llama:NAME) or a local Hugging Face causal LM (hf:DIR, a
`save_pretrained` folder; its config alone builds fresh weights). Without a GPU the CPU plays the device tier:
train and explain then pick a device budget that the whole step would overflow, so that most chunks' fp32 state
lives on the host and chunks really move each step.
Exit codes: 0 done, 1 a clear error on one line of stderr (for plan also "does not fit", after its summary),
2 bad arguments, 130 interrupted (train saves first when --save is given); bench exits with pytest's code.
"""
from __future__ import annotations

import argparse
import logging
import sys

import pstar_fx
from pstar_fx import phases

from . import bench, explain, plan, train
from .args import one_line
from .progress import Progress

# each adds its subparser (add_parser(sub)) and runs it (run(args, parser) -> exit code)
COMMANDS = {"train": train, "plan": plan, "explain": explain, "bench": bench}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pstar-fx", description=__doc__.splitlines()[0].partition(": ")[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logger = logging.getLogger("pstar_fx")
    for h in [h for h in logger.handlers if isinstance(h, Progress)]:    # main() called again in one process
        logger.removeHandler(h)
        h.close()
    progress = Progress(live=getattr(args, "progress", "auto") != "lines" and sys.stderr.isatty())
    logger.addHandler(progress)
    logger.setLevel(logging.INFO)
    try:
        with phases.subscribe(progress.on_phase):
            return COMMANDS[args.command].run(args, parser)
    except (ValueError, TypeError, MemoryError, OSError, pstar_fx.CaptureError) as e:
        progress.close()
        print(f"pstar-fx {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 1
    finally:
        progress.close()
        logger.removeHandler(progress)
