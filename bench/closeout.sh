#!/usr/bin/env bash
# The H200 rows that issues 24, 26 and 27 still need, as four device calls of at most ~560 s each (a machine start
# and the 600 s limit per command aside): each call builds the package (bench/gpu_run.sh) and runs its rows with a
# time share each, so a slow row never costs the rows after it their whole time. Run each as one device call with
# needs_h200 set (these rows are planned for 139 GiB: on an H100 they stop at a BudgetError or plan two_pass):
#   run(command="bash bench/closeout.sh A", kind="nvidia-h200", needs_h200=True)
# A: issue 26 (time to the first step, cold then warm, each in a fresh process; GPT3_18B with bf16 and fp32 moments,
#    the 4.2B cold) and, from the same runs' steps after the first, issue 27's two GPT3_18B rows; the box's limits.
# B: issue 27's other rows: h4096 L99 with fp32 moments at 110 GiB, the 4.2B beside the fastest PyTorch that fits.
# C: issue 24 at 8B and 10B: our LLaMA and HF LlamaForCausalLM at Llama-3-8B's shape, GPT3_10B, clip 1.0 on early
#    norms (`1e-3@1`: triggers every step, the plan made for it) beside the same engine unclipped (`1e9@0`).
# D: issue 24 at 18B, bf16 and fp32 moments, the same sweep.
# E: what session 37's calls left open: the calibration's matmul in fresh processes, old way and new
#    (bench/calibration_spread.py); GPT3_10B's clipped sweep again (1.118x there, 1.034x in session 26); the 4.2B beside
#    compiled PyTorch without checkpointing (torch-best's choice there), 10 steps each.
# F: session 38's device chunks' kept gradients in the memory backward frees (Plan.kept_in_activations): its GPU
#    tests, then issue 24's 10B and 8B rows again (C's sweep).
# G: those kept gradients on (PSTAR_FX_KEPT_IN_ACTIVATIONS=1) and off, side by side: GPT3_10B, then our LLaMA 8B.
# H: the same on and off at GPT3_10B (clip sweep) and GPT3_18B with bf16 moments (deferred, unclipped).
# I: G's LLaMA rows alone (after the kept gradients left a chunk's margin free on CUDA).
#    (Session 39 ran a call J at a0ce50c: I's rows with a third, the kept gradients copied out of their slots,
#    which has since become how they are kept.)
# K: our LLaMA 8B deferred every step (`--transaction deferred`) with the device chunks' kept gradients in
#    activations and without, to read beside J's auto plan with them (which speculates and corrects): which a
#    triggered step should choose once no kept gradient crosses to the host (session 39's H100 call J left it open).
# L: H's GPT3_10B rows alone (issue 24's 10B, in activations on and off), for a session with less device time left
#    than H needs (CLOSEOUT_S=420 was enough for the two at 6 steps; 10 steps a point now, CLOSEOUT_S=470).
# M: the step that may defer choosing by its timed steps (runtime/timed_switch.py): its GPU tests, then our LLaMA 8B
#    "auto" with the kept gradients in activations (session 39's call J: speculated and corrected 2.168 s where
#    deferring, call K, ran 1.833), 10 steps a point, with the timed switch and without (PSTAR_FX_TIMED_SWITCH=0).
# N: L's first row alone (GPT3_10B, the kept gradients in activations, the timed switch), for a session with less
#    device time still (CLOSEOUT_S=300).
# O: what issues 24 and 27 still need from an H200, in one call: the calibration's matmul in fresh processes, old way
#    and new (E's first line: issue 27's estimates), then what flipping PSTAR_FX_KEPT_IN_ACTIVATIONS on by default
#    waits for: GPT3_10B's clip sweep with them on (N's row; its off side is session 37's 1.118x), then GPT3_18B
#    with bf16 moments with them on (>= 480 TFLOPs still?). CLOSEOUT_S=510.
# Each call's records land in $OUT (gpt.jsonl, ttfs.jsonl, limits.json) and its lines in the output's tail; copy
# them to bench/results/ and the tables to bench/RESULTS.md with the call's date and device.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
call=${1:?which call: A to O}
start=$(date +%s)
left() { echo $(( ${CLOSEOUT_S:-560} - ($(date +%s) - start) )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stages=(); [[ $call == A ]] && stages=("limits:--rounds,1,--elems,128M")     # (the box's limits beside its rows)
bash bench/gpu_run.sh "${stages[@]}" > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
echo "=== built in $(( $(date +%s) - start )) s"
# one bench/gpt.py row as bench/gpu_run.sh's gpt stage runs it, cut at SECONDS: row SECONDS MODEL SYSTEM HOST [ARGS]
row() {
  local secs=$1 model=$2 system=$3 host=$4; shift 4
  echo "=== $model $system $* (${secs}s) $(date +%T)"
  timeout "$secs" python3 bench/gpt.py --model "$model" --system "$system" --batch 16 --seq 1024 --steps "${STEPS:-6}" \
    --host-memory "$host" "$@" --json "$OUT/gpt.jsonl" 2>> "$OUT/gpt.log" | grep -E "^(step|RESULT)" | cut -c1-600
}
# the calibration's matmul in fresh processes, old way and new (bench/calibration_spread.py), one line a method
spread() { timeout 90 python3 bench/calibration_spread.py --processes 12 2>&1 | tee "$OUT/spread.txt" | grep SPREAD; }
sweep="--grad-clip 1.0 --expected-trigger-rate 1 --clip-sweep=1e9@0,1e-3@1"
case "$call" in
  A)
    export STEPS=5
    OUT=/tmp/ca1 RUNS="cold warm" bash bench/ttfs_ab.sh GPT3_18B "--optimizer-state bf16" $(( $(left) * 2 / 5 )) \
      > "$OUT/ttfs-18b-bf16.log" 2>&1
    OUT=/tmp/ca2 RUNS="cold warm" bash bench/ttfs_ab.sh GPT3_18B "" $(( $(left) * 2 / 3 )) > "$OUT/ttfs-18b-fp32.log" 2>&1
    OUT=/tmp/ca3 RUNS=cold bash bench/ttfs_ab.sh GPT_h3072_L36 "" $(( $(left) - 10 )) > "$OUT/ttfs-4b.log" 2>&1
    cat /tmp/ca*/*/ttfs.jsonl > "$OUT/ttfs.jsonl" 2>/dev/null
    python3 bench/ttfs_summary.py /tmp/ca1 /tmp/ca2 /tmp/ca3 | grep "^TTFS" | cut -c1-700 ;;
  B)
    row $(( $(left) / 3 )) GPT3_18B pstar_fx 110GiB --layers 99
    row $(( $(left) / 4 )) GPT_h3072_L36 pstar_fx 110GiB
    peer=$(( $(left) - 10 )); row $peer GPT_h3072_L36 torch-best 110GiB --sweep-timeout $(( peer - 20 )) ;;
  C)
    row $(( $(left) / 3 )) llama/Llama3_8B pstar_fx 110GiB $sweep
    row $(( $(left) / 2 )) hf-llama/Llama3_8B pstar_fx 110GiB $sweep
    row $(( $(left) - 10 )) GPT3_10B pstar_fx 108GiB $sweep ;;
  D)
    row $(( $(left) / 2 )) GPT3_18B pstar_fx 110GiB --optimizer-state bf16 $sweep
    row $(( $(left) - 10 )) GPT3_18B pstar_fx 110GiB $sweep ;;
  E)
    spread
    row $(( $(left) / 2 )) GPT3_10B pstar_fx 108GiB $sweep
    STEPS=10 row $(( $(left) / 3 )) GPT_h3072_L36 pstar_fx 110GiB
    STEPS=10 row $(( $(left) - 10 )) GPT_h3072_L36 torch 110GiB --checkpoint none --compile ;;
  F)
    timeout 150 python3 -m pytest -q -rs -p no:logging --tb=short -o faulthandler_timeout=100 tests/test_gpu.py \
      -k "speculating_and_deferring or interrupted" 2>&1 | tail -15 | tee "$OUT/tests.txt"
    row $(( $(left) / 3 )) GPT3_10B pstar_fx 108GiB $sweep
    row $(( $(left) / 2 )) llama/Llama3_8B pstar_fx 110GiB $sweep
    row $(( $(left) - 10 )) hf-llama/Llama3_8B pstar_fx 110GiB $sweep ;;
  G)
    PSTAR_FX_KEPT_IN_ACTIVATIONS=1 row $(( $(left) / 4 )) GPT3_10B pstar_fx 108GiB $sweep
    PSTAR_FX_KEPT_IN_ACTIVATIONS=0 row $(( $(left) / 3 )) GPT3_10B pstar_fx 108GiB $sweep
    PSTAR_FX_KEPT_IN_ACTIVATIONS=1 row $(( $(left) / 2 )) llama/Llama3_8B pstar_fx 110GiB $sweep
    PSTAR_FX_KEPT_IN_ACTIVATIONS=0 row $(( $(left) - 10 )) llama/Llama3_8B pstar_fx 110GiB $sweep ;;
  H)
    PSTAR_FX_KEPT_IN_ACTIVATIONS=1 row $(( $(left) / 4 )) GPT3_10B pstar_fx 108GiB $sweep
    PSTAR_FX_KEPT_IN_ACTIVATIONS=0 row $(( $(left) / 3 )) GPT3_10B pstar_fx 108GiB $sweep
    PSTAR_FX_KEPT_IN_ACTIVATIONS=1 row $(( $(left) / 2 )) GPT3_18B pstar_fx 110GiB --optimizer-state bf16
    PSTAR_FX_KEPT_IN_ACTIVATIONS=0 row $(( $(left) - 10 )) GPT3_18B pstar_fx 110GiB --optimizer-state bf16 ;;
  I)
    PSTAR_FX_KEPT_IN_ACTIVATIONS=1 row $(( $(left) / 2 )) llama/Llama3_8B pstar_fx 110GiB $sweep
    PSTAR_FX_KEPT_IN_ACTIVATIONS=0 row $(( $(left) - 5 )) llama/Llama3_8B pstar_fx 110GiB $sweep ;;
  K)
    PSTAR_FX_KEPT_IN_ACTIVATIONS=1 row $(( $(left) / 2 )) llama/Llama3_8B pstar_fx 110GiB $sweep --transaction deferred
    PSTAR_FX_KEPT_IN_ACTIVATIONS=0 row $(( $(left) - 5 )) llama/Llama3_8B pstar_fx 110GiB $sweep --transaction deferred ;;
  L)
    export STEPS=${STEPS:-10}       # (10 a point: room for the timed switch's probe, runtime/timed_switch.py)
    PSTAR_FX_KEPT_IN_ACTIVATIONS=1 row $(( $(left) / 2 )) GPT3_10B pstar_fx 108GiB $sweep
    PSTAR_FX_KEPT_IN_ACTIVATIONS=0 row $(( $(left) - 5 )) GPT3_10B pstar_fx 108GiB $sweep ;;
  M)
    timeout 150 python3 -m pytest -q -rs -p no:logging --tb=short -o faulthandler_timeout=100 tests/test_gpu.py \
      -k "timed_steps or by_turns" 2>&1 | tail -15 | tee "$OUT/tests.txt"
    export STEPS=10 PSTAR_FX_KEPT_IN_ACTIVATIONS=1
    row $(( $(left) / 2 )) llama/Llama3_8B pstar_fx 110GiB $sweep
    PSTAR_FX_TIMED_SWITCH=0 row $(( $(left) - 5 )) llama/Llama3_8B pstar_fx 110GiB $sweep ;;
  N)
    STEPS=${STEPS:-10} PSTAR_FX_KEPT_IN_ACTIVATIONS=1 row $(( $(left) - 5 )) GPT3_10B pstar_fx 108GiB $sweep ;;
  O)
    spread
    STEPS=${STEPS:-10} PSTAR_FX_KEPT_IN_ACTIVATIONS=1 row $(( $(left) - 150 )) GPT3_10B pstar_fx 108GiB $sweep
    PSTAR_FX_KEPT_IN_ACTIVATIONS=1 row $(( $(left) - 5 )) GPT3_18B pstar_fx 110GiB --optimizer-state bf16 ;;
  *) echo "closeout: no call $call (A-O)"; exit 2 ;;
esac
[[ -s "$OUT/gpt.jsonl" ]] && python3 bench/sweep_summary.py "$OUT/gpt.jsonl"     # a line per row, at a glance
echo "=== call $call done in $(( $(date +%s) - start )) s"
