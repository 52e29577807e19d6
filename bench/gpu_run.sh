#!/usr/bin/env bash
# One device call on the H200 machine: build the C++ kernel there, then run the stages named as
# arguments (kernels | limits[:ARGS] | host_undo[:ARGS] | plan_profile[:ARGS] | pinned[:ARGS] | host_adam[:ARGS] (bench/host_adam_bench.py ARGS, spaces as commas) | tests | tests:PYTEST_K_EXPR (tests/test_gpu.py only) | integrations | hf_trainer[:ARGS] | lora[:ARGS] | probe | small_peak | checkpoint | gpt:MODEL:SYSTEM[:BATCH[:HOST_MEMORY[:LAYERS[:EXTRA ARGS]]]]).
# Output files land in $OUT. MODEL: a GPT name, llama/NAME or hf-llama/NAME (bench/gpt.py --model).
# EXTRA ARGS go to bench/gpt.py as they are, e.g. gpt:GPT3_10B:pstar_fx:16:108GiB::--clip-sweep=none,1e9,1e-3
# The strongest PyTorch peer: gpt:GPT_h3072_L36:torch-best:16 ({eager, compiled} x checkpoint {none, half, all}).
# STEPS (default 6) sets the training steps of each gpt stage.
# Rows planned for the H200's 139 GiB (GPT3_18B and deeper at 110 GiB of host) need that card: the device tool's run
#   with needs_h200 set (a call naming nvidia-h200 without it may be given an H100, where they stop at a BudgetError).
# hf_trainer[:ARGS]: bench/hf_trainer_bench.py ARGS (spaces as commas): PstarTrainer against the engine's own loop,
#   by default HF LlamaForCausalLM at Llama-3-8B's shape, bf16, 16 x 1024, 20 steps, host 110GiB, each side in a
#   subprocess of its own; one line per side (tokens/s, ratio) appended to $OUT/hf_trainer.jsonl. HF_TRAINER_S
#   (default 540) is the seconds both sides may take together (a side cut off is reported as such).
# lora[:ARGS]: bench/lora_bench.py ARGS (spaces as commas): peft LoRA r=16 on HF LlamaForCausalLM at Llama-3-70B's
#   shape, pstar_fx against peft under FSDP2 + CPUOffloadPolicy at the deepest shape whose weights fit the host (issue
#   25); each side a subprocess, LORA_S (default 560) seconds for both; lines appended to $OUT/lora.jsonl.
# limits[:ARGS]: bench/box_limits.py ARGS (spaces as commas): the box's measured limits (copies each way and both
#   ways, device memory, matmul, host triad, host Adam alone and beside copies, pstar_fx's calibration) as one
#   versioned record, $OUT/limits.json: run it in the same call as the rows it is read against (issue 27).
# host_undo[:ARGS]: bench/host_undo_bench.py ARGS (spaces as commas): the host correction, and its 16-bit copy alone,
#   against the host Adam on the same buffers (e.g. host_undo:--elems,256M,--threads,15: the stage's commas become
#   spaces, so one thread count a stage); $OUT/host_undo.json.
# pinned[:ARGS]: bench/pinned_alloc.py ARGS (spaces as commas): page-locking the host state's buffers, each way
#   (e.g. pinned:--gib,100,--threads,4,16,--slab-gib,16,--huge-pages); RESULT lines in $OUT/pinned.txt.
# plan_profile[:ARGS]: bench/plan_profile.py ARGS (spaces as commas): capture + plan of a meta-built model on this
#   host under cProfile (no GPU used; e.g. plan_profile:--model,hf-llama/Llama3_70B,--lora,16); $OUT/plan.prof.
# env:NAME=VALUE: exported for the stages after it (e.g. env:PSTAR_FX_RESERVE_CACHE=0 gpt:... env:PSTAR_FX_RESERVE_CACHE=1).
# integrations: the GPU tests of PstarTrainer and the Lightning strategy (tests/test_integrations_*.py -m gpu).
# Wheels in .whl/ (bench/peer_wheels.sh: DeepSpeed and what it needs) are installed first when carried:
#   run(command="bash bench/gpu_run.sh gpt:GPT_h3072_L36:deepspeed", carry=[".whl"])
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TORCH_CUDA_ARCH_LIST=9.0 DS_BUILD_OPS=0      # DeepSpeed JIT-builds its CPU Adam for this GPU only
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L; nproc; free -g | head -2; echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
lscpu | grep -iE "^(NUMA node|Socket|Model name|Thread)" | tr -s " "
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
t0=$(date +%s.%N)
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
echo "installed in $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s (the C++ CPU Adam built)"
# The box's packages come without bytecode and PYTHONDONTWRITEBYTECODE=1 is set: every process compiled torch's
# modules from source at each import (10.5-11.8 s to import torch and Inductor; a build worker's start, and the
# capture's first Dynamo import, session 30). pip writes them at install; written here once per box, as pip would.
# (compileall's own process pool lost a worker on an H100 box, session 31, and wrote nothing: batches of files in
# processes of their own, 16 at once, so a file that crashes the compiler costs only its batch)
t0=$(date +%s.%N)
python3 -c "
import importlib.util, os
for name in ('torch', 'triton', 'sympy', 'transformers', 'pstar_fx'):
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin:
        print(os.path.dirname(spec.origin))" | while read -r d; do find "$d" -name "*.py"; done \
  | xargs -r -P 16 -n 200 python3 -m compileall -q > /tmp/compileall.log 2>&1
took=$(python3 -c "print(round($(date +%s.%N) - $t0, 1))")
cached=$(python3 -c "import os, torch; print(len(os.listdir(os.path.join(os.path.dirname(torch.__file__), '__pycache__'))))")
echo "bytecode written in $took s ($(grep -c . /tmp/compileall.log) lines of complaints; $cached files in torch/__pycache__)"
# (torch's first import after its bytecode is written: about 10 s less than before it)
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "import pstar_fx.kernels as k; print(k.build_info())"
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case "$stage" in
    small_peak*) timeout 200 python3 bench/small_peak.py --snapshot "$OUT" ${stage#small_peak} 2>&1 | grep -v "^DEBUG" | tail -30 | tee -a "$OUT/small_peak.txt" ;;
    checkpoint) timeout 400 python3 bench/checkpoint_bench.py --json "$OUT/checkpoint.jsonl" 2>&1 | tail -30 | tee -a "$OUT/checkpoint.txt" ;;
    plan_profile*) timeout 400 python3 bench/plan_profile.py --out "$OUT" --top 30 \
             $( [[ $stage == plan_profile:* ]] && echo "${stage#plan_profile:}" | tr , ' ') 2>&1 | grep -v "^DEBUG" \
             | tail -90 | tee -a "$OUT/plan_profile.txt" ;;
    pinned*) timeout 300 python3 bench/pinned_alloc.py $( [[ $stage == pinned:* ]] && echo "${stage#pinned:}" | tr , ' ') \
             2>&1 | tee -a "$OUT/pinned.txt" ;;
    limits*) timeout 300 python3 bench/box_limits.py --json "$OUT/limits.json" \
             $( [[ $stage == limits:* ]] && echo "${stage#limits:}" | tr , ' ') 2>&1 | grep -v "^RESULT" \
             | tee -a "$OUT/limits.txt" ;;
    probe) timeout 120 python3 bench/peak_probe.py 2>&1 | grep -v "^DEBUG" | tail -45 | tee -a "$OUT/probe.txt" ;;
    host_undo*) timeout 240 python3 bench/host_undo_bench.py --json "$OUT/host_undo.json" \
             $( [[ $stage == host_undo:* ]] && echo "${stage#host_undo:}" | tr , ' ') 2>&1 | tee -a "$OUT/host_undo.txt" ;;
    host_adam*) runs=$((${runs:-0} + 1))      # one JSON per stage: a second stage would overwrite the first
       timeout 240 python3 bench/host_adam_bench.py --json "$OUT/host_adam-$runs.json" \
             $( [[ $stage == host_adam:* ]] && echo "${stage#host_adam:}" | tr , ' ') 2>&1 | tee -a "$OUT/host_adam.txt" ;;
    integrations) timeout 300 python3 -m pytest -q -rs -p no:logging --tb=short -o faulthandler_timeout=100 -m gpu \
             tests/test_integrations_transformers.py tests/test_integrations_lightning.py --durations=10 2>&1 \
             | tail -60 | tee -a "$OUT/tests.txt" ;;
    hf_trainer*) limit=${HF_TRAINER_S:-540}
       timeout $((limit + 20)) python3 bench/hf_trainer_bench.py --timeout "$limit" --json "$OUT/hf_trainer.jsonl" \
             $( [[ $stage == hf_trainer:* ]] && echo "${stage#hf_trainer:}" | tr , ' ') \
             2> >(tee -a "$OUT/hf_trainer.log" | grep -v "^  " | tail -60 >&2) | grep -v "^RESULT" | tail -20 ;;
    lora*) timeout $(( ${LORA_S:-560} + 20 )) python3 bench/lora_bench.py --timeout "${LORA_S:-560}" --json "$OUT/lora.jsonl" \
             $( [[ $stage == lora:* ]] && echo "${stage#lora:}" | tr , ' ') 2> >(tee -a "$OUT/lora.log" | grep -E "step |Error" \
             | tail -30 >&2) | cut -c1-600 ;;
    env:*) export "${stage#env:}" ;;      # env:NAME=VALUE: set for the stages after it
    kernels) timeout 240 python3 bench/kernels_gpu.py 2>&1 | tee -a "$OUT/kernels.txt" ;;
    tests) timeout 560 python3 -m pytest -q -rs -p no:logging --tb=short -o faulthandler_timeout=100 tests/test_gpu.py \
             tests/test_kernels.py -k "gpu or cuda or undo" --durations=15 2>&1 | tail -80 | tee -a "$OUT/tests.txt" ;;
    tests:*) timeout ${TESTS_S:-560} python3 -m pytest -q -rs -p no:logging --tb=short -o faulthandler_timeout=100 tests/test_gpu.py \
             -k "${stage#tests:}" --durations=15 2>&1 | tail -80 | tee -a "$OUT/tests.txt" ;;
    gpt:*) IFS=: read -r _ model system batch host layers extra <<< "$stage"
       limit=420; [[ $system == torch-best ]] && limit=580   # six configurations; gpt.py stops itself at --sweep-timeout
       timeout $limit python3 bench/gpt.py --model "$model" --system "$system" --batch "${batch:-16}" --seq 1024 \
         --steps "${STEPS:-6}" --host-memory "${host:-110GiB}" ${layers:+--layers "$layers"} ${extra} --dump-after 300 \
         --json "$OUT/gpt.jsonl" \
         2> >(tee -a "$OUT/gpt.log" | tail -40 >&2) ;;
  esac
done
echo "=== done $(date +%T)"
