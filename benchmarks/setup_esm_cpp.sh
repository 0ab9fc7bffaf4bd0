#!/usr/bin/env bash
# Create (or refresh) .venv-esmcpp: esm-cpp (a C++ CPU engine for ESM2) in its own venv, because it
# needs numpy<2 while the main stack does not. Idempotent; used only by `python -m benchmarks.embed`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv-esmcpp
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.fastplms-setup"
want=$(sha256sum benchmarks/setup_esm_cpp.sh | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$VENV/bin/python" -m pip install -q "esm-cpp==0.2.1" "numpy<2"
"$VENV/bin/python" -c "import esm_cpp; print('esm-cpp', esm_cpp.__version__, esm_cpp.current_isa())"
echo "$want" > "$stamp"
