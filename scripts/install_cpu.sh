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
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" \
    "huggingface_hub>=0.30,<1.0" "datasets==3.6.0" "transformers==4.57.6"
# NOTE: keep pip's byte-compiling. --no-compile makes CI slower, not faster: where
# PYTHONDONTWRITEBYTECODE is set (as on our CPU machines) nothing writes the .pyc files later, so
# every test process compiles torch's modules from source again.
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
.venv/bin/tune-recipes --version
