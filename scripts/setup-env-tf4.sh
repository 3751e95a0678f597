#!/usr/bin/env bash
# Creates .venv-tf4 (if missing): like setup-env.sh, but on the last transformers 4.x line
# (4.57.x), which pulls huggingface_hub 0.x (requests, not httpx). The test suite's `tf4`
# subset runs in it (see the Makefile's `test` target).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-tf4/bin/python ]; then
  "$PY" -m venv .venv-tf4
fi
.venv-tf4/bin/python -m pip install -q --upgrade pip
.venv-tf4/bin/python -m pip install -q "torch==2.13.0"
.venv-tf4/bin/python -m pip install -q -e ".[test-core]" "transformers>=4.57,<5"
