"""The spread of the calibration's matmul rate across fresh processes on one GPU: the best of three single 4096-cube
matmuls after one warm-up (the calibration until session 37) against `costs._sustained` (since), each process doing
what the calibration's child does first (the cuBLAS workspaces) and then one of the two, alternating which.

    python bench/calibration_spread.py [--processes 12]

Prints one line per process and a summary line `SPREAD method min median max (TFLOPs)`.
"""
import argparse
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def child(method: str) -> None:
    import torch

    from pstar_fx.planning import costs
    device, n = torch.device("cuda"), 4096
    costs._workspace_bytes(device, torch.bfloat16)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    timer = costs._timeit if method == "single" else costs._sustained
    print(2 * n**3 / timer(lambda: a @ a, device) / 1e12)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=12)
    ap.add_argument("--child", choices=("single", "sustained"))
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    got = {"single": [], "sustained": []}
    for i in range(args.processes):
        method = ("single", "sustained")[i % 2]
        out = subprocess.run([sys.executable, __file__, "--child", method], capture_output=True, text=True)
        if out.returncode:
            print(f"process {i} ({method}) failed: {out.stderr.strip()[-400:]}")
            continue
        got[method].append(float(out.stdout.strip().splitlines()[-1]))
        print(f"process {i:2d} {method:9s} {got[method][-1]:7.1f} TFLOPs", flush=True)
    for method, vals in got.items():
        if vals:
            print(f"SPREAD {method} {min(vals):.1f} {statistics.median(vals):.1f} {max(vals):.1f} ({len(vals)} processes)")


if __name__ == "__main__":
    main()
