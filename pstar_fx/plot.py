"""plot: one picture of a plan — bytes per tier along the step, chunk moves, and each chunk's tier.

`plot_memory(engine_or_plan, "memory.png")` (also `engine.plot_memory(path)`, `pstar-fx explain --plot PATH`)
draws `Plan.timeline()`, top to bottom:

  device tier   predicted bytes while each node runs: what is allocated once (chunk state, slots, buffers)
                and the live values on top; the budget; the measured peak once the engine has run a step
                (the runtime measures the peak only, not node by node);
  host tier     the same for the host (all of it allocated once, so flat);
  chunk moves   a tick per prefetch (a copy starts), fetch (the step waits for it), offload (a host chunk's
                gradients leave) and update (rt.adam, a node itself), at the node they come before;
  chunk tiers   one row per chunk, one column per node: state on the device, on the host, a host chunk's
                compute copy in a device slot, or crossing (prefetched, not yet fetched; gradients leaving).

x is the node index of the planned step (engine.graph in order without its chunk moves); forward and
backward are shaded. Drawing only: matplotlib (`pip install pstar_fx[plot]`), on its own Agg canvas (no
pyplot, no global backend change). A 10k-node plan of 3000 chunks draws in a second or two: the strip is
downsampled to at most `max_columns` x `max_rows` cells, each showing the most active state it covers.
"""
from __future__ import annotations

import os
from pathlib import Path

from .config import format_bytes
from .planning import TIER_NAMES, Plan, Timeline

TIER_COLOURS = ("#d4d4d4", "#2b6cb0", "#90cdf4", "#f08c00")   # host, device, copy on device, moving
FORWARD_SHADE, BACKWARD_SHADE = "#fff4d6", "#ece8f7"
CURVE_COLUMNS = 600     # the byte curves: at most this many runs of nodes, each at its max (about 1.5 px each)
EVENT_LANES = (("prefetch", "copy starts", "#f08c00"), ("fetch", "step waits for it", "#c05621"),
               ("offload", "grads to host", "#6b46c1"), ("update", "rt.adam", "#2f855a"))


def plot_memory(source, path: str | os.PathLike, *, title: str | None = None, max_columns: int = 1600,
                max_rows: int = 256) -> Path:
    """Draw the plan of `source` (an Engine or a Plan) to `path` (.png, .svg, .pdf: by its suffix). An
    Engine adds its measured peaks, once it has run a step, and its dtype and device. Returns the path."""
    try:
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError("plot_memory draws with matplotlib, which is not installed: "
                          "pip install pstar_fx[plot]") from None
    import numpy as np

    plan, engine = (source, None) if isinstance(source, Plan) else (source.plan, source)
    t = plan.timeline()
    measured = engine.memory_stats() if engine is not None and engine.steps > 0 else None
    n = t.nodes

    fig = Figure(figsize=(13, 9.5), dpi=110, layout="constrained")
    axes = fig.subplots(4, 1, sharex=True, gridspec_kw={"height_ratios": [3.2, 1.1, 1.0, 2.8]})
    dev, host, moves, strip = axes
    fig.suptitle(_title(plan, t, engine, title), fontsize=10, x=0.01, ha="left")

    for ax in (dev, host, moves):
        ax.axvspan(-0.5, t.backward_start - 0.5, color=FORWARD_SHADE, lw=0, zorder=0)
        ax.axvspan(t.backward_start - 0.5, n - 0.5, color=BACKWARD_SHADE, lw=0, zorder=0)
        ax.axvline(t.backward_start - 0.5, color="#805ad5", lw=1, ls="-", zorder=1)
        ax.grid(axis="y", color="white", lw=0.8)
    dev.set_xlim(-0.5 - n / 250, n - 0.5 + n / 250)     # a margin: a peak at the last node clears the frame

    # device tier
    # (drawn in the axis' unit, GiB/MiB/KiB, so its ticks are round numbers)
    device = np.asarray(t.device_bytes, dtype=np.float64)
    top = max(device.max(initial=0), t.device_budget_bytes or 0, measured["device_peak_bytes"] if measured else 0)
    name, size = _unit(top)
    x, device_max = _envelope(np, device, CURVE_COLUMNS)
    dev.fill_between(x, 0, t.device_fixed_bytes / size, color="#a3bffa", lw=0, zorder=2, step="post",
                     label=f"allocated once: chunk state,\nslots, buffers ({format_bytes(t.device_fixed_bytes)})")
    dev.fill_between(x, t.device_fixed_bytes / size, device_max / size, color="#3c66c4", lw=0, zorder=2,
                     step="post",
                     label="live values: activations,\ntemporaries")
    peak_at = int(device.argmax()) if n else 0
    dev.plot([peak_at], [device[peak_at] / size], marker="v", color="#1a365d", ms=7, zorder=4, ls="none",
             clip_on=False,
             label=f"planned peak {format_bytes(plan.device_peak_bytes)}\nat node {peak_at} ({t.node_names[peak_at]})")
    if t.device_budget_bytes:
        dev.axhline(t.device_budget_bytes / size, color="#c53030", ls="--", lw=1.4, zorder=3,
                    label=f"device budget {format_bytes(t.device_budget_bytes)}")
    if measured:
        dev.axhline(measured["device_peak_bytes"] / size, color="#2f855a", ls=":", lw=2, zorder=3,
                    label=f"measured peak {format_bytes(measured['device_peak_bytes'])}\n"
                          f"({_steps(measured['steps'])}; peak only, not per node)")
    dev.set_ylim(0, top / size * 1.12 or 1)
    dev.set_ylabel(f"device tier ({name})")
    y_text = top / size * 1.06
    dev.text(t.backward_start / 2, y_text, f"forward: nodes 0-{t.backward_start - 1}", ha="center", va="center",
             fontsize=9, color="#975a16")
    if t.backward_start < n:
        dev.text((t.backward_start + n) / 2, y_text, f"backward + per-chunk Adam: from node {t.backward_start} "
                 f"({t.node_names[t.backward_start]})", ha="center", va="center", fontsize=9, color="#553c9a")
    dev.legend(loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=8, frameon=False)

    # host tier
    host_bytes = np.asarray(t.host_bytes, dtype=np.float64)
    htop = max(host_bytes.max(initial=0), t.host_budget_bytes or 0, measured["host_peak_bytes"] if measured else 0)
    name, size = _unit(htop)
    host.fill_between(*_envelope(np, host_bytes / size, CURVE_COLUMNS), color="#b7b7b7", lw=0, zorder=2,
                      step="post",
                      label=f"planned {format_bytes(plan.host_peak_bytes)}: chunk\nstate, staging (allocated once)")
    if t.host_budget_bytes:
        host.axhline(t.host_budget_bytes / size, color="#c53030", ls="--", lw=1.4, zorder=3,
                     label=f"host budget {format_bytes(t.host_budget_bytes)}")
    if measured:
        host.axhline(measured["host_peak_bytes"] / size, color="#2f855a", ls=":", lw=2, zorder=3,
                     label=f"measured peak {format_bytes(measured['host_peak_bytes'])}")
    host.set_ylim(0, htop / size * 1.25 or 1)
    host.set_ylabel(f"host tier ({name})")
    host.legend(loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=8, frameon=False)

    # chunk moves: one lane per kind
    events = {"prefetch": t.prefetch_at, "fetch": t.fetch_at, "offload": t.offload_at, "update": t.update_at}
    for lane, (kind, what, colour) in enumerate(EVENT_LANES):
        at = np.unique([i for i, _ in events[kind]])     # one tick per node; per cell of the strip past that
        if n > max_columns:
            at = (np.unique(at * max_columns // n) + 0.5) * n / max_columns - 0.5
        moves.vlines(at, lane + 0.1, lane + 0.9, color=colour, lw=1.2 if len(at) < 500 else 0.6, zorder=2)
    moves.set_ylim(0, len(EVENT_LANES))
    moves.set_yticks([lane + 0.5 for lane in range(len(EVENT_LANES))],
                     [f"{kind} ({what}) ×{len(events[kind])}" for kind, what, _ in EVENT_LANES], fontsize=8)
    moves.invert_yaxis()
    moves.grid(False)

    # chunk tiers
    n_chunks = len(t.placement)
    tiers = t.tiers(columns=max_columns, rows=max_rows)
    rows = len(tiers)
    cells = np.frombuffer(b"".join(tiers), dtype=np.uint8).reshape(rows, -1)
    strip.imshow(cells, aspect="auto", interpolation="nearest", cmap=ListedColormap(TIER_COLOURS),
                 vmin=-0.5, vmax=len(TIER_COLOURS) - 0.5, extent=(-0.5, n - 0.5, n_chunks - 0.5, -0.5))
    strip.axvline(t.backward_start - 0.5, color="#805ad5", lw=1)
    strip.set_ylabel("chunk" + (f"\n({n_chunks / rows:.3g} per row)" if rows < n_chunks else ""))
    strip.legend(handles=[Patch(color=c, label=label) for c, label in
                          zip(TIER_COLOURS, TIER_NAMES[:3] + ("crossing: prefetched, not yet fetched; "
                                                              "gradients leaving",))],
                 loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=4, fontsize=8, frameon=False)
    strip.set_xlabel(f"node of the step ({n:,} nodes: engine.graph in order, chunk moves not counted)")

    path = Path(path)
    fig.savefig(path)
    return path


def _title(plan: Plan, t: Timeline, engine, title: str | None) -> str:
    n_chunks = len(t.placement)
    n_dev = t.placement.count("device")
    head = title or "pstar_fx plan"
    if engine is not None:
        head += f" — {engine.config.dtype} on {engine.device}"
    budgets = (f"device budget {format_bytes(t.device_budget_bytes) if t.device_budget_bytes else 'unlimited'}, "
               f"planned peak {format_bytes(plan.device_peak_bytes)}; host budget "
               f"{format_bytes(t.host_budget_bytes) if t.host_budget_bytes else 'unlimited'}, planned "
               f"{format_bytes(plan.host_peak_bytes)}" + ("" if plan.fits else "  — DOES NOT FIT"))
    return (f"{head}: {t.param_elems:,} parameters in {n_chunks} chunks of {t.chunk_elems:,} elements\n"
            f"chunk state (fp32 master + moments, {format_bytes(t.chunk_elems * plan.state_bytes_per_param)} each): "
            f"{n_dev} on the device, {n_chunks - n_dev} on the host\n{budgets}\n{plan.slots} compute slot(s), "
            f"{plan.grad_slots} gradient slot(s); {plan.fetches} fetches per step; transaction {plan.transaction}; "
            f"estimated step {_seconds(plan.estimated_step_seconds)} (cost model)")


def _unit(top: float) -> tuple[str, int]:
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if top >= size:
            return name, size
    return "B", 1


def _envelope(np, values, columns: int):
    """(x, y) to fill with step="post": each of at most `columns` runs of nodes spans its nodes exactly, at the
    max of `values` over them, so a one-node peak (even the last node's) stays visible."""
    n = len(values)
    k = max(1, min(columns, n))
    starts = np.unique(np.arange(k) * n // k)
    y = np.maximum.reduceat(values, starts) if n else np.zeros(1)
    return np.append(starts - 0.5, n - 0.5), np.append(y, y[-1])


def _steps(k: int) -> str:
    return f"{k} step" + ("s" if k != 1 else "")


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"
