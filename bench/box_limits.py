"""The box's measured limits, one versioned record (issue 27): what every training row of the same device call is
read against. Each figure is the best of --rounds; a figure the machine cannot give (no CUDA, no C++ extension) is
left out with the reason under "missing".

    python bench/box_limits.py [--elems 256M] [--copy-bytes 1G] [--rounds 5] [--json FILE]
    bash bench/gpu_run.sh limits            # on the device machine: $OUT/limits.json, beside the rows' records

The record ("version" 1), under "limits":
  h2d_gb_s, d2h_gb_s          pinned copies one way at a time (--copy-bytes each)
  both_ways_h2d_gb_s, both_ways_d2h_gb_s   each direction while the other runs too (two streams)
  device_copy_gb_s            device memory, a copy's read + write
  matmul_tflops               bf16 matmul, 8192 x 8192 x 8192
  host_triad_gb_s             STREAM triad on the host's cores (12 B/elem counted; the kernels' extension)
  host_adam_gparams_s         our C++ Adam alone, fp32 moments and bf16 moments (the engine's configuration)
  host_adam_beside_copies_gparams_s   the same, fp32 moments, while copies run both ways; beside it the copies'
                              rate each way then (host memory is one limit: bench/host_adam_bench.py)
and "rates": pstar_fx's own calibration, measured afresh (planning/costs.py: what the planner's estimates use).
"box" says what was measured: GPU, CPU, cores, host memory, torch, the extension's SIMD level.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import host_adam_bench as hab  # noqa: E402  (the triad, the host Adam and the copies beside it)

VERSION = 1


def box() -> dict:
    info = {"cpu": hab._cpu_model(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "host_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_bytes=p.total_memory, gpu_uuid=str(getattr(p, "uuid", "")))
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    from pstar_fx.kernels import cpu_adam
    if cpu_adam.available():
        info["simd"] = cpu_adam.extension().build_info()["simd"]
    # the host's transparent huge pages and NUMA nodes: what a host rate measured on one box may owe to them
    for key, path in (("thp_enabled", "/sys/kernel/mm/transparent_hugepage/enabled"),
                      ("thp_defrag", "/sys/kernel/mm/transparent_hugepage/defrag")):
        try:
            with open(path) as f:
                info[key] = f.read().strip()
        except OSError:
            pass
    nodes = "/sys/devices/system/node"
    if os.path.isdir(nodes):
        info["numa_nodes"] = sum(1 for d in os.listdir(nodes) if d.startswith("node") and d[4:].isdigit())
    return info


def _best(fn, rounds: int) -> float:
    fn()                                        # warm: first touches, pools, lazy state
    return min(fn() for _ in range(rounds))


def device_limits(copy_bytes: int, rounds: int) -> dict:
    from pstar_fx.planning.costs import _timeit     # (the calibration's timer: best of `reps` after a warm-up)
    cuda = torch.device("cuda")
    host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dev = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda").fill_(1)
    other = torch.empty_like(dev)
    out = {"h2d_gb_s": copy_bytes / _timeit(lambda: dev.copy_(host, non_blocking=True), cuda, rounds) / 1e9,
           "d2h_gb_s": copy_bytes / _timeit(lambda: host.copy_(dev, non_blocking=True), cuda, rounds) / 1e9,
           "device_copy_gb_s": 2 * copy_bytes / _timeit(lambda: other.copy_(dev), cuda, rounds) / 1e9}
    del host, dev, other
    both = hab.Copies(copy_bytes)               # both directions at once, each on its own stream
    rates = []
    for _ in range(rounds):
        with both:
            time.sleep(0.3)
        rates.append(both.rate)
    out["both_ways_h2d_gb_s"] = out["both_ways_d2h_gb_s"] = max(rates) / 1e9   # (each moves nbytes a round)
    del both
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out["matmul_tflops"] = 2 * n**3 / _timeit(lambda: a @ a, cuda, rounds) / 1e12
    return out


def host_limits(elems: int, rounds: int, copy_bytes: int | None) -> dict:
    from pstar_fx.kernels import cpu_adam
    threads = cpu_adam.default_threads()
    out = {}
    for moments in ("fp32", "bf16"):
        b = hab.Bench(elems, register=copy_bytes is not None, moments=moments)
        if moments == "fp32":
            triad = min(_best(lambda: b.triad(threads, nt, 1), rounds) for nt in (False, True))
            out["host_triad_gb_s"] = hab.TRIAD_BYTES * elems / triad / 1e9
        adam = _best(lambda: b.ours(threads, False, cpu_adam.STORES, cpu_adam.SCHEDULE, cpu_adam.PREFETCH_ELEMS),
                     rounds)
        out.setdefault("host_adam_gparams_s", {})[moments] = elems / adam / 1e9
        if moments == "fp32" and copy_bytes is not None:
            row = hab.beside_copies(b, threads, rounds, copy_bytes, hab.OUR_BYTES)
            out["host_adam_beside_copies_gparams_s"] = row["beside_gparams_s"]
            out["copies_beside_host_adam_gb_s"] = row["beside_copy_gb_s"]
        del b
    out["host_threads"] = threads
    return out


def calibrated_rates() -> dict:
    """pstar_fx's calibration measured now (not its cache): the figures the planner's estimates are made of."""
    from pstar_fx.planning import costs
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return dataclasses.asdict(costs._measure(device, dtype, costs._rates_key(device, dtype)))


def measure(elems: int, copy_bytes: int, rounds: int) -> dict:
    from pstar_fx.kernels import cpu_adam
    record = {"version": VERSION, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "box": box(), "elems": elems, "copy_bytes": copy_bytes, "rounds": rounds, "limits": {}, "missing": {}}
    cuda = torch.cuda.is_available()
    if cuda:
        record["limits"].update(device_limits(copy_bytes, rounds))
    else:
        for k in ("h2d_gb_s", "d2h_gb_s", "both_ways_h2d_gb_s", "both_ways_d2h_gb_s", "device_copy_gb_s",
                  "matmul_tflops", "host_adam_beside_copies_gparams_s"):
            record["missing"][k] = "no CUDA device"
    if cpu_adam.available():
        record["limits"].update(host_limits(elems, rounds, copy_bytes if cuda else None))
    else:
        for k in ("host_triad_gb_s", "host_adam_gparams_s", "host_adam_beside_copies_gparams_s"):
            record["missing"][k] = f"the C++ extension is not built: {cpu_adam.extension()}"
    record["rates"] = calibrated_rates()
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elems", type=hab._elems, default=256 << 20, help="host Adam and triad elements (e.g. 256M)")
    ap.add_argument("--copy-bytes", type=hab._elems, default=1 << 30, help="bytes of each copy (e.g. 1G)")
    ap.add_argument("--rounds", type=int, default=5, help="every figure is the best of this many")
    ap.add_argument("--json", metavar="PATH", help="write the record here")
    args = ap.parse_args(argv)
    record = measure(args.elems, args.copy_bytes, args.rounds)
    for k, v in record["limits"].items():
        shown = (", ".join(f"{m} {x:.2f}" for m, x in v.items()) if isinstance(v, dict) else
                 str(v) if isinstance(v, int) else f"{v:.2f}")
        print(f"  {k:<38} {shown}")
    for k, why in record["missing"].items():
        print(f"  {k:<38} not measured: {why}")
    print("RESULT " + json.dumps(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
