#!/usr/bin/env bash
# Create .venv and install tune-recipes with the pinned CPU stack (idempotent).
#   bash scripts/install_cpu.sh
# torch is pinned to 2.13.0 here *before* anything else: an unpinned torch lets pip resolve
# a multi-GB CUDA build. On a GPU machine, install your CUDA torch (2.11-2.13) instead and
# then `pip install -e ".[dev]"`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first, and the hub/datasets/transformers trio at versions that agree: left to itself,
# pip backtracks through dozens of huggingface_hub releases before settling.
# --no-compile: no byte-compiling of every installed module (torch's alone took ~28 s of CPU on
# 2 cores, 2026-12-02); Python compiles the modules that are imported, once, on first import.
.venv/bin/python -m pip install -q --no-compile --disable-pip-version-check "torch==2.13.0" \
    "huggingface_hub>=0.30,<1.0" "datasets==3.6.0" "transformers==4.57.6"
.venv/bin/python -m pip install -q --no-compile --disable-pip-version-check -e ".[dev]"
.venv/bin/tune-recipes --version
