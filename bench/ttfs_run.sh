#!/usr/bin/env bash
# Time to the first step (issue 26), on the device machine after bench/gpu_run.sh built the package there:
# the same bench/gpt.py run twice, each in a fresh process — "cold" on the caches as they are (empty on a fresh
# machine: plan cache, Inductor's caches under ~/.cache/pstar_fx), then "warm" (same shapes). Each run's JSON goes
# to $OUT/ttfs.jsonl with a field "run", its whole log (timestamped: the compile's timeline) to
# $OUT/ttfs-MODEL-RUN.log; gpt.py's compile_phases_s and time_to_first_step_s say where the time went.
#   bash bench/ttfs_run.sh GPT3_18B "--compute inductor --optimizer-state bf16" [SECONDS_LEFT]
# RUNS (default "cold warm") names the runs in order; a run named "warm-noreserve" is a warm one with
# PSTAR_FX_RESERVE_CACHE=0 (the same-machine A/B of the remembered reserve: RUNS="cold warm warm-noreserve warm");
# a run named RUN:NAME=VALUE[,NAME=VALUE] runs with those variables set (RUNS="cold warm warm:PSTAR_FX_HUGE_PAGES=1"),
# its files named RUN-NAME_VALUE.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
model=$1; extra=${2:-}; left=${3:-560}
start=$(date +%s)
for run in ${RUNS:-cold warm}; do
  remaining=$(( left - ($(date +%s) - start) ))
  (( remaining > 30 )) || { echo "=== ttfs $run: no time left"; break; }
  echo "=== ttfs $model $run $(date +%T) (limit ${remaining}s)"
  reserve=1; [[ $run == warm-noreserve ]] && reserve=0
  vars=""; [[ $run == *:* ]] && vars=${run#*:} && run=${run%%:*}-${vars//[=,]/_}
  rm -f "$OUT/ttfs-$run.jsonl"                          # (a run named twice: ttfs.jsonl gets each once)
  env PSTAR_FX_RESERVE_CACHE=$reserve ${vars//,/ } timeout "$remaining" python3 bench/gpt.py --model "$model" --system pstar_fx --batch 16 --seq 1024 \
    --steps "${STEPS:-2}" --host-memory "${HOST:-110GiB}" $extra --json "$OUT/ttfs-$run.jsonl" 2>&1 \
    | grep -v "^DEBUG" | tee "$OUT/ttfs-${model//\//_}-$run.log" | grep -E "^(compile|step|fits|Traceback)|Error|build regions|build workers|initialize|allocate|page-lock|plan done|ahead of the plan|another plan|16-bit copies|artifact|op by op" | tail -24
  python3 - "$OUT/ttfs-$run.jsonl" "$run" >> "$OUT/ttfs.jsonl" <<'PY'
import json, os, sys
if not os.path.exists(sys.argv[1]):             # (a run cut by its limit wrote none: its log says how far it got)
    print(f"=== ttfs {sys.argv[2]}: no record (cut by its limit?)", file=sys.stderr)
    sys.exit(0)
for line in open(sys.argv[1]):
    r = json.loads(line); r["run"] = sys.argv[2]; print(json.dumps(r))
PY
done
