"""The plan's estimate against the measured step, for every pstar_fx run recorded in bench/results/*.jsonl (issue 27:
within 7% for every row). Each record's estimate was made in its own run at that machine's calibrated rates, so
the two are comparable; planning again here at another session's rates is not (the rates vary from lease to lease:
matmul 561-722 TFLOPs).

    python bench/estimates.py [FILE.jsonl ...]        # default: every bench/results/*.jsonl

A step is compared where nothing changed its cost: no clipping that triggered (a record whose steps all reported a
clip coefficient of 1, or a --clip-sweep point that never triggers), and neither a replay nor a correction ran.
A --clip-sweep point whose every step clipped is compared with the plan's triggered estimate (`triggered`: every
step speculated and corrected), one whose every step deferred with its deferred one (`deferred`, clipping or
not). Records since session 20 carry the estimate's parts (`estimate_parts_s`: compute, copies and host Adam not
hidden; since session 23 also the copies' share that is backward waiting on its gradient slots, `grad_slot_waits`,
with the plan's `grad_slots`) and the runtime's per-step phases beside them; records with `window_s` (session 21
on) timed steps back to back, the ones before synchronized the device after each step, which charged a triggered
step the device work it leaves to overlap the next forward.
"""
import glob
import json
import os
import sys


# the runtime's per-step waits (runtime/telemetry.py) that read against the estimate's parts
WAITS = ("compute_waits_for_copies", "wait_for_host_grad_buffer", "wait_for_host_adam", "gpu_idle_for_host_grad_buffer",
         "gpu_idle_for_host_adam")


def untriggered(record: dict) -> list[tuple[str, float, dict | None]]:
    """(label, measured step seconds, the runtime's per-step phases) of the record's untriggered runs."""
    out = []
    reports = record.get("reports") or []
    if reports and all(r.get("clip_coef", 1.0) == 1.0 and not r.get("skipped") for r in reports):
        out.append(("steps", record["step_s"], record.get("phases")))
    for point in record.get("sweep") or []:
        deferred = [r.get("deferred", False) for r in point.get("reports") or []]
        if point.get("clipped") == 0 and point.get("grad_clip") is not None and not any(deferred):
            out.append((f"sweep clip {point['grad_clip']:g}", point["step_s"], point.get("phases")))
    return out


def triggered(record: dict) -> list[tuple[str, float, float, dict | None]]:
    """(label, the plan's estimate, measured step seconds, phases) of the record's sweep points whose every step
    clipped and was speculated (against the triggered estimate), or was deferred, clipping or not (against the
    deferred one: a replay plan's measured first)."""
    out = []
    for point in record.get("sweep") or []:
        reports = point.get("reports") or []
        deferred = [r.get("deferred", False) for r in reports]
        # every step clipped; or every step deferred, clipped or not (a deferred step costs the same either way)
        if not reports or not (point.get("clipped") == len(reports) or all(deferred)):
            continue
        est = (record.get("estimated_deferred_step_s") if all(deferred) else
               record.get("estimated_triggered_step_s") if not any(deferred) else None)
        if est:
            # the kernel and order of its corrections where a point chose them (session 22: @undo, @split)
            how = ((" undo" if point.get("correction") == "undo" else "")
                   + (" split" if point.get("copies_first") else ""))
            out.append((f"{'deferred' if all(deferred) else 'triggered'} {point['grad_clip']:g}{how}", est,
                        point["step_s"], point.get("phases")))
    return out


def main(paths: list[str]) -> None:
    print(f"{'file':<28} {'call':>4} {'model':<22} {'state':<5} {'run':<27} {'estimate':>8} {'measured':>8} "
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
            rows = [(label, r["estimated_step_s"], measured, phases) for label, measured, phases in untriggered(r)]
            for label, est, measured, phases in rows + triggered(r):
                parts = r.get("estimate_parts_s") if label.startswith(("steps", "sweep")) else None
                waits = {k: phases[k] for k in WAITS if k in phases} if phases else {}
                timing = "" if "window_s" in r else " (synced)"
                print(f"{os.path.basename(path)[:28]:<28} {str(r.get('call', '')):>4} {model[:22]:<22} "
                      f"{str(r.get('optimizer_state'))[:5]:<5} {(label + timing)[:27]:<27} {est:8.3f} "
                      f"{measured:8.3f} {est / measured:8.3f}  "
                      + (f"estimated {parts}" + (f" with {r['grad_slots']} gradient slot(s)" if "grad_slots" in r
                                                     else "") + "; " if parts else "")
                      + (f"measured waits {waits}" if waits else ""))


if __name__ == "__main__":
    main(sys.argv[1:] or sorted(glob.glob(os.path.join(os.path.dirname(__file__), "results", "*.jsonl"))))
