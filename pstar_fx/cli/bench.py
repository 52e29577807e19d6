"""bench: `pstar-fx bench` — run the repository's pytest-benchmark cases (bench/test_bench_*.py): save a baseline,
compare with it. Needs a source checkout (pip install -e .) and the dev extra."""
from __future__ import annotations

import glob
import shlex
import subprocess
import sys
from pathlib import Path

import pstar_fx

from .args import positive_int


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="run the benchmark cases in bench/ (pytest-benchmark): save, compare",
                           description="Run the repository's benchmark cases (bench/test_bench_*.py) with "
                                       "pytest-benchmark, --benchmark-only: the CPU cases by default, the GPU cases "
                                       "(marked gpu) with --gpu. Prints the pytest command and exits with its code "
                                       "(1: a case failed or a comparison exceeded --fail; 2: no bench/ folder or "
                                       "no saved run of that name). Needs a source checkout (pip install -e .) and "
                                       "the dev extra.")
    bench.add_argument("--save", metavar="NAME", help="save this run as NAME: STORAGE/MACHINE/NNNN_NAME.json "
                       "(pytest-benchmark's --benchmark-save)")
    bench.add_argument("--compare", metavar="NAME", help="compare with the latest run saved as NAME on this machine "
                       "(a table of both; --benchmark-compare)")
    bench.add_argument("--fail", type=positive_int, metavar="PCT", help="with --compare: fail (exit 1) when a "
                       "case's mean time is more than PCT%% (a whole number) above the saved run's "
                       "(--benchmark-compare-fail=mean:PCT%%)")
    bench.add_argument("-k", dest="keyword", metavar="EXPR", help="only the cases matching this pytest -k expression")
    bench.add_argument("--gpu", action="store_true", help="the GPU cases instead of the CPU ones (they skip, saying "
                       "why, without CUDA)")
    bench.add_argument("--storage", metavar="DIR", help="where runs are saved and looked up (default: .benchmarks "
                       "in the repository)")
    bench.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARG",
                       help="after --: more pytest options, passed on as they are (e.g. -- -x --benchmark-json=F)")


def _bench_dir() -> Path | None:
    """The repository's bench/ folder, beside the package's folder in a checkout (and so in an editable install);
    None when there is none, as in an installed wheel."""
    bench = Path(pstar_fx.__file__).resolve().parent.parent / "bench"
    return bench if any(bench.glob("test_bench_*.py")) else None


def run(args, parser) -> int:
    if args.fail is not None and args.compare is None:
        parser.error("bench --fail PCT needs --compare NAME, the saved run to compare with")
    bench = _bench_dir()
    if bench is None:
        print(f"pstar-fx bench: error: no bench/ folder with test_bench_*.py beside the package "
              f"({Path(pstar_fx.__file__).resolve().parent.parent}): the benchmark cases live in the source "
              "repository; run from a checkout installed with pip install -e .", file=sys.stderr)
        return 2
    try:
        from pytest_benchmark.utils import get_machine_id
    except ImportError:
        print("pstar-fx bench: error: pytest-benchmark is not installed: pip install -e \".[dev]\"", file=sys.stderr)
        return 2
    repo = bench.parent
    storage = Path(args.storage).resolve() if args.storage else repo / ".benchmarks"
    cmd = [sys.executable, "-m", "pytest", str(bench), "--benchmark-only", "-rs",
           "-m", "gpu" if args.gpu else "not gpu", f"--benchmark-storage={storage}"]
    if args.keyword:
        cmd += ["-k", args.keyword]
    if args.save:
        cmd.append(f"--benchmark-save={args.save}")
    if args.compare:
        # pytest-benchmark matches --benchmark-compare against the start of a file name (NNNN_NAME.json), so a
        # name is looked up here: the latest run saved under exactly that name on this machine
        machine_dir = storage / get_machine_id()
        saved = sorted(machine_dir.glob(f"[0-9][0-9][0-9][0-9]_{glob.escape(args.compare)}.json"))
        if not saved:
            names = sorted({p.stem.partition("_")[2] for p in machine_dir.glob("[0-9][0-9][0-9][0-9]_*.json")})
            print(f"pstar-fx bench: error: no run saved as {args.compare!r} in {machine_dir} ("
                  + (f"saved: {', '.join(names)}" if names else "none saved yet")
                  + f"); save one first: pstar-fx bench --save {args.compare}", file=sys.stderr)
            return 2
        cmd.append(f"--benchmark-compare={saved[-1]}")
        if args.fail is not None:
            cmd.append(f"--benchmark-compare-fail=mean:{args.fail}%")
    cmd += args.pytest_args
    print(f"running in {repo}: {shlex.join(cmd)}", flush=True)
    return subprocess.run(cmd, cwd=repo, check=False).returncode
