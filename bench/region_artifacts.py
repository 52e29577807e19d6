"""How fast a warm compile could load its Inductor regions (issue 26): today's torch.compile from Inductor's caches
against `torch._inductor.standalone_compile` artifacts loaded from disk (no Dynamo trace, no AOTAutograd key).

    python bench/region_artifacts.py [--layers 4] [--device cpu|cuda] [--cache DIR]

Three fresh processes on one cache folder (a temporary one unless --cache): "build" compiles the small GPT
(compute="inductor") on a cold cache and saves one standalone artifact per distinct region (built on the zeros
`build_regions` uses); "warm" compiles the same model again (its regions load from Inductor's caches: the
"build regions" phase is what a warm compile pays today); "load" loads every artifact and calls it once. One line
per process: RESULT {json}. An experiment: the engine does not use these artifacts.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(mode: str, cache: str, layers: int, device: str) -> dict:
    import torch
    import pstar_fx
    from pstar_fx.models import GPT, gpt_config
    from pstar_fx.passes import compile_regions as cr
    dev = torch.device(device)
    t0 = time.perf_counter()
    if mode in ("build", "warm"):
        torch.manual_seed(0)
        model = GPT(gpt_config("tiny", n_layer=layers))
        x = torch.randint(0, 256, (4, 64), device=dev)
        engine = pstar_fx.compile(model, pstar_fx.Config(device=device, compute="inductor", chunk_size=16384), (x, x))
        regions = engine.graph.meta["regions"]
        out = {"mode": mode, "compile_s": round(time.perf_counter() - t0, 3),
               "build_regions_s": round(engine.phases.seconds.get("build regions", float("nan")), 3),
               "regions": len(regions)}
        if mode == "build":
            from torch._inductor import standalone_compile
            saved = 0
            for i, r in enumerate(regions):
                if any(s is None for s in r._specs):
                    continue
                examples = [cr._example(s, dev) for s in r._specs]
                art = standalone_compile(r.graph_module, examples, dynamic_shapes="from_example_inputs")
                art.save(path=os.path.join(cache, "artifacts", f"r{i}.bin"), format="binary")
                torch.save([(s[0], s[1].shape, s[1].stride, s[1].storage_offset, s[1].storage_elems, s[1].dtype, s[2])
                            for s in r._specs], os.path.join(cache, "artifacts", f"r{i}.specs"))
                saved += 1
            out["artifacts"] = saved
        return out
    from torch._inductor import CompiledArtifact
    loads, calls = [], []
    folder = os.path.join(cache, "artifacts")
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".bin")):
        ta = time.perf_counter()
        art = CompiledArtifact.load(path=os.path.join(folder, name), format="binary")
        tb = time.perf_counter()
        specs = torch.load(os.path.join(folder, name[:-4] + ".specs"))
        examples = [cr._example((k, cr._Layout(sh, st, so, se, dt, dev), off), dev) for k, sh, st, so, se, dt, off in specs]
        tc = time.perf_counter()
        with torch.no_grad():
            art(*examples)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        loads.append(tb - ta)
        calls.append(time.perf_counter() - tc)
    return {"mode": mode, "artifacts": len(loads), "total_s": round(time.perf_counter() - t0, 3),
            "first_load_s": round(loads[0], 3) if loads else None,
            "other_loads_s": round(sum(loads[1:]), 3), "calls_s": round(sum(calls), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cache", default=None, help="cache folder (default: a new temporary one)")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)     # one process's part
    args = ap.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(run(args.mode, args.cache, args.layers, args.device)), flush=True)
        return
    cache = args.cache or tempfile.mkdtemp(prefix="pstar_fx-artifacts-")
    os.makedirs(os.path.join(cache, "artifacts"), exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(PSTAR_FX_CACHE=cache, PSTAR_FX_BUILD_WORKERS="0",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p))
    for mode in ("build", "warm", "load"):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--mode", mode, "--cache", cache,
                              "--layers", str(args.layers), "--device", args.device],
                             env=env, capture_output=True, text=True)
        lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        print(lines[-1] if lines else f"RESULT {json.dumps({'mode': mode, 'error': out.stderr[-600:]})}", flush=True)


if __name__ == "__main__":
    main()
