"""plan_cache: the recompute search's decision, kept on disk so a second compile of the same step plans once.

The plan step (recompute_search) tries a dozen recompute variants, each a full `make_plan`; at 18B that is most
of the plan phase's 37-52 s. Its outcome is a `Try` (how many cheap values, which run length, how many runs) and
two lines of the plan's remarks (`recompute`, which reads plans of tries other than the winner, and `why`).
Everything else the engine uses is a function of the winning try: the lowered graph is `fuse_optimizer(recompute(
graph, try))` and the plan is `make_plan` of that graph, both deterministic for the same inputs. So the cache
stores the decision, not the plan: a warm compile applies the one try and runs `make_plan` once, and the plan,
the graph code and the training bits are those of the cold compile (tests/test_plan_cache.py holds them equal).

An entry is keyed by a sha256 fingerprint of everything the search reads: the graph the plan step receives (each
node's op, name, target, arguments, the metadata the passes read, and its value's shape, dtype and stride: the
model's structure and the input shapes), the chunk layout, the parameters' names (their blocks) and whether
blocks are planned as spans (PSTAR_FX_BLOCK_SPANS, PSTAR_FX_SPANS_MAY_COST), every Config field but those
planning never reads (`NOT_PLANNED`), the compute dtype and device, the cost model's Rates, the world and rank,
torch's version and `FORMAT`. The fingerprint is stored inside the entry and compared on load, and the applied
try's plan must give the device peak, fit and step estimate the entry recorded: a mismatch falls back to the full
search, which rewrites the entry. An unreadable or corrupt entry is ignored (a debug log line) and rewritten;
writes go to a temporary file renamed over the entry, so a reader never sees half of one. Files lie beside the
calibrated rates (`costs.cache_root()`: ~/.cache/pstar_fx, or PSTAR_FX_CACHE) as plan-v<FORMAT>-<fingerprint>.json.
PSTAR_FX_PLAN_CACHE=0 switches the cache off (neither read nor written).

A step planned on another step's chunk memory (`Lowered(on=...)`, other input shapes) is not cached: its plan
depends on that plan too, and its search is already short (the placement is fixed). Not yet reused: partitioned
data-parallel ranks, which measure their collective bandwidth at each launch (`Lowered._rates`), so their rates,
and with them the key, change from run to run (they search, as before, and leave an entry nothing reads).
A CUDA budget taken from free memory is rounded down at launch (runtime/dist.launch) so that it holds.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..planning import blocks
from ..planning.costs import cache_root, write_entry
from ..planning.planner import spans_may_cost

log = logging.getLogger("pstar_fx")

FORMAT = 8      # bump when what an entry means, or what the fingerprint covers, changes (4: gradient buffers
#                sized by Layout.state_elems: a LoRA decision made with chunk-long ones would place otherwise;
#                5: the host chunks' order, which a warm compile plans with instead of comparing both; 6: nested
#                pairs of runs, which a search may now choose where an entry before them pinned another try; 7: the
#                blocks' spans, from the parameters' names: planning/blocks.py; 8: blocks' spans cut after the ops
#                every block's span runs)

# Config fields planning never reads: the lr schedule (a callable's repr holds its address) and the process
# group's timeout
NOT_PLANNED = frozenset({"lr_schedule", "dist_timeout"})

# node metadata the passes and the planner read (besides "val", fingerprinted by shape, dtype and stride)
_META = ("role", "index", "param", "scratch_bytes")


@dataclass(frozen=True)
class Decision:
    """What the search decided, and what the applied try's plan must reproduce for the entry to stand."""
    cheap: int
    run_len: int
    runs: int
    recompute: str                  # the plan's remarks: what it recomputes, and why more was tried
    why: str
    device_peak_bytes: int          # checks
    fits: bool
    estimated_step_seconds: float
    host_order: str = "last"        # how the host chunks lie (planning.placement HOST_ORDERS): planned with it alone
    tried: tuple[str, ...] = ()     # the search's tries, a line each (the plan's `tried`: explain(), bench records)
    nested: int = 0                 # pairs of runs whose inner boundary is remade too (recompute_search.Try)


def enabled() -> bool:
    return os.environ.get("PSTAR_FX_PLAN_CACHE", "1").strip() not in ("0", "false", "no", "off")


def fingerprint(gm: fx.GraphModule, ctx, rates, buffer_bytes: int, partition: dict) -> str:
    """sha256 over what the search's outcome depends on (the module docstring lists it)."""
    h = hashlib.sha256()

    def put(*parts) -> None:
        for p in parts:
            h.update(str(p).encode())
            h.update(b"\x00")

    put("format", FORMAT, "torch", torch.__version__)
    config = ctx.config
    put("config", *(f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
                     if f.name not in NOT_PLANNED))
    put("device", ctx.device, "dtype", ctx.dtype, "dp", ctx.dp, "partition", sorted(partition.items()))
    put("rates", *(f"{k}={v!r}" for k, v in dataclasses.asdict(rates).items()))
    put("buffers", buffer_bytes)
    put("layout", _layout_text(ctx.layout))
    put("blocks", blocks.enabled(), spans_may_cost(), *(s.param.name for s in ctx.layout.slots))   # (by block?)
    for n in gm.graph.nodes:
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: _NodeName(a.name))
        put(n.op, n.name, _target(n.target), _value_text(args), _value_text(n.meta.get("val")),
            *(f"{k}={_value_text(n.meta[k])}" for k in _META if k in n.meta))
    return h.hexdigest()


def path(key: str) -> str:
    return os.path.join(cache_root(), f"plan-v{FORMAT}-{key}.json")


def load(key: str) -> tuple[Decision, str] | None:
    """The entry for `key` and its file, or None (none, unreadable, or another fingerprint inside)."""
    file = path(key)
    try:
        with open(file) as f:
            entry = json.load(f)
        if entry.get("format") != FORMAT or entry.get("fingerprint") != key:
            log.debug("plan cache: %s is for another graph or format; ignored", file)
            return None
        decision = Decision(**{**entry["decision"], "tried": tuple(entry["decision"].get("tried", ()))})
        kinds = {"cheap": int, "run_len": int, "runs": int, "recompute": str, "why": str, "device_peak_bytes": int,
                 "fits": bool, "estimated_step_seconds": (int, float), "host_order": str}
        wrong = [k for k, t in kinds.items() if not isinstance(getattr(decision, k), t)]
        if wrong:
            raise ValueError(f"field(s) of the wrong type: {', '.join(wrong)}")
        return decision, file
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        log.debug("plan cache: %s is unreadable (%s: %s); ignored, it will be rewritten", file, type(e).__name__, e)
        return None


def store(key: str, decision: Decision) -> None:
    """Write the entry atomically; a cache that cannot be written costs the next compile a search, nothing more."""
    file = path(key)
    try:
        write_entry(file, {"format": FORMAT, "fingerprint": key, "decision": dataclasses.asdict(decision)})
    except OSError as e:
        log.debug("plan cache: could not write %s (%s)", file, e)


def matches(decision: Decision, plan) -> bool:
    """Whether the applied try's plan is the one the entry recorded."""
    return (plan.device_peak_bytes == decision.device_peak_bytes and plan.fits == decision.fits
            and plan.estimated_step_seconds == decision.estimated_step_seconds)


class _NodeName(str):
    def __repr__(self) -> str:
        return f"%{self}"


def _target(target) -> str:
    if isinstance(target, str):
        return target
    # ops print by name; plain Python functions by module and name, not by their address
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return str(target)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def _value_text(v) -> str:
    """A value's text without addresses: tensors by shape, dtype and stride; containers by their items."""
    if isinstance(v, torch.Tensor):
        return f"T({tuple(v.shape)},{v.dtype},{tuple(v.stride()) if v.layout == torch.strided else v.layout})"
    if isinstance(v, (list, tuple)):
        return ("[" if isinstance(v, list) else "(") + ",".join(_value_text(x) for x in v) + ")"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k!r}:{_value_text(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (str, int, float, bool, type(None), torch.dtype, torch.device, torch.memory_format,
                      torch.layout, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return repr(v)
    if callable(v):
        return _target(v)
    return f"{type(v).__qualname__}:{v!r}"


def _layout_text(layout) -> str:
    return _value_text([layout.chunk_size, layout.state_elems]
                       + [(c.id, c.used_elems, c.frozen, [(s.offset, s.numel, s.param.has_grad) for s in c.slots])
                          for c in layout.chunks])
