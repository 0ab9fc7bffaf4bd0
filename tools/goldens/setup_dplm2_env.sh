#!/usr/bin/env bash
# Make the "fully official" DPLM2 oracle folder used by tools/goldens/dplm2.py, OUTSIDE this repository:
#   <dest>/tree/         bytedance/dplm at the pinned commit (git archive of src/, generate_dplm2.py,
#                        generate_dplm.py, README.md, LICENSE; no vendor/openfold, no data)
#   <dest>/venv/         Python 3.11 venv with the DPLM pin's network stack on torch 2.13 CPU:
#                        transformers 4.39.2, tokenizers 0.15.2, huggingface_hub 0.23.5 (+ requests, urllib3,
#                        charset_normalizer), omegaconf 2.3.0, antlr4-python3-runtime 4.9.3, safetensors, numpy
#   <dest>/DPLM_COMMIT   the commit the tree was extracted from
# Usage: setup_dplm2_env.sh <dest> [<dplm git dir, bare or not, or a clone URL>]
# Idempotent: a tree already at the commit is kept and pip re-checks only. Nothing of ByProt is installed:
# the recipe imports the two modules it needs (wrapper and network) from <dest>/tree/src through an import
# shim (see tools/goldens/dplm2.py). The official code is never copied into this repository.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=tools/goldens/official_tree.sh
source "$REPO_ROOT/tools/goldens/official_tree.sh"
COMMIT=8b3425b7b7134aaf931baa5c53e0328da6a48a1f
DEST="${1:?usage: setup_dplm2_env.sh <dest> [<dplm git dir or clone URL>]}"
SOURCE="${2:-https://github.com/bytedance/dplm.git}"
PYTHON="${PYTHON:-python3.11}"

DEST="$(outside_repo "$DEST")"  # checked before anything is created
mkdir -p "$DEST"

official_tree "$DEST" "$SOURCE" "$COMMIT" DPLM_COMMIT src generate_dplm2.py generate_dplm.py README.md LICENSE

if [ ! -x "$DEST/venv/bin/python" ]; then
    "$PYTHON" -m venv "$DEST/venv"
fi
PIP=("$DEST/venv/bin/python" -m pip install --disable-pip-version-check --quiet)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" transformers==4.39.2 tokenizers==0.15.2 huggingface_hub==0.23.5 requests urllib3 charset_normalizer \
    omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 safetensors numpy==2.4.6

# Smoke test: the packages the two official modules need import offline.
HF_HUB_OFFLINE=1 "$DEST/venv/bin/python" - <<'PY'
import importlib.metadata as md
import omegaconf, torch, transformers  # noqa: E401,F401
from transformers.models.esm.modeling_esm import EsmForMaskedLM  # noqa: F401
print("dplm2 oracle env ready:", {n: md.version(n) for n in ("torch", "transformers", "tokenizers", "omegaconf")})
PY
echo "export FASTPLMS_DPLM2_ORACLE=$DEST"
