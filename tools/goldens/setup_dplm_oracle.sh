#!/usr/bin/env bash
# Make the DPLM (bytedance/dplm, ByProt) oracle folder used by tools/goldens/dplm.py, OUTSIDE this repository:
#   <dest>/tree/       the official bytedance/dplm tree at the pinned commit (git archive)
#   <dest>/site/       omegaconf==2.3.0 + antlr4-python3-runtime==4.9.3 (the only packages the official
#                      sampler, src/byprot/models/dplm/dplm.py, needs beyond the project venv)
#   <dest>/DPLM_COMMIT the commit the tree was extracted from
# Usage: setup_dplm_oracle.sh <dest> [<dplm git dir, bare or not, or a clone URL>]
# Idempotent: a folder already at the commit is kept. The official code is never copied into this
# repository; this script and the recipe refuse a <dest> inside it.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=tools/goldens/official_tree.sh
source "$REPO_ROOT/tools/goldens/official_tree.sh"
COMMIT=8b3425b7b7134aaf931baa5c53e0328da6a48a1f
DEST="${1:?usage: setup_dplm_oracle.sh <dest> [<dplm git dir or clone URL>]}"
SOURCE="${2:-https://github.com/bytedance/dplm.git}"
PYTHON="${PYTHON:-$REPO_ROOT/.venv/bin/python}"

DEST="$(outside_repo "$DEST")"  # checked before anything is created
mkdir -p "$DEST"

# Only src/ (the byprot package) and the generation CLI are needed; vendor/ (openfold) and the rest are not.
official_tree "$DEST" "$SOURCE" "$COMMIT" DPLM_COMMIT src generate_dplm.py

if [ ! -f "$DEST/site/omegaconf/__init__.py" ] || [ ! -d "$DEST/site/antlr4" ]; then
    "$PYTHON" -m pip install --disable-pip-version-check --quiet --no-deps --target "$DEST/site" \
        omegaconf==2.3.0 antlr4-python3-runtime==4.9.3
fi

# Smoke test: the official sampler imports through the recipe's namespace shim in the project venv.
cd "$REPO_ROOT"
"$PYTHON" - "$DEST" <<'PY'
import sys
from pathlib import Path

from tools.goldens.dplm import import_official_sampler

cls = import_official_sampler(Path(sys.argv[1]))
import omegaconf

print(f"DPLM oracle ready: {cls.__module__}.{cls.__name__}; omegaconf {omegaconf.__version__}")
PY
echo "export FASTPLMS_DPLM_ORACLE=$DEST"
