"""Host correction (adam_undo with a redo: undo a speculative step, apply it again with the clip coefficient; issue 24)
against the host Adam, in one process, on the same buffers: a STREAM triad, our Adam in the engine's
configuration, and the correction at the kernels' best SIMD level (and, with --old, at the scalar level: the
arithmetic of the kernel before issue 24, bit for bit the same results).

    python bench/host_undo_bench.py                         # 64M elements, the kernels' default threads
    python bench/host_undo_bench.py --elems 16M --old       # the scalar (pre-issue-24) kernel too
    python bench/host_undo_bench.py --json out.json

Bytes per element, as counted here (the grad and the 16-bit copy as the engine's host chunks have them: bf16):
  triad        12 B (STREAM's count)
  adam         28 B: read master, exp_avg, exp_avg_sq 12 B + grad 2 B; write master, exp_avg, exp_avg_sq 12 B +
               the bf16 copy 2 B (no non-finite check: the engine's correction path has checked the norm)
  correction   28 B: the same arrays, read and written once (cpu_adam_impl.h, adam_undo_range)
  copy_only    16 B: the correction's 16-bit copy alone (part "copy"): reads the state and the grad, writes the copy
  rescale      28 B: the one-pass fp32 correction the runtime runs (kernels.adam_rescale: no undo, no float64)
  rescale_copy 16 B: its 16-bit copy alone
Every figure is the best of --rounds; the configurations are interleaved round by round over the same buffers.
The correction's target (issue 24): >= 0.8x the Adam's rate. The correction does twice the Adam's divides and
square roots (the step's update term is recomputed bit for bit, then the new step's), so where the Adam runs
from cache it is bound by those (~0.5x in cache on one core); the target holds where memory binds the Adam.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from pstar_fx.kernels import cpu_adam

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_adam_bench import HYPER, TRIAD_BYTES, Bench, _cpu_model, _elems  # noqa: E402

OUR_BYTES = CORRECTION_BYTES = 28
COPY_ONLY_BYTES = 16        # reads master, exp_avg, exp_avg_sq and the grad, writes the 16-bit copy
BETAS = HYPER["betas"]


def correction(b: Bench, threads: int, simd: str, redo_scale: float, part: int = 0) -> float:
    """Undo the last Adam step (grad scale 1) and apply it again with grad / redo_scale; `part` 3: only the 16-bit
    copy the correction would write (the state left as it is); 4 and 5: the same by the one-pass fp32 rescale."""
    t0 = time.perf_counter()
    cpu_adam.adam_undo(b.p, b.g16, b.m, b.v, step=max(b.step, 1), lr=HYPER["lr"], beta1=BETAS[0], beta2=BETAS[1],
                       eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], grad_scale=1.0,
                       decoupled_weight_decay=True, redo_scale=redo_scale, param_out=b.out, num_threads=threads,
                       simd=simd, part=part)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elems", type=_elems, default=64 << 20, help="elements per buffer (e.g. 64M, 16M)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; every figure is the best of them")
    ap.add_argument("--threads", default="", help="comma-separated thread counts (default: the kernels' default)")
    ap.add_argument("--old", action="store_true", help="also time the scalar level (the pre-issue-24 arithmetic)")
    ap.add_argument("--redo-scale", type=float, default=1.0,
                    help="the redo's grad scale (1: the state comes back where it was, round after round)")
    ap.add_argument("--json", metavar="PATH", help="write the rows and the machine's description here")
    args = ap.parse_args(argv)
    if not cpu_adam.available():
        print(f"the C++ extension is not built: {cpu_adam.extension()}", file=sys.stderr)
        return 2
    threads = [int(t) for t in args.threads.split(",") if t] or [cpu_adam.default_threads()]
    b = Bench(args.elems, register=False)
    n = args.elems
    build = cpu_adam.extension().build_info()
    info = {"cpu": _cpu_model(), "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "default_threads": cpu_adam.default_threads(), "torch": torch.__version__, "build": build, "elems": n,
            "rounds": args.rounds, "redo_scale": args.redo_scale}
    print(f"# {info['cpu']}: {info['cpus']} CPUs, {info['default_threads']} physical cores in the affinity mask; "
          f"simd {build['simd']}; {n / 2**20:.0f}M elements ({n * 30 / 2**30:.2f} GiB of state, grad and copy); "
          f"best of {args.rounds}")
    rows = []
    for T in threads:
        configs = {
            "triad": lambda: b.triad(T, False, 1),
            "triad_nt": lambda: b.triad(T, True, 1),
            "adam": lambda: b.ours(T, False, cpu_adam.STORES, cpu_adam.SCHEDULE, cpu_adam.PREFETCH_ELEMS),
            f"correction_{build['simd']}": lambda: correction(b, T, "auto", args.redo_scale),
            # the correction's 16-bit copy alone (adam_undo part "copy"): what a correction must write before the
            # next forward reads the chunk, if the rest were folded into the chunk's next update (issue 24)
            f"copy_only_{build['simd']}": lambda: correction(b, T, "auto", args.redo_scale, part=3),
            # the one-pass fp32 correction the runtime uses (adam_rescale: parts 4 and 5, no float64), and its copy
            f"rescale_{build['simd']}": lambda: correction(b, T, "auto", args.redo_scale, part=4),
            f"rescale_copy_{build['simd']}": lambda: correction(b, T, "auto", args.redo_scale, part=5),
        }
        if args.old:
            configs["correction_scalar"] = lambda: correction(b, T, "scalar", args.redo_scale)
        for fn in configs.values():  # warm-up: page faults, OpenMP pools
            fn()
        best = {k: float("inf") for k in configs}
        for _ in range(args.rounds):
            for k, fn in configs.items():
                best[k] = min(best[k], fn())
        triad_gbs = max(TRIAD_BYTES * n / best["triad"], TRIAD_BYTES * n / best["triad_nt"]) / 1e9
        for k, t in best.items():
            counted = (TRIAD_BYTES if k.startswith("triad") else
                       COPY_ONLY_BYTES if k.startswith(("copy", "rescale_copy")) else OUR_BYTES)
            gbs = counted * n / t / 1e9
            rows.append({"threads": T, "config": k, "seconds": t, "gparams_s": n / t / 1e9, "bytes_counted": counted,
                         "gb_s": gbs, "vs_adam": None if k.startswith("triad") else best["adam"] / t,
                         "vs_triad": gbs / triad_gbs})
    print(f"{'threads':>7}  {'config':<22} {'ms':>9} {'G params/s':>10} {'B/elem':>6} {'GB/s':>7} {'x adam':>7} "
          f"{'x triad':>7}")
    for r in rows:
        gp = "" if r["config"].startswith("triad") else f"{r['gparams_s']:.3f}"
        va = "" if r["vs_adam"] is None else f"{r['vs_adam']:.2f}"
        print(f"{r['threads']:>7}  {r['config']:<22} {r['seconds'] * 1e3:>9.2f} {gp:>10} {r['bytes_counted']:>6} "
              f"{r['gb_s']:>7.1f} {va:>7} {r['vs_triad']:>7.2f}")
    print("# adam: bf16 grad in, bf16 copy out, no non-finite check (the engine's correction path); correction: "
          f"undo + redo (grad scale 1 -> {args.redo_scale}) in one pass, the same arrays. x triad: against the "
          "better of the plain-store and non-temporal triads.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
