#!/usr/bin/env bash
# Make the Profluent E1 oracle folder used by tools/goldens/e1.py, OUTSIDE this repository:
#   <dest>/tree/     the official Profluent-AI/E1 tree at the pinned commit (git archive; src/E1/ with
#                    tokenizer.json beside tokenizer.py, as E1Config() needs)
#   <dest>/site/     einops==0.8.1 (the only package the official code needs beyond the project venv)
#   <dest>/E1_COMMIT the commit the tree was extracted from
# Usage: setup_e1_oracle.sh <dest> [<E1 git dir, bare or not, or a clone URL>]
# Idempotent: a folder already at the commit is kept. The official code is never copied into this
# repository; this script and the recipe refuse a <dest> inside it.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=tools/goldens/official_tree.sh
source "$REPO_ROOT/tools/goldens/official_tree.sh"
COMMIT=219c7c7a3a803b8552ae6a44ce6dd24f133fefbd
DEST="${1:?usage: setup_e1_oracle.sh <dest> [<E1 git dir or clone URL>]}"
SOURCE="${2:-https://github.com/Profluent-AI/E1.git}"
PYTHON="${PYTHON:-$REPO_ROOT/.venv/bin/python}"

DEST="$(outside_repo "$DEST")"  # checked before anything is created
mkdir -p "$DEST"

official_tree "$DEST" "$SOURCE" "$COMMIT" E1_COMMIT

if [ ! -f "$DEST/site/einops/__init__.py" ]; then
    "$PYTHON" -m pip install --disable-pip-version-check --quiet --no-deps --target "$DEST/site" einops==0.8.1
fi

# Smoke test: the official model code imports offline in the project venv.
HF_HUB_OFFLINE=1 PYTHONPATH="$DEST/tree/src:$DEST/site" "$PYTHON" - <<'PY' 2>/dev/null
from E1.config import E1Config  # noqa: F401
from E1.modeling import E1ForMaskedLM  # noqa: F401
import einops
print("E1 oracle ready; einops", einops.__version__)
PY
echo "export FASTPLMS_E1_ORACLE=$DEST"
