#!/usr/bin/env bash
# A/B of settings on the time to the first step (issue 26) and the steps after, on the device machine after
# bench/gpu_run.sh built the package there: the GPU's rates measured once (caches of their own), then for each
# setting in AB (space-separated; a setting is NAME=VALUE pairs joined by commas) bench/ttfs_run.sh's runs (RUNS,
# default "cold warm") on caches holding only those rates: every cold run starts from the same empty Inductor,
# Triton and plan caches and none of them waits for a rates measurement. Each setting's files under $OUT/<k>-<setting>/.
#   AB="PSTAR_FX_BLOCK_SPANS=0 PSTAR_FX_BLOCK_SPANS=1" bash bench/ttfs_ab.sh GPT_h3072_L36 "" 300
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
model=$1; extra=${2:-}; left=${3:-560}
start=$(date +%s)
rates=/tmp/ttfs-ab-rates
rm -rf "$rates"; mkdir -p "$rates"
PSTAR_FX_CACHE=$rates python3 -c "
import time, torch
from pstar_fx.planning.costs import calibrate
t = time.perf_counter(); r = calibrate(torch.device('cuda'), torch.bfloat16)
print(f'=== rates measured in {time.perf_counter() - t:.1f} s: {r}')"
settings=(${AB:-PSTAR_FX_BLOCK_SPANS=1})
for k in "${!settings[@]}"; do
  setting=${settings[$k]}
  share=$(( (left - ($(date +%s) - start)) / (${#settings[@]} - k) ))
  (( share > 30 )) || { echo "=== $setting: no time left"; break; }
  dir=/tmp/ttfs-ab-$k; rm -rf "$dir"; mkdir -p "$dir"; cp "$rates"/*.json "$dir"/
  echo "=== setting $k: $setting (caches $dir, ${share}s)"
  env ${setting//,/ } PSTAR_FX_CACHE="$dir" TRITON_CACHE_DIR="$dir/triton" OUT="$OUT/$k-${setting//[=,]/_}" \
    bash bench/ttfs_run.sh "$model" "$extra" "$share"
done
