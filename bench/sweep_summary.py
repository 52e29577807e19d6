"""A line per bench/gpt.py record with a --clip-sweep: the step that never triggers, the one that triggers on every
step, their ratio (issue 24's figure), where the device chunks' kept gradients were, the caching allocator's retries,
which way each step ran (deferred or speculated) and what the step that may defer timed, for reading a device
call's output at a glance (bench/closeout.sh prints it after its rows).

    python bench/sweep_summary.py FILE.jsonl [...]
"""
import json
import sys


def _ways(point: dict) -> str:
    """Each step of a sweep point: D deferred, S speculated (a step that may defer: runtime/timed_switch.py)."""
    return "".join("D" if rep.get("deferred") else "S" for rep in point.get("reports", []))


def lines(path: str) -> list[str]:
    out = []
    with open(path) as f:
        for r in map(json.loads, f):
            sweep = r.get("sweep") or []
            never = next((p for p in sweep if p.get("clipped") == 0), None)
            every = next((p for p in sweep if p.get("clipped") and p["clipped"] == len(p.get("steps_s", []))), None)
            kept = ("in activations" if r.get("kept_in_activations") else "beside the peak") \
                + f" {r.get('kept_on_device')}/{r.get('placement_device_chunks')}"
            if r.get("error"):
                out.append(f"SWEEP {r.get('model')}: error {r['error'][:160]}")
            elif never and every:
                out.append(f"SWEEP {r.get('model')} {r.get('optimizer_state')} {r.get('transaction')}, kept {kept}: "
                           f"never {never['step_s']:.4f} s, every {every['step_s']:.4f} s, "
                           f"{every['step_s'] / never['step_s']:.3f}x; retries {r.get('alloc_retries')}"
                           + "".join(f"; {name} {_ways(p)}" for name, p in (("never", never), ("every", every))
                                     if r.get("transaction") in ("kept_grads", "replay"))
                           + (f"; timed: {every['timed_switch']}" if every.get("timed_switch") else ""))
            else:
                out.append(f"SWEEP {r.get('model')} {r.get('optimizer_state')} {r.get('transaction')}, kept {kept}: "
                           f"step {r.get('step_s')} s ({r.get('tflops')} TFLOPs); retries {r.get('alloc_retries')}")
    return out


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print("\n".join(lines(p)))
