"""Save and load a whole training state (weights + Adam moments) against the disk's own bandwidth.

    python bench/checkpoint_bench.py [--model GPT_h3072_L36] [--dir DIR] [--probe-gib 8] [--json FILE]

In one process: compile the model (bf16 on the GPU, the planner places the chunks), take one step so the
moments are real, then
  1. the disk's sequential bandwidth: write --probe-gib GiB in 64 MiB blocks and fsync, then read it back
     (both through the page cache, as the checkpoint is; the file is deleted before the save);
  2. engine.save(DIR): seconds, bytes, GB/s and its ratio to the write bandwidth;
  3. engine.load(DIR) into the same engine: seconds, GB/s and its ratio to the read bandwidth, then a check
     that a sample of weights and moments came back bit for bit.
During 2 and 3 a thread samples the process's anonymous resident memory (RssAnon: what the save and load
allocate; the page cache and file mappings are not the process's) every 5 ms; the peak above the level
before is reported in bytes and in chunks (one chunk's fp32 bytes).
Prints one line: RESULT {json}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pstar_fx  # noqa: E402
from pstar_fx.models import GPT, gpt_config  # noqa: E402

BLOCK = 64 * 2**20


def rss_anon() -> int:
    """Anonymous resident bytes of this process (Linux /proc; falls back to the whole RSS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil
    return psutil.Process().memory_info().rss


class PeakSampler:
    """The peak of rss_anon() above its level at start, sampled every 5 ms on a thread."""

    def __enter__(self):
        self.base = self.peak = rss_anon()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_anon())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def disk_bandwidth(path: str, gib: float) -> tuple[float, float]:
    """(write, read) bytes/s of one sequential file of `gib` GiB, written with fsync, then read."""
    n = int(gib * 2**30) // BLOCK
    buf = os.urandom(BLOCK)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(n):
            f.write(buf)
        os.fsync(f.fileno())
    write = n * BLOCK / (time.perf_counter() - t0)
    view = bytearray(BLOCK)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    read = n * BLOCK / (time.perf_counter() - t0)
    os.remove(path)
    return write, read


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def sample(engine) -> dict[str, torch.Tensor]:
    """A few weights and moments, copied to the host: enough to see a load put back what a save wrote."""
    store, cap = engine.rt.store, engine.lowered.capture
    out = {}
    for i in (0, len(cap.params) // 2, len(cap.params) - 1):
        slot = store.layout.slots[i]
        out[f"w{i}"] = store.param_fp32(i).detach().to("cpu", copy=True)
        for key, st in (("m", store.exp_avg), ("v", store.exp_avg_sq)):
            out[f"{key}{i}"] = st[slot.chunk][slot.offset: slot.offset + slot.numel].to("cpu", copy=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="GPT_h3072_L36")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dir", default=os.path.join(os.getcwd(), ".ckpt-bench"))
    ap.add_argument("--probe-gib", type=float, default=8.0)
    ap.add_argument("--host-memory", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = gpt_config(args.model, block_size=args.seq)
    with torch.device("meta"):
        model = GPT(cfg)
    cuda = torch.cuda.is_available()         # without one: a smoke run on the CPU tier
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev, generator=g)
    engine = pstar_fx.compile(model, pstar_fx.Config(device=dev, dtype="bf16" if cuda else "fp32",
                                                     host_memory=args.host_memory, optimizer={"lr": 1e-4}),
                              (idx, idx))
    engine.step(idx, idx)
    engine.drain()
    sync()
    chunk_bytes = engine.lowered.layout.chunk_size * 4
    params = sum(p.numel for p in engine.lowered.capture.params)
    result = {"model": args.model, "params": params, "chunk_size": engine.lowered.layout.chunk_size,
              "placement_device_chunks": engine.plan.placement.count("device"),
              "chunks": len(engine.plan.placement), "gpu": torch.cuda.get_device_name() if cuda else None,
              "disk": {"dir": args.dir, "free_bytes": shutil.disk_usage(os.path.dirname(args.dir)).free}}
    print(json.dumps(result), flush=True)
    write_bw, read_bw = disk_bandwidth(args.dir + ".probe", args.probe_gib)
    result["disk"].update(write_Bps=round(write_bw), read_Bps=round(read_bw), probe_bytes=int(args.probe_gib * 2**30))
    print(f"disk: write {write_bw / 1e9:.2f} GB/s, read {read_bw / 1e9:.2f} GB/s", flush=True)
    before = sample(engine)
    shutil.rmtree(args.dir, ignore_errors=True)
    with PeakSampler() as mem:
        t0 = time.perf_counter()
        engine.save(args.dir)
        save_s = time.perf_counter() - t0
    nbytes = dir_bytes(args.dir)
    result["save"] = {"seconds": round(save_s, 2), "bytes": nbytes, "Bps": round(nbytes / save_s),
                      "ratio_to_disk_write": round(nbytes / save_s / write_bw, 3), "peak_extra_host_bytes": mem.extra,
                      "peak_extra_host_chunks": round(mem.extra / chunk_bytes, 2)}
    print("save:", result["save"], flush=True)
    with PeakSampler() as mem:
        t0 = time.perf_counter()
        engine.load(args.dir)
        sync()
        load_s = time.perf_counter() - t0
    result["load"] = {"seconds": round(load_s, 2), "Bps": round(nbytes / load_s),
                      "ratio_to_disk_read": round(nbytes / load_s / read_bw, 3), "peak_extra_host_bytes": mem.extra,
                      "peak_extra_host_chunks": round(mem.extra / chunk_bytes, 2)}
    print("load:", result["load"], flush=True)
    after = sample(engine)
    result["bit_exact_sample"] = all(torch.equal(before[k], after[k]) for k in before)
    loss = engine.step(idx, idx).item()
    result["loss_after_load"] = round(loss, 4)
    shutil.rmtree(args.dir, ignore_errors=True)
    print("RESULT " + json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
