"""LoRA on a large frozen model (issue 25): pstar_fx against peft under FSDP2 with CPUOffloadPolicy, one GPU.

    python bench/lora_bench.py [--model hf-llama/Llama3_70B] [--batch 16] [--seq 1024] [--steps 5] [--rank 16]
                               [--system both|pstar_fx|fsdp2] [--peer-layers auto|N] [--host-memory 110GiB]
                               [--device cuda|cpu] [--json FILE]

Both sides train Hugging Face's LlamaForCausalLM of bench/gpt.py's LLaMA shape (built on the meta device, bf16)
with `peft` LoRA of rank --rank (alpha 2x rank) on all seven projections (q, k, v, o, gate, up, down), --batch x
--seq tokens a step, random token ids:

  pstar_fx  `get_peft_model` of the meta model, `pstar_fx.compile` (Config: bf16, --host-memory, grad_clip 1.0):
            the frozen base weights in frozen 16-bit chunks on either tier, the adapters' fp32 state in chunks;
            weights initialized in chunk memory by the model's own init.
  fsdp2     the usual PyTorch recipe: `fully_shard` on every decoder layer and the root with
            `CPUOffloadPolicy(pin_memory=True)` (weights, gradients and the optimizer step on the host) and
            `MixedPrecisionPolicy(param_dtype=bf16)`, every decoder layer's activations checkpointed
            (`gradient_checkpointing_enable`), `torch.optim.AdamW` on the adapters; the adapters kept in bf16
            (`autocast_adapter_dtype=False`: FSDP2 all-gathers a layer's parameters as one dtype). Its weights are
            bf16 on the host (2 B/param, pinned), so at --peer-layers auto it trains the deepest model of the same
            width whose weights fit in 70% of the host's available memory (Llama-3-70B's 141 GB do not fit a
            125 GiB box); the line says which. Weights are filled with random values drawn on the device and
            copied (timing only: the peer's numerics are not compared).

Each side runs in a subprocess of its own (--system both): a fresh CUDA context and host memory.
TFLOPs = (4 * N_frozen + 6 * N_trainable) * tokens / step (a frozen weight costs forward and the input gradient,
no weight gradient; recompute not counted). Output: one line per side, RESULT {json}: step_s (median of the steps
after the first), steps_s, tokens_per_s, tflops, params_frozen, params_trainable, layers, compile_s/setup_s,
gpu_peak_bytes, host_max_rss_bytes; a side that failed has "error" (and "oom").
"""
from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import socket
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import gpt  # noqa: E402  (bench/gpt.py: the model shapes, the meta build, RESULT lines, subprocess runs)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SYSTEMS = ("pstar_fx", "fsdp2")


def lora_model(cfg, rank: int, adapters_fp32: bool = True):
    """HF LlamaForCausalLM of `cfg` on meta, bf16, with LoRA adapters (peft) on the seven projections."""
    from peft import LoraConfig, get_peft_model
    with torch.device("meta"):
        base = gpt.build(cfg, hf=True).to(torch.bfloat16)
    base.config.use_cache = False
    return get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS),
                          autocast_adapter_dtype=adapters_fp32)


def counts(model) -> tuple[int, int]:
    """(frozen, trainable) parameter counts."""
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return frozen, sum(p.numel() for p in model.parameters() if p.requires_grad)


def batch(cfg, args, device, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_steps(step, cfg, args, device) -> tuple[list[float], list[float]]:
    """(step seconds, losses) of --steps steps, each timed end to end (synchronized)."""
    times, losses = [], []
    for k in range(args.steps):
        b = batch(cfg, args, device, k)
        _sync(device)
        t0 = time.perf_counter()
        loss = step(b)
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        print(f"{args.system} step {k}: {times[-1]:.3f} s loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    return times, losses


def pstar_side(cfg, args) -> dict:
    import pstar_fx
    model = lora_model(cfg, args.rank)
    frozen, trainable = counts(model)
    device = "cuda" if args.device == "cuda" else "cpu"
    config = {"device": device, "dtype": "bf16", "grad_clip": 1.0, "optimizer": {"type": "adamw", "lr": 1e-4}}
    if args.host_memory and device == "cuda":
        config["host_memory"] = args.host_memory
    if args.device_memory:
        config["device_memory"] = args.device_memory
    t0 = time.perf_counter()
    engine = pstar_fx.compile(model, config, batch(cfg, args, device, 0))
    compile_s = time.perf_counter() - t0
    print(engine.explain(), file=sys.stderr, flush=True)
    times, losses = timed_steps(engine.step, cfg, args, device)
    plan = engine.plan
    extra = {"phases": engine.rt.timing() if hasattr(engine.rt, "timing") else {}}
    if device == "cuda":
        stats = torch.cuda.memory_stats()
        extra["allocator"] = {k: stats.get(k) for k in ("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                                                         "num_device_alloc", "num_device_free")}
        # host chunks whose weights cross to the GPU, and how many of them are page-locked (all should be)
        from pstar_fx.runtime.store import master_crosses
        store = engine.rt.store
        crossing = [c for c, tier in enumerate(plan.placement) if tier == "host" and master_crosses(plan, c)]
        extra["host_chunks_crossing"] = len(crossing)
        extra["host_chunks_crossing_pinned"] = sum(store.master[c].is_pinned() for c in crossing)
    if args.profile and device == "cuda":
        extra["profile"] = profile_step(engine.step, batch(cfg, args, device, args.steps))
    return {**extra, "layers": cfg.n_layer, "params_frozen": frozen, "params_trainable": trainable,
            "compile_s": round(compile_s, 2), "steps_s": [round(t, 4) for t in times], "losses": losses,
            "chunks": len(plan.placement), "device_chunks": plan.placement.count("device"),
            "estimated_step_s": round(plan.estimated_step_seconds, 3), "memory_stats": engine.memory_stats(),
            "regions_op_by_op": {r.__name__: r.eager_because for r in engine.graph.meta.get("regions", [])
                                 if r.eager_because}}


def profile_step(step, b) -> dict:
    """One more step under torch.profiler: the device's busy seconds (kernels, copies) against the wall, and the
    ops that took the most device and host time (printed)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(b)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    avg = prof.key_averages()
    for key in ("self_cuda_time_total", "self_cpu_time_total"):
        print(avg.table(sort_by=key, row_limit=25, max_name_column_width=60), file=sys.stderr, flush=True)
    # the device's own events only: a CPU op's self device time is its kernels' again (counted twice before)
    on_device = [e for e in avg if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sum(e.self_device_time_total for e in on_device if not e.key.startswith(("Memcpy", "Memset"))) / 1e6
    copies = sum(e.self_device_time_total for e in on_device if e.key.startswith("Memcpy")) / 1e6
    return {"wall_s": round(wall, 3), "device_kernels_s": round(kernels, 3), "device_copies_s": round(copies, 3)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_layers(cfg, args) -> int:
    """--peer-layers, or the most decoder layers whose bf16 weights fit in 70% of the host's available memory."""
    if args.peer_layers != "auto":
        return int(args.peer_layers)
    one = counts(lora_model(gpt.model_config(args.model, args.seq, 1)[0], args.rank))
    two = counts(lora_model(gpt.model_config(args.model, args.seq, 2)[0], args.rank))
    per_layer = sum(two) - sum(one)
    outside = sum(one) - per_layer                  # embeddings, head, final norm
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    fit = int((0.7 * avail / 2 - outside) // per_layer)
    return max(1, min(cfg.n_layer, fit))


def fsdp2_side(cfg, args) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    cuda = args.device == "cuda"
    layers = peer_layers(cfg, args)
    cfg = gpt.model_config(args.model, args.seq, layers)[0]
    launch = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    before = {k: os.environ.get(k) for k in launch}
    os.environ.update(launch)             # a one-process group; put back after (the CPU test runs this in pytest)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        if cuda:
            torch.cuda.set_device(0)
        device = "cuda" if cuda else "cpu"
        model = lora_model(cfg, args.rank, adapters_fp32=False)
        frozen, trainable = counts(model)
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        t0 = time.perf_counter()
        offload = CPUOffloadPolicy(pin_memory=True) if cuda else None
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if offload is not None:
            kw["offload_policy"] = offload
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        model.to_empty(device="cpu" if cuda else device)   # offloaded: the sharded weights live on the host
        g = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                if "lora_B" in name:
                    local.zero_()
                else:
                    local.copy_(torch.randn(local.shape, generator=g, device=device, dtype=torch.float32)
                                .mul_(0.02).to(local.dtype))
            # the rotary embedding's buffers (to_empty left them unset): as a fresh one makes them, moved there
            rotary = model.base_model.model.model.rotary_emb
            fresh = type(rotary)(rotary.config)
            for name, b in fresh.named_buffers():
                getattr(rotary, name).copy_(b)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        setup_s = time.perf_counter() - t0

        def step(b):
            loss = model(**b).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        times, losses = timed_steps(step, cfg, args, device)
        return {"layers": layers, "params_frozen": frozen, "params_trainable": trainable, "setup_s": round(setup_s, 2),
                "steps_s": [round(t, 4) for t in times], "losses": losses}
    finally:
        dist.destroy_process_group()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_side(system: str, args) -> dict:
    cfg, hf = gpt.model_config(args.model, args.seq, args.layers)
    result = {"system": system, "model": args.model, "batch": args.batch, "seq": args.seq,
              "tokens": args.batch * args.seq, "rank": args.rank, "targets": TARGETS, "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else None}
    try:
        if not hf:
            raise ValueError(f"--model {args.model}: a hf-llama/NAME shape (peft adapts Hugging Face's model)")
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        result.update((pstar_side if system == "pstar_fx" else fsdp2_side)(cfg, args))
        later = result["steps_s"][1:] or result["steps_s"]
        step_s = statistics.median(later)
        result["step_s"] = round(step_s, 4)
        result["tokens_per_s"] = round(result["tokens"] / step_s, 1)
        flops = (4 * result["params_frozen"] + 6 * result["params_trainable"]) * result["tokens"]
        result["tflops"] = round(flops / step_s / 1e12, 1)
        if args.device == "cuda":
            result["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
    except Exception as e:  # noqa: BLE001 - a side that fails is a result
        result["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        traceback.print_exc(file=sys.stderr)
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            result["oom"] = True
    result["host_max_rss_bytes"] = gpt._max_rss()
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="hf-llama/Llama3_70B")
    ap.add_argument("--layers", type=int, default=None, help="override the model's n_layer (both sides)")
    ap.add_argument("--peer-layers", default="auto", help="the FSDP2 side's n_layer: auto (largest that fits) or N")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--host-memory", default="110GiB", help="pstar_fx's host_memory (CUDA)")
    ap.add_argument("--device-memory", default=None, help="pstar_fx's device_memory (default: the free memory)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--system", default="both", choices=("both", *SYSTEMS))
    ap.add_argument("--timeout", type=float, default=560, help="seconds for both sides' subprocesses together")
    ap.add_argument("--json", default=None, help="append the RESULT lines to this file")
    ap.add_argument("--profile", action="store_true", help="pstar_fx: one more step under torch.profiler")
    ap.add_argument("--dump-after", type=float, default=0, help="print every thread's stack every this many s")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps: at least 2 (the first step is reported apart)")
    if args.system != "both":
        logging.basicConfig(stream=sys.stderr, format="%(relativeCreated)8.0f ms %(message)s")
        logging.getLogger("pstar_fx").setLevel(logging.INFO)     # compile phases as they happen
        if args.dump_after:
            faulthandler.dump_traceback_later(args.dump_after, repeat=True)
        gpt.emit(run_side(args.system, args), args.json)
        return
    deadline = time.monotonic() + args.timeout
    child = gpt._without(argv, {"--json": True, "--system": True, "--timeout": True})
    for system in SYSTEMS:
        left = deadline - time.monotonic()
        if left < 20:
            gpt.emit({"system": system, "model": args.model, "error": "not run: --timeout spent"}, args.json)
            continue
        cmd = [sys.executable, os.path.abspath(__file__), *child, "--system", system, "--timeout", str(int(left))]
        print(f"lora_bench: {' '.join(cmd[1:])} (limit {left:.0f} s)", file=sys.stderr, flush=True)
        result, reason = gpt.child_result(cmd, left)
        gpt.emit(result if result is not None else {"system": system, "model": args.model, "error": reason},
                 args.json)


if __name__ == "__main__":
    main()
