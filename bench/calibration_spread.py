"""The spread of the calibration's matmul rate across fresh processes on one GPU: the best of three single 4096-cube
matmuls after one warm-up (the calibration until session 37) against `costs._sustained` (since), each process doing
what the calibration's child does first (the cuBLAS workspaces) and then one of the two, alternating which.

    python bench/calibration_spread.py [--processes 12] [--device cpu]

Prints one line per process and a summary line `SPREAD method min median max (TFLOPs)`.
"""
import argparse
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def child(method: str, device: str) -> None:
    import torch

    from pstar_fx.planning import costs
    device = torch.device(device)
    if device.type == "cuda":
        costs._workspace_bytes(device, torch.bfloat16)
    a = costs._matmul_operand(device, torch.bfloat16)
    timer = costs._timeit if method == "single" else costs._sustained
    print(2 * a.shape[0]**3 / timer(lambda: a @ a, device) / 1e12)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=12)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (the CPU tier's calibration: 512-cube fp32)")
    ap.add_argument("--child", choices=("single", "sustained"))
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.device)
    got = {"single": [], "sustained": []}
    for i in range(args.processes):
        method = ("single", "sustained")[i % 2]
        out = subprocess.run([sys.executable, __file__, "--child", method, "--device", args.device],
                             capture_output=True, text=True)
        if out.returncode:
            print(f"process {i} ({method}) failed: {out.stderr.strip()[-400:]}")
            continue
        got[method].append(float(out.stdout.strip().splitlines()[-1]))
        print(f"process {i:2d} {method:9s} {got[method][-1]:9.3f} TFLOPs", flush=True)
    for method, vals in got.items():
        if vals:
            print(f"SPREAD {method} {min(vals):.3f} {statistics.median(vals):.3f} {max(vals):.3f} TFLOPs ({len(vals)} "
                  "processes)")


if __name__ == "__main__":
    main()
