"""Where a region build worker's start goes (issue 26): fresh Python processes doing what a standby worker does
before its first build (import torch and pstar_fx, then Inductor's compile path: region_worker.warm_up), alone and
several at once, each reporting its wall and CPU seconds at each point and the CPU seconds of its busiest threads
(by name, from /proc), so that a slow start reads as imports on one core, threads beside them, or waiting.

    python bench/worker_start.py --runs 1,1,4 [--env OMP_NUM_THREADS=1]

One JSON line per process on stdout (`RESULT {...}`), then one summary line per batch.
"""
import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
w0, c0 = float(sys.argv[1]), time.process_time()
points = {}
def mark(name):
    points[name] = (round(time.time() - w0, 2), round(time.process_time(), 2))
import torch
mark("torch")
import pstar_fx
mark("pstar_fx")
from pstar_fx.passes.region_worker import warm_up
warm_up()
mark("inductor")
threads = []
for tid in os.listdir("/proc/self/task"):
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        threads.append((name, round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)))
    except OSError:
        pass
threads.sort(key=lambda t: -t[1])
print(json.dumps({"points": points, "threads": len(threads), "busiest": threads[:6],
                  "children": len(os.listdir("/proc/self/task"))}))
"""


def batch(n: int, env: dict) -> list[dict]:
    w0 = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, repr(w0)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(n)]
    out = []
    for p in procs:
        text, _ = p.communicate()
        try:
            out.append(json.loads(text.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            out.append({"failed": p.returncode})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="1,1,4", help="processes started at once, batch by batch")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the processes (a batch each more)")
    a = ap.parse_args()
    settings = [{}] + [dict([kv.split("=", 1)]) for kv in a.env]
    for extra in settings:
        env = dict(os.environ, **extra)
        for n in map(int, a.runs.split(",")):
            res = batch(n, env)
            for r in res:
                print("RESULT " + json.dumps({"n": n, "env": extra, **r}))
            ready = [r["points"]["inductor"] for r in res if "points" in r]
            print(f"batch of {n} {extra or ''}: ready at " + ", ".join(f"{w} s ({c} s CPU)" for w, c in ready)
                  + "; torch at " + ", ".join(str(r["points"]["torch"][0]) for r in res if "points" in r), flush=True)


if __name__ == "__main__":
    main()
