"""How fast can the host tier's state be allocated page-locked? One JSON line per option: RESULT {json}

    python bench/pinned_alloc.py --gib 107 --buffer-mib 1800 --threads 1,2,4,8,16 --slab-gib 4,16 [--huge-pages]

The chunk store allocates its host state as many equal buffers (per host chunk: fp32 master, exp_avg, exp_avg_sq
of chunk_size elements; GPT3_18B: 107 GiB in all, 35-43 s on the H200 box one buffer after another). Options, each
on freshly allocated memory, freed before the next:

  touch            torch.zeros of every buffer, nothing locked: the first-touch cost alone
  serial           torch.zeros + cudaHostRegister, one buffer after another (the store before host_memory.py)
  threads=K        runtime.host_memory.HostBuffers with K workers: each buffer zeroed and registered on a worker
                   (what the store does now, PSTAR_FX_PIN_THREADS=K); ",huge" (--huge-pages): the same with
                   transparent huge pages asked for before the first touch (PSTAR_FX_HUGE_PAGES=1)
  touch-threads=K  the same K workers zeroing each buffer without registering it (the store's path for host memory
                   no copy reads: a host chunk's moments), so threads=K less this is what registering costs
  register-untouched=K  K workers cudaHostRegister buffers never touched (the driver faults the pages in), then zero
  pin_memory       torch.empty(pin_memory=True) (cudaHostAlloc through the caching allocator, which rounds every
                   block up to a power of two: `bytes_held` says how much that costs)
  slab=G           G GiB slabs, each zeroed by all threads in slices, then registered once; buffers are views

Fields: option, seconds, gb_per_s (of the requested bytes), bytes, bytes_held. Needs CUDA (all but `touch`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pstar_fx.runtime.host_memory import HostBuffers, register  # noqa: E402


def emit(option: str, seconds: float, nbytes: int, held: int | None = None, **extra) -> None:
    print("RESULT " + json.dumps({"option": option, "seconds": round(seconds, 3),
                                  "gb_per_s": round(nbytes / seconds / 1e9, 2), "bytes": nbytes,
                                  "bytes_held": held if held is not None else nbytes, **extra}), flush=True)


def anon_huge_bytes() -> int | None:
    """This process's memory in transparent huge pages now (None where the kernel does not say): whether the huge
    pages asked for were given (a VM's kernel may give none)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def unregister(bufs: list[torch.Tensor]) -> None:
    bufs.clear()             # the weakref finalizers of `register` unregister as the tensors go
    import gc
    gc.collect()


def run(args) -> None:
    n_elems = args.buffer_mib * 2**20 // 4
    count = max(1, int(args.gib * 2**30 // (n_elems * 4)))
    nbytes = count * n_elems * 4
    cuda = torch.cuda.is_available()
    print(f"{count} buffers of {args.buffer_mib} MiB = {nbytes / 2**30:.1f} GiB; CUDA {cuda}; "
          f"{os.cpu_count()} cores", file=sys.stderr, flush=True)

    t = time.perf_counter()
    bufs = [torch.zeros(n_elems) for _ in range(count)]
    emit("touch", time.perf_counter() - t, nbytes)
    bufs.clear()
    if not cuda:
        print("no CUDA: only `touch` measured", file=sys.stderr)
        return
    torch.cuda.init()

    for huge in ([False, True] if args.huge_pages else [False]):
        os.environ["PSTAR_FX_HUGE_PAGES"] = "1" if huge else "0"
        for k in args.threads:
            host = HostBuffers(pin=True, threads=k, device=torch.device("cuda", torch.cuda.current_device()))
            t = time.perf_counter()
            with host.batch():
                bufs = [host.empty(n_elems, torch.float32, fill=0) for _ in range(count)]
            emit(("serial" if k == 1 else f"threads={k}") + (",huge" if huge else ""), time.perf_counter() - t,
                 nbytes, unlocked=len(host.unlocked), anon_huge_bytes=anon_huge_bytes())
            unregister(bufs)
    os.environ.pop("PSTAR_FX_HUGE_PAGES")

    for k in args.threads:          # what the store does now for memory no copy reads (moments): zeroed, not locked
        host = HostBuffers(pin=True, threads=k, lock=lambda t: 0)
        t = time.perf_counter()
        with host.batch():
            bufs = [host.empty(n_elems, torch.float32, fill=0) for _ in range(count)]
        emit(f"touch-threads={k}", time.perf_counter() - t, nbytes)
        bufs.clear()

    for k in args.threads:
        if k < 2:
            continue
        t = time.perf_counter()
        bufs = [torch.empty(n_elems) for _ in range(count)]
        with ThreadPoolExecutor(k, initializer=torch.cuda.set_device, initargs=(torch.cuda.current_device(),)) as p:
            errs = list(p.map(register, bufs))
            list(p.map(torch.Tensor.zero_, bufs))
        emit(f"register-untouched={k}", time.perf_counter() - t, nbytes, failed=sum(e != 0 for e in errs))
        unregister(bufs)

    t = time.perf_counter()
    bufs = [torch.empty(n_elems, pin_memory=True) for _ in range(count)]
    for b in bufs:
        b.zero_()
    held = torch.cuda.host_memory_stats().get("reserved_bytes.current", None) if hasattr(
        torch.cuda, "host_memory_stats") else None
    emit("pin_memory", time.perf_counter() - t, nbytes, held)
    bufs.clear()
    torch._C._host_emptyCache() if hasattr(torch._C, "_host_emptyCache") else None

    threads = max(args.threads)
    for gib in args.slab_gib:
        slab_elems = int(gib * 2**30 // 4) // n_elems * n_elems or n_elems
        t = time.perf_counter()
        slabs, views = [], []
        left = count
        with ThreadPoolExecutor(threads, initializer=torch.cuda.set_device,
                                initargs=(torch.cuda.current_device(),)) as p:
            while left:
                k = min(left, slab_elems // n_elems)
                slab = torch.empty(k * n_elems)
                step = -(-slab.numel() // threads)
                list(p.map(lambda i: slab[i: i + step].zero_(), range(0, slab.numel(), step)))
                slabs.append(slab)
                views += list(slab.view(k, n_elems))
                left -= k
            errs = list(p.map(register, slabs))
        emit(f"slab={gib}", time.perf_counter() - t, nbytes, failed=sum(e != 0 for e in errs), slabs=len(slabs))
        views.clear()
        unregister(slabs)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=16, help="host state to allocate (GiB; GPT3_18B: 107)")
    ap.add_argument("--buffer-mib", type=int, default=1800, help="one buffer (a chunk's master or moment), MiB")
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16])
    ap.add_argument("--slab-gib", type=lambda s: [float(x) for x in s.split(",")], default=[4, 16])
    ap.add_argument("--huge-pages", action="store_true",
                    help="also each threads=K with transparent huge pages asked for (PSTAR_FX_HUGE_PAGES=1)")
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
