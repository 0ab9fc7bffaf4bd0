"""The `--check` step every goldens recipe shares: regenerate, compare hashes with the committed manifest.

Standard library only: recipes run in their oracle's own venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
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


def run_official_stage(oracle: Path, module: str, *args: str, cwd: Path) -> float:
    """Run `python -m <module> <args>` in the official environment's venv (`<oracle>/venv`), offline, one thread,
    without this venv's PYTHONPATH/VIRTUAL_ENV; return its wall seconds. A failing stage raises."""
    started = time.perf_counter()
    command = [str(oracle / "venv" / "bin" / "python"), "-m", module, *args]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    subprocess.run(command, cwd=cwd, env=env, check=True)
    return round(time.perf_counter() - started, 2)


def oracle_folder(oracle: Path | None, variable: str, setup_script: str) -> Path:
    """The oracle folder: `oracle` (from --oracle) or the `variable` environment variable, resolved; a clear
    exit when neither is set, naming the setup script that makes one."""
    if oracle is None:
        value = os.environ.get(variable)
        if not value:
            raise SystemExit(f"set {variable} (or --oracle) to a folder made by tools/goldens/{setup_script}")
        oracle = Path(value)
    return oracle.resolve()
