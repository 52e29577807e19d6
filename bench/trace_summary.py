"""Read a torch.profiler chrome trace of training steps and say where each step's time went, stream by stream.

    python bench/trace_summary.py TRACE.json[.gz] [--step-prefix bench.step]

Each step is the span of a CPU annotation whose name starts with `--step-prefix` (bench/gpt.py wraps each profiled
step in one, and synchronizes after it, so the GPU work a step queued runs inside its span). Per step:

- its wall time, and each stream's busy time (the union of its kernels and copies) and first/last activity, in ms
  from the step's start; the compute stream is the one with the most kernel time;
- the compute stream's idle stretches (over `--min-gap-ms`), each with the kernels either side and what the
  launching thread was inside when it began (the innermost `pstar_fx.*` annotation, else the innermost op);
- the annotations' own spans (pstar_fx.verdict, pstar_fx.correct, ...) and the launching thread's blocking CUDA
  calls (event and stream synchronizes, synchronous copies) summed by name.

What it answers: which stream a slower step's extra time is on, and whether the GPU idled while the launching thread
was busy elsewhere (a correction queued on the launching thread shows as a compute-stream gap inside
pstar_fx.correct).
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
BLOCKING = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
            "cudaStreamWaitEvent", "cuLaunchKernel", "cudaLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def read(path: str) -> dict:
    """A chrome trace (JSON, gzipped or not), whole."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def complete(data: dict) -> list[dict]:
    """A trace's complete events (those with a duration)."""
    return [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def load(path: str) -> list[dict]:
    """The trace's complete events (chrome trace JSON, gzipped or not)."""
    return complete(read(path))


def _union(spans: list[tuple[float, float]]) -> float:
    busy, end = 0.0, -1e30
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def summarize(events: list[dict], step_prefix: str = "bench.step", min_gap_ms: float = 0.3, top: int = 12) -> dict:
    steps = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("cat") == "user_annotation" and e["name"].startswith(step_prefix))
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    # the launching thread: the thread of the step annotations
    main_tid = next((e["tid"] for e in events if e.get("cat") == "user_annotation"
                     and e["name"].startswith(step_prefix)), None)
    kernel_time: dict = defaultdict(float)
    for e in gpu:
        if e["cat"] == "kernel":
            kernel_time[e["tid"]] += e["dur"]
    compute = max(kernel_time, key=kernel_time.get) if kernel_time else None
    main_cpu = sorted(((e["ts"], e["ts"] + e["dur"], e["name"], e.get("cat")) for e in cpu if e["tid"] == main_tid))
    starts = [x[0] for x in main_cpu]

    def inside(t: float) -> str:
        """The innermost pstar_fx annotation (else the innermost op) on the launching thread at time t."""
        best, best_ann = None, None
        for a, b, name, cat in main_cpu[max(0, bisect.bisect_right(starts, t) - 400): bisect.bisect_right(starts, t)]:
            if a <= t <= b:
                if cat == "user_annotation" and name.startswith("pstar_fx"):
                    best_ann = name
                best = name
        return best_ann or best or "-"

    out = []
    for s0, s1, name in steps:
        mine = [e for e in gpu if s0 <= e["ts"] <= s1]
        by_stream: dict = defaultdict(list)
        for e in mine:
            by_stream[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"], e["cat"]))
        streams = {}
        for sid, spans in by_stream.items():
            spans.sort()
            streams[str(sid)] = {
                "busy_ms": round(_union([(a, b) for a, b, _, _ in spans]) / 1e3, 3),
                "kernels_ms": round(sum(b - a for a, b, _, c in spans if c == "kernel") / 1e3, 3),
                "copies_ms": round(sum(b - a for a, b, _, c in spans if c != "kernel") / 1e3, 3),
                "first_ms": round((spans[0][0] - s0) / 1e3, 3), "last_ms": round((spans[-1][1] - s0) / 1e3, 3),
                "count": len(spans), "compute": sid == compute}
        gaps = []
        cs = sorted(by_stream.get(compute, []))
        end, last = None, "-"
        for a, b, kname, _ in cs:
            if end is not None and (a - end) / 1e3 >= min_gap_ms:
                gaps.append({"at_ms": round((end - s0) / 1e3, 3), "ms": round((a - end) / 1e3, 3),
                             "after": last[:70], "before": kname[:70], "launcher_in": inside(end)[:80]})
            if end is None or b > end:
                end, last = b, kname
        if cs:       # from the step's start to its first compute kernel, and from its last to the step's end
            lead, tail = (cs[0][0] - s0) / 1e3, (s1 - end) / 1e3
        else:
            lead = tail = 0.0
        anns: dict = defaultdict(float)
        for a, b, nm, cat in main_cpu:
            if cat == "user_annotation" and nm.startswith("pstar_fx") and s0 <= a <= s1:
                anns[nm] += (b - a) / 1e3
        blocking: dict = defaultdict(float)
        for e in runtime:
            if e["tid"] == main_tid and s0 <= e["ts"] <= s1 and any(e["name"].startswith(k) for k in BLOCKING):
                blocking[e["name"]] += e["dur"] / 1e3
        out.append({"step": name, "wall_ms": round((s1 - s0) / 1e3, 3), "streams": streams,
                    "compute_idle_ms": round(sum(g["ms"] for g in gaps), 3), "compute_lead_ms": round(lead, 3),
                    "compute_tail_ms": round(tail, 3),
                    "gaps": sorted(gaps, key=lambda g: -g["ms"])[:top],
                    "annotations_ms": {k: round(v, 3) for k, v in sorted(anns.items())},
                    "launcher_cuda_calls_ms": {k: round(v, 3) for k, v in
                                               sorted(blocking.items(), key=lambda kv: -kv[1])}})
    return {"compute_stream": compute, "steps": out}


def print_summary(summary: dict, file=None) -> None:
    import sys
    f = file or sys.stderr
    for s in summary["steps"]:
        print(f"{s['step']}: wall {s['wall_ms']:.1f} ms; compute stream idle {s['compute_idle_ms']:.1f} ms inside, "
              f"{s['compute_lead_ms']:.1f} before its first kernel, {s['compute_tail_ms']:.1f} after its last", file=f)
        for sid, st in sorted(s["streams"].items(), key=lambda kv: -kv[1]["busy_ms"]):
            print(f"  stream {sid}{' (compute)' if st['compute'] else ''}: busy {st['busy_ms']:.1f} ms (kernels "
                  f"{st['kernels_ms']:.1f}, copies {st['copies_ms']:.1f}), {st['first_ms']:.1f} -> "
                  f"{st['last_ms']:.1f} ms, {st['count']} ops", file=f)
        for g in s["gaps"][:8]:
            print(f"  idle {g['ms']:.2f} ms at {g['at_ms']:.1f}: {g['after'][:40]} -> {g['before'][:40]} "
                  f"(launcher in {g['launcher_in']})", file=f)
        if s["annotations_ms"]:
            print("  annotations: " + ", ".join(f"{k} {v:.1f} ms" for k, v in s["annotations_ms"].items()), file=f)
        if s["launcher_cuda_calls_ms"]:
            print("  launcher's CUDA calls: " + ", ".join(f"{k} {v:.1f} ms" for k, v in
                                                          list(s["launcher_cuda_calls_ms"].items())[:6]), file=f)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--step-prefix", default="bench.step")
    ap.add_argument("--min-gap-ms", type=float, default=0.3)
    args = ap.parse_args(argv)
    summary = summarize(load(args.trace), args.step_prefix, args.min_gap_ms)
    print_summary(summary)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
