#!/usr/bin/env bash
# Predicted vs torch.cuda.max_memory_allocated of plans run by the executor (profiling.run), < 5 min.
#
#   scripts/validate_cuda.sh [OUT_DIR] [extra args of scripts/validate_cuda.py]
#
# Needs the project installed with its profiling extra (python3 -m venv .venv &&
# .venv/bin/pip install -e ".[profiling]") or, on an offline machine that has torch, PYTHON set to
# an interpreter that can import torch, numpy, networkx, jsonschema and pulp (ortools optional:
# pipeline plans of a GPT are chains, solved by the exact chain algorithm).
# Writes OUT_DIR/validate_cuda.json and .md (default out/validate_cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${1:-out/validate_cuda}
shift || true
exec timeout 290 "$PYTHON" scripts/validate_cuda.py --out "$OUT" "$@"
