"""Whether a model's captured step grows by one block's nodes per block: the premise of capturing the repeated blocks
once and stamping the rest (issue 26: the capture is the longest phase of a warm compile, 7-10.6 s for GPT3_18B on
the H100 box, 5.1-5.4 s on the development VM, ~0.4 ms of make_fx a node).

    python bench/capture_blocks.py [--model GPT3_18B | llama/Llama3_8B | hf-llama/Llama3_8B] [--layers 2,3,4,8] [--full]
    python bench/capture_blocks.py --compare [mistral,qwen2,...]
    python bench/capture_blocks.py --model hf-llama/Llama3_70B --lora 16 --on-off

Captures the model (meta, traced for CUDA with CUDA's autocast norms, bench/plan_at_rates.py) at each depth, prints
each capture's nodes and seconds, and for consecutive depths the stretches where the node sequences (op, target)
differ: one block added should be its parameters' placeholders, its forward and its backward, each one contiguous
stretch. --full also captures the model at its own depth and checks the node count the smallest depths predict.
--compare captures small Hugging Face models (9 layers, fp32, CPU) with pstar_fx/capture_blocks.py on and off and
says, for each, whether it was captured by blocks and whether the two codes are the same (they must be).
--on-off captures the model at its own depth traced whole, then by blocks, and prints both times and whether the code
is the same; --lora R wraps it in peft LoRA of rank R on the seven projections first (bench/lora_bench.py).
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

from pstar_fx import capture as cap, capture_blocks  # noqa: E402


def captured(name: str, layers: int | None, lora: int = 0, code: bool = False):
    cfg, hf = gpt.model_config(name, 1024, layers)
    if lora:
        import lora_bench
        net = lora_bench.lora_model(cfg, lora)
    else:
        with torch.device("meta"):
            net = gpt.build(cfg, hf)
    idx = torch.randint(0, cfg.vocab_size, (16, 1024), device="meta")
    inputs = {"input_ids": idx, "labels": idx} if hf or lora else (idx, idx)
    t0 = time.perf_counter()
    c = cap.capture(net, inputs, torch.device("cuda"), torch.bfloat16)
    seconds = time.perf_counter() - t0
    return c.gm.code if code else [(n.op, str(n.target)) for n in c.gm.graph.nodes], seconds, cfg.n_layer


def on_off(name: str, lora: int) -> None:
    codes = []
    for on in ("0", "1"):
        os.environ["PSTAR_FX_CAPTURE_BLOCKS"] = on
        code, seconds, n = captured(name, None, lora, code=True)
        codes.append(code)
        print(f"{name}{f' LoRA r={lora}' if lora else ''} ({n} blocks) {'by blocks' if on == '1' else 'traced whole'}: "
              f"{seconds:.2f} s")
    print("the same code" if codes[0] == codes[1] else "ANOTHER CODE")


HF = {   # kind -> (model class, config class, config fields beyond the common ones)
    "llama": ("LlamaForCausalLM", "LlamaConfig", {"head_dim": 8}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"head_dim": 8, "sliding_window": 8}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "qwen2-sliding": ("Qwen2ForCausalLM", "Qwen2Config", {"use_sliding_window": True, "sliding_window": 8,
                                                         "max_window_layers": 5}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 8}),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", {"head_dim": 8}),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {"head_dim": 8, "sliding_window": 8}),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", {"head_dim": 8, "sliding_window": 8}),
    "cohere2": ("Cohere2ForCausalLM", "Cohere2Config", {"sliding_window": 8}),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {"pad_token_id": 0}),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", {"pad_token_id": 0}),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {}),
}


def compare(kinds: list[str]) -> None:
    import logging

    import transformers
    records: list[str] = []

    class Said(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("pstar_fx").addHandler(Said())
    logging.getLogger("pstar_fx").setLevel(logging.INFO)
    capture_blocks.MIN_BLOCKS = 9       # (by blocks at 9 layers, below the default's break-even: what is compared)
    common = dict(num_hidden_layers=9, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=32)
    ids = torch.randint(0, 128, (2, 16))
    for kind in kinds:
        model_cls, config_cls, extra = HF[kind]
        fields = {**common, **extra}
        if kind == "gpt_neox":
            fields.pop("num_key_value_heads")           # (its attention has none)
        config = getattr(transformers, config_cls)(**fields)
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config)
        codes = []
        for on in ("0", "1"):
            os.environ["PSTAR_FX_CAPTURE_BLOCKS"] = on
            records.clear()
            codes.append(cap.capture(model, {"input_ids": ids, "labels": ids}, torch.device("cpu"),
                                     torch.float32).gm.code)
        by_blocks = any("captured" in r and "blocks" in r for r in records)
        print(f"{kind}: {'captured by blocks' if by_blocks else 'traced whole'}, "
              f"{'the same code' if codes[0] == codes[1] else 'ANOTHER CODE'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="GPT3_18B")
    ap.add_argument("--layers", default="2,3,4,8")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--on-off", action="store_true")
    ap.add_argument("--lora", type=int, default=0, help="peft LoRA rank (0: none)")
    ap.add_argument("--compare", nargs="?", const=",".join(HF), default=None,
                    help="Hugging Face kinds, comma-separated (default: all of " + ", ".join(HF) + ")")
    args = ap.parse_args()
    if args.compare is not None:
        compare(args.compare.split(","))
        return
    plan_at_rates.cuda_autocast_norms()
    if args.on_off:
        on_off(args.model, args.lora)
        return
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
