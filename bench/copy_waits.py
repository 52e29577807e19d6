"""Why the compute stream waited for copies, from a torch.profiler chrome trace of training steps (bench/gpt.py
--profile with PSTAR_FX_TRACE_DIR): each idle stretch of the compute stream that ends as a host-to-device copy lands
is put down to one of three causes, from the copy's own times.

    python bench/copy_waits.py TRACE.json[.gz] [--step-prefix bench.step] [--min-gap-ms 0.3] [--show 15]

For the copy that ended the stretch (the op on another stream ending within `--slack-us` of the compute stream's next
kernel: a copy, or a cast after one on a copy stream, whose copy is then the one weighed), with its launch (the
runtime call of the same correlation id, on the launching thread or another: the host Adam's worker queues a host
chunk's copy as its update ends):
- "queued late": it started within `--slack-us` of its launch's end — it ran as soon as it was asked for, so the
  wait is the asking: the thread that queues it was elsewhere (waiting for a host gradient buffer, a host update);
- "behind its stream": it started as the op before it on its stream ended — the copy stream was busy (the bytes
  before it, or a cast on the stream); how that back-to-back run began is given too (one of these causes);
- "waited for an event": neither — its stream waited for an event first (a slot's last reader on the compute
  stream, work after a verdict).
Per step: the compute stream's wait by cause, the launching threads' shares, and the longest stretches with the copy's
launch, start, end and bytes; the kernels on a copy stream (the cast after each piece of a chunk crossing as fp32)
that started later than the copy before them, which holds up every copy queued behind them, and the compute kernels
they waited beside; each host job on the worker (`pstar_fx.host_job cN`: from, to) and the launching
thread's waits (`pstar_fx.wait_for_*`), which the runtime names in the trace. The planner (planning/schedule.py)
prices only the second cause.
"""
from __future__ import annotations

import argparse
import bisect
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # bench/trace_summary.py
from trace_summary import complete, read as load  # noqa: E402

COPY_CALLS = ("cudaMemcpyAsync", "cudaMemcpy", "cuMemcpyAsync", "cuMemcpyHtoDAsync")


def thread_names(data: dict) -> dict:
    return {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
            for e in data.get("traceEvents", []) if e.get("ph") == "M" and e.get("name") == "thread_name"}


def analyze(data: dict, step_prefix: str = "bench.step", min_gap_ms: float = 0.3, slack_us: float = 30.0) -> dict:
    events = complete(data)
    names = thread_names(data)
    steps = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("cat") == "user_annotation" and e["name"].startswith(step_prefix))
    main = next(((e.get("pid"), e["tid"]) for e in events if e.get("cat") == "user_annotation"
                 and e["name"].startswith(step_prefix)), None)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    busy: dict = defaultdict(float)
    for e in kernels:
        busy[e["tid"]] += e["dur"]
    compute = max(busy, key=busy.get) if busy else None
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]]
    launches = {e.get("args", {}).get("correlation"): e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"].startswith(COPY_CALLS)}
    by_stream: dict = defaultdict(list)                   # every GPU op on each stream, in order
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            by_stream[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_stream.values():
        spans.sort()
    # what may end a stretch: any op on another stream (a copy, or the cast after a copy of fp32 pieces, which runs
    # on the copy stream: then the copy before it on that stream is the one weighed)
    others = sorted((e["ts"] + e["dur"], e["ts"], e["tid"], e.get("cat")) for e in events
                    if e.get("cat") in ("kernel", "gpu_memcpy") and e["tid"] != compute)
    end_ts = [o[0] for o in others]
    copy_at = {(e["tid"], e["ts"]): e for e in copies}
    copy_starts: dict = defaultdict(list)
    for e in copies:
        copy_starts[e["tid"]].append(e["ts"])
    for v in copy_starts.values():
        v.sort()

    def copy_of(j: int):
        """The host-to-device copy behind op `j` of `others`: itself, or the last copy before it on its stream."""
        _, start, tid, cat = others[j]
        starts = copy_starts.get(tid, [])
        i = bisect.bisect_right(starts, start) - 1
        return copy_at[(tid, starts[i])] if i >= 0 else None

    def cause(copy: dict) -> tuple[str, dict]:
        start, corr = copy["ts"], copy.get("args", {}).get("correlation")
        launch = launches.get(corr)
        spans = by_stream[copy["tid"]]
        k = bisect.bisect_left(spans, (start, start + copy["dur"]))
        prev_end = spans[k - 1][1] if k > 0 else None
        info = {"start_us": start, "dur_ms": round(copy["dur"] / 1e3, 3),
                "bytes": copy.get("args", {}).get("bytes"), "stream": copy["tid"],
                "launched_by": "?" if launch is None else
                ("launching thread" if (launch.get("pid"), launch["tid"]) == main
                 else names.get((launch.get("pid"), launch["tid"])) or f"thread {launch['tid']}"),
                "launch_end_us": None if launch is None else launch["ts"] + launch["dur"]}
        if launch is not None and start - (launch["ts"] + launch["dur"]) <= slack_us:
            return "queued late", info
        if prev_end is not None and start - prev_end <= slack_us:
            # the stream ran back to back up to it: how did that run begin (a chunk crossing as fp32 pieces, each
            # followed by its cast, is such a run)?
            i = k - 1
            while i > 0 and spans[i][0] - spans[i - 1][1] <= slack_us:
                i -= 1
            first = copy_at.get((copy["tid"], spans[i][0]))
            info["run_ms"] = round((start + copy["dur"] - spans[i][0]) / 1e3, 3)
            info["run_began"] = "?" if first is None else cause(first)[0]
            return "behind its stream", info
        return "waited for an event", info

    out = []
    cs = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in kernels if e["tid"] == compute)
    cs_starts = [k[0] for k in cs]
    copy_span: dict = defaultdict(set)
    for e in copies:
        copy_span[e["tid"]].add((e["ts"], e["ts"] + e["dur"]))
    annotations = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("pstar_fx.")]
    side_kernels = [e for e in kernels if e["tid"] != compute]
    for s0, s1, step in steps:
        mine = [k for k in cs if s0 <= k[0] <= s1]
        by_cause: dict = defaultdict(float)
        by_launcher: dict = defaultdict(float)
        stretches = []
        for (a0, a1, an), (b0, _, bn) in zip(mine, mine[1:]):
            gap = b0 - max(a1, a0)
            if gap / 1e3 < min_gap_ms:
                continue
            j = bisect.bisect_right(end_ts, b0 + slack_us) - 1    # the last op elsewhere ending by the next kernel
            copy = copy_of(j) if j >= 0 and end_ts[j] >= max(a1, b0 - slack_us) else None
            if copy is None:
                by_cause["no copy ends it"] += gap
                continue
            why, info = cause(copy)
            by_cause[why] += gap
            by_launcher[info["launched_by"]] += gap
            stretches.append({"ms": round(gap / 1e3, 3), "at_ms": round((a1 - s0) / 1e3, 3), "cause": why,
                              "launched_by": info["launched_by"], "bytes": info["bytes"],
                              "copy_ms": info["dur_ms"],
                              "launched_at_ms": None if info["launch_end_us"] is None
                              else round((info["launch_end_us"] - s0) / 1e3, 3),
                              "started_at_ms": round((info["start_us"] - s0) / 1e3, 3), "before": bn[:60],
                              "run_began": info.get("run_began"), "run_ms": info.get("run_ms")})
        # the host jobs (pstar_fx.host_job cN, on the worker) and the launching thread's waits (pstar_fx.wait_for_*)
        jobs = sorted((e["ts"], e["ts"] + e["dur"], e["name"].rpartition(" ")[2]) for e in annotations
                      if e["name"].startswith("pstar_fx.host_job") and s0 <= e["ts"] + e["dur"] and e["ts"] <= s1)
        waits: dict = defaultdict(float)
        for e in annotations:
            if e["name"].startswith("pstar_fx.wait_for") and (e.get("pid"), e["tid"]) == main and s0 <= e["ts"] <= s1:
                waits[e["name"].removeprefix("pstar_fx.")] += e["dur"]
        # kernels on a copy stream (the cast after each fp32 piece: movers.py `_copy_in`) that started later than the
        # op before them on their stream ended: the copies queued behind them waited too. Beside which compute
        # kernel each waited (one that holds every SM until it ends keeps a kernel of another stream out).
        stalls, beside = [], defaultdict(float)
        for e in side_kernels:
            if s0 <= e["ts"] <= s1:
                spans = by_stream[e["tid"]]
                k = bisect.bisect_left(spans, (e["ts"], e["ts"] + e["dur"]))
                if k > 0 and (spans[k - 1][0], spans[k - 1][1]) in copy_span.get(e["tid"], ()):
                    wait = e["ts"] - spans[k - 1][1]
                    if wait > slack_us:
                        stalls.append(wait)
                        i = bisect.bisect_right(cs_starts, spans[k - 1][1]) - 1
                        beside[cs[i][2][:50] if i >= 0 and cs[i][1] > spans[k - 1][1] else "-"] += wait
        out.append({"step": step, "wall_ms": round((s1 - s0) / 1e3, 3),
                    "copy_stream_kernel_waits": {"count": len(stalls), "ms": round(sum(stalls) / 1e3, 3),
                                                 "longest_ms": round(max(stalls, default=0.0) / 1e3, 3),
                                                 "beside": {k: round(v / 1e3, 3) for k, v in
                                                            sorted(beside.items(), key=lambda kv: -kv[1])[:5]}},
                    "host_jobs": [{"chunk": c, "from_ms": round((a - s0) / 1e3, 3), "to_ms": round((b - s0) / 1e3, 3)}
                                  for a, b, c in jobs],
                    "launcher_waits_ms": {k: round(v / 1e3, 3) for k, v in sorted(waits.items())},
                    "idle_by_cause_ms": {k: round(v / 1e3, 3) for k, v in sorted(by_cause.items())},
                    "idle_by_launcher_ms": {k: round(v / 1e3, 3) for k, v in sorted(by_launcher.items())},
                    "stretches": sorted(stretches, key=lambda s: -s["ms"])})
    return {"compute_stream": compute, "steps": out}


def print_report(report: dict, show: int = 15, file=None) -> None:
    for s in report["steps"]:
        print(f"{s['step']}: wall {s['wall_ms']:.1f} ms; compute idle by cause (ms): {s['idle_by_cause_ms']}; "
              f"by who queued the copy: {s['idle_by_launcher_ms']}", file=file)
        w = s["copy_stream_kernel_waits"]
        if w["count"]:
            print(f"  kernels on a copy stream waited {w['ms']:.1f} ms after the copy before them ({w['count']}, the "
                  f"longest {w['longest_ms']:.2f} ms), beside: {w['beside']}", file=file)
        jobs = s["host_jobs"]
        if jobs:
            print(f"  host jobs: {len(jobs)}, {sum(j['to_ms'] - j['from_ms'] for j in jobs):.1f} ms, from "
                  f"{jobs[0]['from_ms']:.1f} to {jobs[-1]['to_ms']:.1f} ms: "
                  + " ".join(f"{j['chunk']}@{j['from_ms']:.0f}-{j['to_ms']:.0f}" for j in jobs), file=file)
        if s["launcher_waits_ms"]:
            print(f"  the launching thread waited (ms): {s['launcher_waits_ms']}", file=file)
        for x in s["stretches"][:show]:
            print(f"  {x['ms']:7.2f} ms at {x['at_ms']:8.1f}: {x['cause']}, queued by {x['launched_by']} at "
                  f"{x['launched_at_ms']} ms, started {x['started_at_ms']} ms, {x['copy_ms']} ms, "
                  f"{x['bytes']} B (before {x['before']})"
                  + (f"; its stream's run of {x['run_ms']} ms began {x['run_began']}" if x["run_began"] else ""),
                  file=file)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--step-prefix", default="bench.step")
    ap.add_argument("--min-gap-ms", type=float, default=0.3)
    ap.add_argument("--slack-us", type=float, default=30.0)
    ap.add_argument("--show", type=int, default=15)
    a = ap.parse_args(argv)
    print_report(analyze(load(a.trace), a.step_prefix, a.min_gap_ms, a.slack_us), a.show)


if __name__ == "__main__":
    main()
