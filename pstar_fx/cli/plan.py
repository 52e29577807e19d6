"""plan: `pstar-fx plan` — size a model built on the meta device against budgets: fits or not, and why; allocates
nothing. Sizing for a GPU box by default (cuda, bf16), which needs no GPU."""
from __future__ import annotations

import sys
from collections import Counter

import pstar_fx
from pstar_fx.config import Config, format_bytes
from pstar_fx.planning.costs import NOMINAL_COLL_BW, assumed

from .args import common, config_dict, example_inputs, one_line, positive_float, positive_int, seq_len


def add_parser(sub) -> None:
    plan = sub.add_parser("plan", help="does a model fit? (built on the meta device, nothing allocated)",
                          description="Plan a model built on the meta device against device and host budgets. "
                                      "Sizing for a GPU box by default (--device cuda --dtype bf16, no GPU needed). "
                                      "Exits 0 when it fits, 1 when it does not.")
    common(plan, None, sizing=True)
    plan.add_argument("--seq", type=positive_int, help="sequence length (default the model's block_size)")
    plan.add_argument("--gpus", type=positive_int, default=1, metavar="N",
                      help="data-parallel ranks, chunks partitioned (chunk c's state lives on rank c %% N only); "
                           "--batch, --device-memory and --host-memory are then per rank, and the plan printed is "
                           "rank 0's, which holds the most chunks (default 1)")
    plan.add_argument("--coll-bw", type=positive_float, metavar="GB/s",
                      help="the collective bus bandwidth between ranks to assume, with --gpus (default the "
                           f"nominal figure, printed: {NOMINAL_COLL_BW['cuda'] / 1e9:.0f} for cuda, NCCL within one "
                           "NVLink host; across hosts give the network's, e.g. 45 for 400 Gb/s InfiniBand per GPU)")


def run(args, parser) -> int:
    seq = seq_len(args, parser, None)
    if args.coll_bw is not None and args.gpus == 1:
        parser.error("--coll-bw is the bandwidth between ranks: it needs --gpus 2 or more")
    # A plan sizes the model for a GPU box unless told otherwise: cuda and bf16 are the defaults here, and
    # planning for cuda needs no GPU (nothing is allocated).
    config = Config.from_dict({"device": "cuda", "dtype": "bf16", **config_dict(args)})
    model = args.model.build(meta=True)
    n_params = sum(p.numel() for p in model.parameters())
    per_rank = " per rank" if args.gpus > 1 else ""
    print(f"{args.model}: {n_params:,} parameters; batch {args.batch} x seq {seq}{per_rank}; {config.dtype}; "
          f"device {config.device}; device_memory "
          f"{format_bytes(config.device_memory) if config.device_memory else 'unlimited'}, host_memory "
          f"{format_bytes(config.host_memory) if config.host_memory else 'unlimited'}{per_rank}"
          + (f"; {args.gpus} data-parallel ranks" if args.gpus > 1 else ""))
    try:
        with assumed(**({} if args.coll_bw is None else {"coll_bw": args.coll_bw * 1e9})):
            plan = pstar_fx.plan(model, config, example_inputs(args, seq), world=args.gpus, rank=0)
    except pstar_fx.BudgetError as e:
        print(f"answer: does not fit: {one_line(e)}")
        return 1
    except Exception as e:  # planning on meta is young; a failure is an error line, not a traceback
        print(f"pstar-fx plan: error: planning failed: {type(e).__name__}: {one_line(e)}", file=sys.stderr)
        return 1
    print(plan.summary())
    print(_job_summary(plan, args, config, n_params, seq))
    print("answer: fits" if plan.fits else "answer: does not fit (the plan above says why)")
    return 0 if plan.fits else 1


def _job_summary(plan, args, config: Config, n_params: int, seq: int) -> str:
    """What the plan means for the whole job: the model state over the ranks, the predicted step's tokens/s
    and TFLOPs (6 * parameters * tokens, the convention of bench/RESULTS.md), and the rates it assumed."""
    gpus = args.gpus
    n_chunks = len(plan.placement)
    lines = []
    if gpus > 1 and plan.world > 1:
        # the k-th chunk each rank owns sits on the same tier on every rank (make_plan): the first n_device
        # of a rank's chunks are on its device, the rest on its host
        owned = Counter(plan.owner(c) for c in range(n_chunks))
        groups: dict[int, list[int]] = {}                   # chunks owned -> the ranks that own that many
        for r in range(gpus):
            groups.setdefault(owned[r], []).append(r)
        state_bytes = int(n_chunks * plan.profile.chunk_elems * plan.state_bytes_per_param)
        lines.append(f"data parallel: {gpus} ranks, chunks partitioned (chunk c's state on rank c % {gpus}); the "
                     "plan above is rank 0's, which holds the most")
        lines.append(f"  model state (fp32 masters + Adam moments, {plan.state_bytes_per_param:.3g} B/param): "
                     f"{format_bytes(state_bytes)} in all, {n_chunks} chunks spread over the ranks")
        lines += [f"  rank{'s' if len(rs) > 1 else ''} {_rank_range(rs)}: {k} chunks, {min(k, plan.n_device)} on "
                  f"device, {k - min(k, plan.n_device)} on host: {format_bytes(k * state_bytes // n_chunks)} of state"
                  + (" each" if len(rs) > 1 else "") for k, rs in sorted(groups.items(), reverse=True)]
    elif gpus > 1:
        lines.append(f"data parallel: {gpus} ranks, replicated (Config.data_parallel): every rank holds the whole "
                     "state, as planned above")
    tokens = args.batch * seq * gpus
    step_s = plan.estimated_step_seconds
    if config.grad_accum > 1:
        lines.append("predicted: no step time for grad_accum > 1 (the cost model's estimate covers the compute of "
                     "one micro-batch)")
    elif plan.fits and step_s > 0:
        lines.append(f"predicted: {tokens:,} tokens per step" + (f" ({gpus} x {tokens // gpus:,})" if gpus > 1 else "")
                     + f", {step_s:.3g} s per step (the cost model's estimate), {tokens / step_s:,.0f} tokens/s, "
                     f"{_num(6 * n_params * tokens / step_s / 1e12)} TFLOPs (6 * parameters * tokens)"
                     + (f", {_num(6 * n_params * tokens / step_s / 1e12 / gpus)} per GPU" if gpus > 1 else ""))
    r = plan.rates
    if r is not None:
        kind = "cuda" if config.device.startswith("cuda") else "cpu"
        link = "NCCL within one NVLink host" if kind == "cuda" else "gloo between processes of one host"
        coll = (f"collective bus {_num(r.coll_bw / 1e9)} GB/s ("
                + ("--coll-bw" if args.coll_bw is not None else
                   f"nominal, not measured: {link}; --coll-bw sets it"
                   if r.coll_bw == NOMINAL_COLL_BW[kind] else "measured") + "), ") if plan.world > 1 else ""
        lines.append(f"rates the estimate uses ({r.device}): {coll}host->device {_num(r.h2d_bw / 1e9)} GB/s, "
                     f"device->host {_num(r.d2h_bw / 1e9)} GB/s, matmul {_num(r.flops / 1e12)} TFLOP/s, device memory "
                     f"{_num(r.mem_bw / 1e12)} TB/s, host Adam {_num(r.host_adam_with(plan.optimizer_state) / 1e9)} "
                     f"G params/s" + (f" ({plan.optimizer_state} moments)" if plan.optimizer_state != "fp32" else ""))
    return "\n".join(lines)


def _num(x: float) -> str:
    """Three significant digits, thousands separated: 1,980 and 0.0123 alike."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _rank_range(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
