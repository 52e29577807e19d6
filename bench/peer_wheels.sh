#!/usr/bin/env bash
# Wheels for the peers the H200 box lacks, into .whl/ (git-ignored), to carry with the device tool:
#   run(command="python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
#                export PYTHONPATH=/tmp/site && python3 bench/gpt.py --system deepspeed ...", carry=[".whl"])
# DeepSpeed ships as source only: it is built here as a pure-Python wheel with DS_BUILD_OPS=0 (its ops are
# JIT-built there when used; ZeRO-3 offload's CPU Adam is one of them, so that box needs nvcc/ninja, which
# it has). Its dependencies missing on the box are fetched for CPython 3.12, manylinux x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
DS_VERSION=${DS_VERSION:-0.19.8}     # the version measured in shared/reference/h200.md
OUTDIR=.whl
mkdir -p "$OUTDIR"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "deepspeed==$DS_VERSION" -d "$tmp"
tar xzf "$tmp"/deepspeed-*.tar.gz -C "$tmp"
PY=${PYTHON:-.venv/bin/python}       # needs torch importable: DeepSpeed's setup.py reads it
(cd "$tmp"/deepspeed-"$DS_VERSION" && DS_BUILD_OPS=0 "$OLDPWD/$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OLDPWD/$OUTDIR" .)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$OUTDIR" hjson pydantic pydantic-core annotated-types typing-inspection "typing-extensions>=4.16.0"
ls -la "$OUTDIR"
du -sh "$OUTDIR"
