#!/usr/bin/env bash
# Create (or refresh) the ESMC oracle venv at <repo>/.venv-esmc. Idempotent: re-running is a no-op
# apart from pip's "already satisfied" checks. The oracle package (EvolutionaryScale `esm`) is never
# vendored into this repository; only its outputs (tests/goldens/esmc_*.safetensors) are committed.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${ESMC_VENV:-$REPO_ROOT/.venv-esmc}"
PYTHON="${PYTHON:-python3.11}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

"${PIP[@]}" torch==2.13.0
# esm 3.2.1.post1 pins older torch/transformers; install it without dependencies and add what it imports.
"${PIP[@]}" --no-deps esm==3.2.1.post1
"${PIP[@]}" transformers==5.13.1 einops attrs zstd cloudpathlib tenacity pandas scipy biotite brotli \
    msgpack-numpy biopython numpy safetensors

# Smoke test: the official constructor and tokenizer import.
"$VENV/bin/python" - <<'PY'
import esm
from esm.models.esmc import ESMC  # noqa: F401
from esm.tokenization import EsmSequenceTokenizer  # noqa: F401
print("esm oracle venv ready:", getattr(esm, "__version__", "?"))
PY
