#!/usr/bin/env bash
# Creates .venv (if missing) with the CPU build of torch first, then patchload and its test extra.
# A bare `torch` requirement would pull a multi-GB CUDA build, hence the explicit first step.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
