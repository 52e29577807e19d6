"""Where a compile's CPU-side phases spend their time on the machine at hand: capture and plan (recompute search
included) of a model built on the meta device, for the H200 box's budgets, under cProfile. No GPU is used.

    python bench/plan_profile.py [--model GPT3_18B | hf-llama/Llama3_70B ...] [--lora 16] [--workers N]
                                 [--rates FILE.jsonl] [--out DIR] [--top 40]

The rates are the H200's recorded ones (bench/plan_at_rates.py), or the "rates" of the first record of a bench JSONL
(--rates), so the search makes the same tries as on the box. --lora R wraps the model in peft LoRA of rank R on the
seven projections (bench/lora_bench.py). --workers sets PSTAR_FX_PLAN_WORKERS (the search's children planning ahead).
Prints the phases (the pstar_fx log) and the top functions by cumulative and own time; writes DIR/plan.prof
(read it with `python -m pstats`). The plan cache is off: the search runs in full.
"""
import argparse
import cProfile
import json
import logging
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="GPT3_18B")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--lora", type=int, default=0, help="peft LoRA rank (0: none)")
    ap.add_argument("--optimizer-state", default="bf16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rates", default=None, help="a bench JSONL whose first record's rates to plan at")
    ap.add_argument("--workers", default=None, help="PSTAR_FX_PLAN_WORKERS")
    ap.add_argument("--out", default=".")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    os.environ["PSTAR_FX_PLAN_CACHE"] = "0"
    if args.workers is not None:
        os.environ["PSTAR_FX_PLAN_WORKERS"] = args.workers
    logging.basicConfig(stream=sys.stderr, format="%(relativeCreated)8.0f ms %(message)s")
    logging.getLogger("pstar_fx").setLevel(logging.INFO)

    import torch
    import pstar_fx
    import gpt
    from plan_at_rates import BOX, H200
    from pstar_fx.planning.costs import assumed

    rates = dict(H200)
    if args.rates:
        with open(args.rates) as f:
            rates = {k: v for k, v in json.loads(f.readline())["rates"].items() if k != "device"}
    cfg, hf = gpt.model_config(args.model, args.seq, args.layers)
    t0 = time.perf_counter()
    if args.lora:
        import lora_bench
        model = lora_bench.lora_model(cfg, args.lora)
    else:
        with torch.device("meta"):
            model = gpt.build(cfg, hf)
    print(f"model built on meta in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="meta")
    inputs = {"input_ids": ids, "labels": ids} if hf else (ids, ids)
    config = dict(BOX, optimizer_state=args.optimizer_state, grad_clip=1.0)
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    with assumed(**rates):
        profile.enable()
        plan = pstar_fx.plan(model, config, example_inputs=inputs)
        profile.disable()
    took = time.perf_counter() - t0
    print(f"capture + plan under cProfile: {took:.1f} s; fits {plan.fits}, estimated {plan.estimated_step_seconds:.3f} s;"
          f" python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} cores", flush=True)
    os.makedirs(args.out, exist_ok=True)
    profile.dump_stats(os.path.join(args.out, "plan.prof"))
    stats = pstats.Stats(profile, stream=sys.stdout).strip_dirs()
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
