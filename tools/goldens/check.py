"""The `--check` step every goldens recipe shares: regenerate, compare hashes with the committed manifest.

Standard library only: recipes run in their oracle's own venv.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


def check_against_committed(manifest_path: Path, models: Iterable[str], generate: Callable[[Path], dict]) -> int:
    """Regenerate into a scratch folder with `generate(folder) -> manifest`; print each model's verdict and
    return the process exit code (1 when any golden differs from the committed one)."""
    committed = json.loads(manifest_path.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        manifest = generate(Path(tmp))
    bad = 0
    for name in models:
        want, got = committed["models"][name]["sha256"], manifest["models"][name]["sha256"]
        status = "identical" if want == got else "DIFFERENT"
        bad += want != got
        print(f"{name}: {status} (committed {want[:16]}, regenerated {got[:16]})")
    print(f"total {manifest['wall_seconds_total']}s")
    return 1 if bad else 0
