"""A meta-built GPT's own init on host memory: one thread against runtime/parallel_init.py's split. RESULT {json}

    python bench/init_speed.py --model GPT3_18B --layers 12 --threads 16

Runs `init_weights()` twice on the same host tensors (the first touch of their pages paid before timing): once as
torch runs it, once inside `split_normal_draws(threads)`, under the same seed, and checks the two give the same
bits. Fields: model, params, threads, serial_s, split_s, speedup, m_params_per_s (split), same_bits.

--first-touch also times the split init into memory nobody has touched yet, as the engine's host masters are (a
fresh anonymous mapping, `HostBuffers.empty(written_first=True)`): its pages fault in on the init's threads. Field
first_touch_s, and first_touch_huge_s with transparent huge pages asked for first (PSTAR_FX_HUGE_PAGES=1's advice).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pstar_fx.models import GPT, gpt_config  # noqa: E402
from pstar_fx.runtime.parallel_init import split_normal_draws  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small", help="a gpt_config name (default small)")
    ap.add_argument("--layers", type=int, help="its n_layer instead (a smaller model of the same width)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--first-touch", action="store_true", help="also into untouched memory, 4 KiB and huge pages")
    args = ap.parse_args(argv)
    with torch.device("meta"):
        model = GPT(gpt_config(args.model, **({"n_layer": args.layers} if args.layers else {})))
    model.to_empty(device="cpu")
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    with torch.no_grad():
        for p in params:
            p.zero_()                                   # pages touched before either timing
    torch.manual_seed(0)
    t = time.perf_counter()
    model.init_weights()
    serial_s = time.perf_counter() - t
    ref = [p.detach()[..., :1000].clone() for p in params] + [torch.get_rng_state()]
    torch.manual_seed(0)
    t = time.perf_counter()
    with split_normal_draws(args.threads):
        model.init_weights()
    split_s = time.perf_counter() - t
    same = all(torch.equal(a, b) for a, b in zip(ref, [p.detach()[..., :1000] for p in params]
                                                   + [torch.get_rng_state()]))
    result = {"model": args.model, "params": n, "threads": args.threads, "serial_s": round(serial_s, 3),
              "split_s": round(split_s, 3), "speedup": round(serial_s / split_s, 2),
              "m_params_per_s": round(n / split_s / 1e6), "same_bits": same}
    if args.first_touch:
        for key, huge in (("first_touch_s", False), ("first_touch_huge_s", True)):
            result[key] = round(_into_untouched(model, params, args.threads, huge), 3)
    print("RESULT " + json.dumps(result), flush=True)


def _into_untouched(model, params, threads: int, huge: bool) -> float:
    """The split init into one fresh anonymous mapping holding every parameter (a chunk's master, as the engine
    maps it), its pages untouched; seconds."""
    import mmap

    from pstar_fx.runtime.host_memory import huge_pages
    n = sum(p.numel() for p in params)
    flat = torch.frombuffer(mmap.mmap(-1, n * 4), dtype=torch.float32)
    if huge:
        huge_pages(flat)
    at = 0
    for p in params:
        p.data = flat[at: at + p.numel()].view(p.shape)
        at += p.numel()
    torch.manual_seed(0)
    t = time.perf_counter()
    with split_normal_draws(threads):
        model.init_weights()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
