"""Host Adam against the host's memory bandwidth, in one process: a STREAM triad (C++/OpenMP, in the
kernels' extension), torch's fused CPU AdamW, and our C++ Adam in the engine's configuration.

    python bench/host_adam_bench.py                      # 256M elements, the kernels' default threads
    python bench/host_adam_bench.py --elems 4M --rounds 3   # smoke test on a small machine
    python bench/host_adam_bench.py --sweep --json out.json # store / schedule / prefetch variants too
    python bench/host_adam_bench.py --with-copies --moments bf16   # beside pinned PCIe copies (needs CUDA)

--with-copies asks what issue 13's item 4 depends on: whether the host Adam and the PCIe copies share one limit,
the host's memory. A thread keeps pinned host->device and device->host copies running (their own streams,
both directions at once) while ours runs; each round times ours alone, the copies alone, and the two together.
Were the Adam bound by its cores, the copies would take nothing from it; bound by memory, what the copies move
is taken from what the Adam can. A host chunk updated on the GPU crosses PCIe twice (state in, state out) and
so moves as many host bytes as the host Adam would: moving updates to the GPU pays only where memory has room.

Bytes per element, as counted here:
  triad        12 B: read b, c, write a (STREAM's count; a plain store also reads a's line first, which STREAM
               does not count, so the real traffic of the plain-store triad is 16 B)
  torch fused  28 B: read param, grad (fp32), exp_avg, exp_avg_sq 16 B; write param, exp_avg, exp_avg_sq 12 B
  ours         28 B: read master, exp_avg, exp_avg_sq 12 B + grad (bf16) 2 B; write master, exp_avg,
               exp_avg_sq 12 B + the bf16 param copy 2 B. With the non-finite check the grad is read once more
               (+2 B, 30 B moved): GB/s is still reported at 28 B, so GB/s and params/s rank alike.
Every figure is the best of --rounds; the configurations are interleaved round by round, over the same
buffers (one placement of their pages for all), so a ratio compares runs seconds apart.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from pstar_fx.kernels import cpu_adam

HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
OUR_BYTES, TORCH_BYTES, TRIAD_BYTES = 28, 28, 12


def _elems(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _filled(n: int, dtype, scale: float, gen: torch.Generator) -> torch.Tensor:
    # torch.empty + a parallel fill: each page is first touched by one of torch's threads, as chunk state is
    # (filled by torch ops before the first step)
    t = torch.empty(n, dtype=torch.float32)
    t.uniform_(-scale, scale, generator=gen)
    return t if dtype == torch.float32 else t.to(dtype)


class Copies:
    """Pinned host<->device copies of `nbytes` each way, queued on two streams in a loop by a background thread
    while the context is open; `rate` is the bytes per second each direction moved over that time."""

    def __init__(self, nbytes: int):
        self.host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
        self.host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
        self.dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.dev_out = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        self.h2d, self.d2h = torch.cuda.Stream(), torch.cuda.Stream()
        self.nbytes, self.rate = nbytes, 0.0
        self._round()                                 # warm: streams and copy engines up before anything is timed

    def _round(self):
        with torch.cuda.stream(self.h2d):
            self.dev_in.copy_(self.host_in, non_blocking=True)
        with torch.cuda.stream(self.d2h):
            self.host_out.copy_(self.dev_out, non_blocking=True)
        self.h2d.synchronize()
        self.d2h.synchronize()

    def _loop(self):
        while not self._stop.is_set():
            self._round()
            self._moved += self.nbytes

    def __enter__(self):
        import threading
        self._stop, self._moved = threading.Event(), 0
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.rate = self._moved / (time.perf_counter() - self._t0)


class Bench:
    def __init__(self, n: int, register: bool, moments: str = "fp32"):
        gen = torch.Generator().manual_seed(0)
        self.n = n
        self.p = _filled(n, torch.float32, 1.0, gen)
        self.m = _filled(n, torch.float32, 1e-3, gen)
        self.v = _filled(n, torch.float32, 1e-6, gen).abs_()
        self.g32 = _filled(n, torch.float32, 1e-2, gen)
        self.tb, self.tc = self.m, self.v     # the triad's b and c: fp32, as big as the master
        if moments == "bf16":   # Config(optimizer_state="bf16"): torch's fused AdamW has no such state
            self.m, self.v = self.m.to(torch.bfloat16), self.v.to(torch.bfloat16)
        self.g16 = self.g32.to(torch.bfloat16)
        self.out = torch.empty(n, dtype=torch.bfloat16)
        self.out.zero_()
        if register:  # page-lock the buffers as the engine's host chunks are (cudaHostRegister)
            # (unregistered when freed: a second Bench in one process may get the first one's addresses back)
            from pstar_fx.runtime import host_memory
            for name in ("p", "m", "v", "g32", "g16", "out"):
                err = host_memory.register(getattr(self, name))
                if err:
                    raise RuntimeError(f"cudaHostRegister of {name} failed: CUDA error {err}")
        self.moments = moments
        # torch's fused AdamW on the same param and moments (its state is ours: no second copy)
        self.param = torch.nn.Parameter(self.p, requires_grad=True)
        self.param.grad = self.g32
        self.opt = torch.optim.AdamW([self.param], fused=True, **HYPER)
        self.opt.state[self.param] = {"step": torch.tensor(0.0), "exp_avg": self.m, "exp_avg_sq": self.v}
        self.step = 0

    def triad(self, threads: int, nt: bool, reps: int) -> float:
        # a = master (rewritten by the next update anyway), b and c: the fp32 moments, or their fp32 originals
        return cpu_adam.stream_triad(self.p, self.tb, self.tc, reps=reps, nt=nt, num_threads=threads, scalar=0.0)

    def torch_fused(self, threads: int) -> float:
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        self.opt.step()
        return time.perf_counter() - t0

    def ours(self, threads: int, check: bool, stores: str, schedule: str, prefetch: int) -> float:
        self.step += 1
        t0 = time.perf_counter()
        ok = cpu_adam.adam_step(self.p, self.g16, self.m, self.v, step=self.step, lr=HYPER["lr"], beta1=0.9,
                                beta2=0.999, eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], grad_scale=1.0,
                                param_out=self.out, decoupled_weight_decay=True, check_finite=check,
                                num_threads=threads, stores=stores, schedule=schedule, prefetch_elems=prefetch)
        dt = time.perf_counter() - t0
        assert ok, "non-finite gradient in the benchmark's data"
        return dt


def beside_copies(b: Bench, threads: int, rounds: int, copy_bytes: int, our_bytes: int) -> dict:
    """Ours alone, the copies alone, and the two at once, interleaved round by round: the best of each."""
    copies = Copies(copy_bytes)
    alone = beside = float("inf")
    copy_alone = copy_beside = 0.0

    def ours() -> float:       # the engine's configuration: no non-finite pass, the kernels' default variant
        return b.ours(threads, False, cpu_adam.STORES, cpu_adam.SCHEDULE, cpu_adam.PREFETCH_ELEMS)

    for _ in range(rounds):
        with copies:
            time.sleep(0.3)
        copy_alone = max(copy_alone, copies.rate)
        alone = min(alone, ours())
        with copies:
            time.sleep(0.05)                          # both directions under way before the Adam starts
            took = [ours() for _ in range(3)]
        beside, copy_beside = min(beside, min(took)), max(copy_beside, copies.rate)
    n = b.n
    return {"threads": threads, "config": "beside_copies", "copy_bytes": copy_bytes,
            "alone_gparams_s": n / alone / 1e9, "beside_gparams_s": n / beside / 1e9,
            "alone_copy_gb_s": copy_alone / 1e9, "beside_copy_gb_s": copy_beside / 1e9,
            "alone_host_gb_s": our_bytes * n / alone / 1e9,
            "beside_host_gb_s": (our_bytes * n / beside + 2 * copy_beside) / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elems", type=_elems, default=256 << 20, help="elements per buffer (e.g. 256M, 4M)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; every figure is the best of them")
    ap.add_argument("--threads", default="", help="comma-separated thread counts (default: the kernels' default)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time every store / schedule variant of ours, and software prefetch distances")
    ap.add_argument("--register", action="store_true", help="page-lock the buffers with cudaHostRegister (needs CUDA)")
    ap.add_argument("--moments", choices=("fp32", "bf16"), default="fp32",
                    help="ours' moments (Config.optimizer_state); bf16 leaves torch's fused AdamW out")
    ap.add_argument("--with-copies", action="store_true",
                    help="also time ours beside pinned PCIe copies in both directions (needs CUDA)")
    ap.add_argument("--copy-bytes", type=_elems, default=1 << 30, help="bytes of each copy (--with-copies)")
    ap.add_argument("--json", metavar="PATH", help="write the rows and the machine's description here")
    args = ap.parse_args(argv)
    if not cpu_adam.available():
        print(f"the C++ extension is not built: {cpu_adam.extension()}", file=sys.stderr)
        return 2
    threads = [int(t) for t in args.threads.split(",") if t] or [cpu_adam.default_threads()]
    variants = [(cpu_adam.STORES, cpu_adam.SCHEDULE, cpu_adam.PREFETCH_ELEMS)]
    if args.sweep:
        variants += [(st, sc, 0) for sc in ("dynamic", "static") for st in ("plain", "stream_out")]
        variants += [(cpu_adam.STORES, cpu_adam.SCHEDULE, pf) for pf in (512, 2048, -1024)]
        variants = list(dict.fromkeys(variants))
    torch_threads0 = torch.get_num_threads()
    b = Bench(args.elems, args.register, args.moments)
    our_bytes = OUR_BYTES if args.moments == "fp32" else OUR_BYTES - 8   # moments 2 B each way, not 4
    n = args.elems
    info = {"cpu": _cpu_model(), "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "default_threads": cpu_adam.default_threads(), "torch": torch.__version__,
            "torch_threads": torch_threads0, "build": cpu_adam.extension().build_info(), "elems": n,
            "rounds": args.rounds, "register": args.register, "moments": args.moments,
            "thp": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
            if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") else None}
    print(f"# {info['cpu']}: {info['cpus']} CPUs, {info['default_threads']} physical cores in the affinity mask; "
          f"torch {info['torch']} ({torch_threads0} threads by default); simd {info['build']['simd']}; "
          f"{n / 2**20:.0f}M elements; best of {args.rounds}; THP {info['thp']}")

    rows = []
    for T in threads:
        configs = {"triad": lambda: b.triad(T, False, 1), "triad_nt": lambda: b.triad(T, True, 1)}
        if args.moments == "fp32":
            configs["torch_fused"] = lambda: b.torch_fused(T)
        for st, sc, pf in variants:
            tag = "" if (st, sc, pf) == variants[0] else f" [{st}, {sc}, prefetch {pf}]"
            configs[f"ours_check{tag}"] = lambda st=st, sc=sc, pf=pf: b.ours(T, True, st, sc, pf)
            configs[f"ours_nocheck{tag}"] = lambda st=st, sc=sc, pf=pf: b.ours(T, False, st, sc, pf)
        for fn in configs.values():  # warm-up: page faults, OpenMP pools, torch's lazy state
            fn()
        best = {k: float("inf") for k in configs}
        for _ in range(args.rounds):
            for k, fn in configs.items():
                best[k] = min(best[k], fn())
        triad_gbs = max(TRIAD_BYTES * n / best["triad"], TRIAD_BYTES * n / best["triad_nt"]) / 1e9
        torch_pps = n / best["torch_fused"] if "torch_fused" in best else None
        for k, t in best.items():
            counted = TRIAD_BYTES if k.startswith("triad") else TORCH_BYTES if k == "torch_fused" else our_bytes
            moved = counted + (2 if k.startswith("ours_check") else 0)
            gbs = counted * n / t / 1e9
            rows.append({"threads": T, "config": k, "seconds": t, "gparams_s": n / t / 1e9,
                         "bytes_counted": counted, "bytes_moved": moved, "gb_s": gbs,
                         "vs_torch": (n / t) / torch_pps if torch_pps and not k.startswith("triad") else None,
                         "vs_triad": gbs / triad_gbs})
        if args.with_copies:
            rows.append(beside_copies(b, T, args.rounds, args.copy_bytes, our_bytes))
    torch.set_num_threads(torch_threads0)

    print(f"{'threads':>7}  {'config':<44} {'ms':>9} {'G params/s':>10} {'B/elem':>6} {'GB/s':>7} "
          f"{'x torch':>7} {'x triad':>7}")
    for r in rows:
        if r["config"] == "beside_copies":
            continue
        vt = "" if r["vs_torch"] is None else f"{r['vs_torch']:.2f}"
        gp = "" if r["config"].startswith("triad") else f"{r['gparams_s']:.2f}"
        print(f"{r['threads']:>7}  {r['config']:<44} {r['seconds'] * 1e3:>9.2f} {gp:>10} {r['bytes_counted']:>6} "
              f"{r['gb_s']:>7.1f} {vt:>7} {r['vs_triad']:>7.2f}")
    print("# triad: a = b + s*c, 12 B/elem counted (STREAM's rule); x triad is against the better of the plain-"
          f"store and non-temporal triads. ours: bf16 grad in, bf16 copy out, {args.moments} moments, {our_bytes} B "
          "counted (+2 B grad re-read with the check).")
    for r in rows:
        if r["config"] == "beside_copies":
            print(f"# beside copies ({r['threads']} threads, {r['copy_bytes'] / 2**30:.2f} GiB each way per round): "
                  f"ours {r['alone_gparams_s']:.2f} G params/s alone, {r['beside_gparams_s']:.2f} beside the "
                  f"copies ({r['beside_gparams_s'] / r['alone_gparams_s']:.2f}x); copies {r['alone_copy_gb_s']:.1f} "
                  f"GB/s each way alone, {r['beside_copy_gb_s']:.1f} beside ours; host memory moved "
                  f"{r['alone_host_gb_s']:.1f} GB/s by ours alone, {r['beside_host_gb_s']:.1f} by both together")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
