#!/usr/bin/env bash
# A/B in one device call: each `gpt:` stage runs on a baseline tree and on this tree, back to back, on one box.
#   git archive REV | tar -x -C .base          (here; .base is ignored, so carry it: run(..., carry=[".base"]))
#   bash bench/gpu_ab.sh "tests:K_EXPR" "gpt:MODEL:pstar_fx:16:::EXTRA ARGS" ...
# Stages: tests[:PYTEST_K_EXPR] (tests/test_gpu.py on this tree only), undo[:ARGS] (bench/host_undo_bench.py ARGS,
# spaces as commas, on this tree) and gpt:MODEL:SYSTEM[:BATCH[:HOST[:LAYERS[:EXTRA]]]]
# as in gpu_run.sh. No pip install: each tree builds its C++ Adam in place and is put first on PYTHONPATH (its
# pstar_fx/kernels and pstar_fx/models link to the top-level folders, as the install maps them).
# Records: $OUT/base.jsonl and $OUT/head.jsonl (bench/gpt.py --json), logs beside them. STEPS (default 6).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
HEAD=$(pwd); BASE=$HEAD/.base
nvidia-smi -L; nproc; free -g | head -2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for tree in "$BASE" "$HEAD"; do
  (cd "$tree" && python3 setup.py -q build_ext --inplace > "$OUT/build-$(basename "$tree").log" 2>&1 \
     && ln -sfn ../kernels pstar_fx/kernels && ln -sfn ../models pstar_fx/models) || { echo "build failed in $tree"; exit 1; }
  (cd "$tree" && PYTHONPATH="$tree" python3 -c "import pstar_fx, pstar_fx.kernels as k; print(pstar_fx.__file__, k.build_info()['cpu_adam']['simd'])")
done
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case "$stage" in
    tests*) k=${stage#tests}; k=${k#:}
       (cd "$HEAD" && PYTHONPATH="$HEAD" timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -rs -p no:logging --tb=short \
          -o faulthandler_timeout=100 tests/test_gpu.py ${k:+-k "$k"} --durations=10 2>&1 | tail -60 | tee -a "$OUT/tests.txt") ;;
    undo*) a=${stage#undo}; a=${a#:}
       (cd "$HEAD" && PYTHONPATH="$HEAD" timeout 200 python3 bench/host_undo_bench.py --json "$OUT/undo.json" \
          $(echo "$a" | tr , ' ') 2>&1 | tail -20 | tee -a "$OUT/undo.txt") ;;
    gpt:*) IFS=: read -r _ model system batch host layers extra <<< "$stage"
       for side in base head; do
         tree=$HEAD; [[ $side == base ]] && tree=$BASE
         echo "--- $side"
         (cd "$tree" && PYTHONPATH="$tree" timeout 420 python3 bench/gpt.py --model "$model" --system "$system" \
            --batch "${batch:-16}" --seq 1024 --steps "${STEPS:-6}" --host-memory "${host:-110GiB}" \
            ${layers:+--layers "$layers"} ${extra} --json "$OUT/$side.jsonl" \
            2> >(tee -a "$OUT/$side.log" | tail -8 >&2) | tail -6)
       done ;;
  esac
done
echo "=== done $(date +%T)"
