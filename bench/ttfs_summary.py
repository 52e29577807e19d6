"""One line per run of bench/ttfs_run.sh (its ttfs.jsonl files): the time to the first step's end, the compile's
phases, the steps after and the plan's estimate; then the region builds' lines of each run's log (where a cold
build's time went). For a device call's output, where few files come back.

    python bench/ttfs_summary.py OUT_DIR [OUT_DIR ...]
"""
import glob
import json
import os
import sys


def main(dirs):
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "**", "ttfs.jsonl"), recursive=True)):
            for line in open(path):
                r = json.loads(line)
                print(f"TTFS {r['model']} {r.get('optimizer_state')} {r['run']}: first step's end "
                      f"{r.get('time_to_first_step_s')} s, compile {r.get('compile_s')} s {r.get('compile_phases_s')}; "
                      f"steps {r.get('steps_s')}, est {r.get('estimated_step_s')}, {r.get('tflops')} TFLOPs; "
                      f"placement {r.get('placement_device_chunks')}/{r.get('chunks')}, {r.get('transaction')}; "
                      f"{r.get('regions')}; updates by block {r.get('updates_by_block')}; "
                      f"compute slots {r.get('compute_slots')}, grad slots {r.get('grad_slots')}")
        for path in sorted(glob.glob(os.path.join(d, "**", "ttfs-*.log"), recursive=True)):
            for line in open(path, errors="replace"):
                if "build workers" in line or "build regions:" in line or "region_" in line and "op by op" in line:
                    print(f"{os.path.basename(path)}: {line.strip()[:600]}")


if __name__ == "__main__":
    main(sys.argv[1:])
