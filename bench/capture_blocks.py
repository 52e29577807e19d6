"""Whether a model's captured step grows by one block's nodes per block: the premise of capturing the repeated blocks
once and stamping the rest (issue 26: the capture is the longest phase of a warm compile, 7-10.6 s for GPT3_18B on
the H100 box, 5.1-5.4 s on the development VM, ~0.4 ms of make_fx a node).

    python bench/capture_blocks.py [--model GPT3_18B | llama/Llama3_8B | hf-llama/Llama3_8B] [--layers 2,3,4,8] [--full]

Captures the model (meta, traced for CUDA with CUDA's autocast norms, bench/plan_at_rates.py) at each depth, prints
each capture's nodes and seconds, and for consecutive depths the stretches where the node sequences (op, target)
differ: one block added should be its parameters' placeholders, its forward and its backward, each one contiguous
stretch. --full also captures the model at its own depth and checks the node count the smallest depths predict.
"""
import argparse
import difflib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plan_at_rates  # noqa: E402

import gpt  # noqa: E402

from pstar_fx import capture as cap  # noqa: E402


def captured(name: str, layers: int | None):
    cfg, hf = gpt.model_config(name, 1024, layers)
    with torch.device("meta"):
        net = gpt.build(cfg, hf)
    idx = torch.randint(0, cfg.vocab_size, (16, 1024), device="meta")
    inputs = {"input_ids": idx, "labels": idx} if hf else (idx, idx)
    t0 = time.perf_counter()
    c = cap.capture(net, inputs, torch.device("cuda"), torch.bfloat16)
    return [(n.op, str(n.target)) for n in c.gm.graph.nodes], time.perf_counter() - t0, cfg.n_layer


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="GPT3_18B")
    ap.add_argument("--layers", default="2,3,4,8")
    ap.add_argument("--full", action="store_true")
    args = ap.parse_args()
    plan_at_rates.cuda_autocast_norms()
    depths = [int(x) for x in args.layers.split(",")]
    got = {}
    for L in depths:
        seq, seconds, _ = captured(args.model, L)
        got[L] = seq
        print(f"{args.model} at {L} blocks: {len(seq)} nodes, captured in {seconds:.2f} s")
    for a, b in zip(depths, depths[1:]):
        m = difflib.SequenceMatcher(None, got[a], got[b], autojunk=False)
        stretches = [(tag, j1, j2 - j1, i2 - i1) for tag, i1, i2, j1, j2 in m.get_opcodes() if tag != "equal"]
        print(f"{a} -> {b} blocks: {len(stretches)} stretches differ (kind, where, nodes added, nodes replaced): "
              f"{stretches[:12]}")
    per_block = (len(got[depths[1]]) - len(got[depths[0]])) // (depths[1] - depths[0])
    if args.full:
        seq, seconds, n = captured(args.model, None)
        predicted = len(got[depths[0]]) + (n - depths[0]) * per_block
        print(f"{args.model} at its {n} blocks: {len(seq)} nodes in {seconds:.2f} s; predicted from {depths[0]} "
              f"blocks and {per_block} a block: {predicted}")


if __name__ == "__main__":
    main()
