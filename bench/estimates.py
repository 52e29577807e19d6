"""The plan's estimate against the measured step, for every pstar_fx run recorded in bench/results/*.jsonl (issue 27:
within 7% for every row). Each record's estimate was made in its own run at that machine's calibrated rates, so
the two are comparable; planning again here at another session's rates is not (the rates vary from lease to lease:
matmul 561-722 TFLOPs).

    python bench/estimates.py [FILE.jsonl ...]        # default: every bench/results/*.jsonl

A step is compared where nothing changed its cost: no clipping that triggered (a record whose steps all reported a
clip coefficient of 1, or a --clip-sweep point that never triggers), and neither a replay nor a correction ran.
Records since session 20 carry the estimate's parts (`estimate_parts_s`: compute, copies and host Adam not hidden)
and the runtime's per-step phases beside them.
"""
import glob
import json
import os
import sys


# the runtime's per-step waits (runtime/telemetry.py) that read against the estimate's parts
WAITS = ("compute_waits_for_copies", "wait_for_host_grad_buffer", "wait_for_host_adam")


def untriggered(record: dict) -> list[tuple[str, float, dict | None]]:
    """(label, measured step seconds, the runtime's per-step phases) of the record's untriggered runs."""
    out = []
    reports = record.get("reports") or []
    if reports and all(r.get("clip_coef", 1.0) == 1.0 and not r.get("skipped") for r in reports):
        out.append(("steps", record["step_s"], record.get("phases")))
    for point in record.get("sweep") or []:
        if point.get("clipped") == 0 and point.get("grad_clip") is not None:
            out.append((f"sweep clip {point['grad_clip']:g}", point["step_s"], point.get("phases")))
    return out


def main(paths: list[str]) -> None:
    print(f"{'file':<28} {'call':>4} {'model':<22} {'state':<5} {'run':<18} {'estimate':>8} {'measured':>8} "
          f"{'est/meas':>8}  the estimate's parts, the runtime's waits")
    for path in paths:
        for line in open(path):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("system") != "pstar_fx" or not r.get("estimated_step_s") or "step_s" not in r:
                continue
            model = f"{r.get('model')} L{r.get('n_layer')}" if r.get("n_layer") else str(r.get("model"))
            for label, measured, phases in untriggered(r):
                parts = r.get("estimate_parts_s")
                waits = {k: phases[k] for k in WAITS if k in phases} if phases else {}
                print(f"{os.path.basename(path)[:28]:<28} {str(r.get('call', '')):>4} {model[:22]:<22} "
                      f"{str(r.get('optimizer_state'))[:5]:<5} {label:<18} {r['estimated_step_s']:8.3f} "
                      f"{measured:8.3f} {r['estimated_step_s'] / measured:8.3f}  "
                      + (f"estimated {parts}; " if parts else "") + (f"measured waits {waits}" if waits else ""))


if __name__ == "__main__":
    main(sys.argv[1:] or sorted(glob.glob(os.path.join(os.path.dirname(__file__), "results", "*.jsonl"))))
