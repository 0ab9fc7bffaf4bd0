"""Engines that cannot share the main venv (esm-cpp: numpy<2; the official ESMC: its own pins) live in
side venvs created by a setup script on first use. Not a runtime module."""

from __future__ import annotations

import subprocess
from pathlib import Path


def side_venv(python: Path, setup: Path, probe: str, setup_timeout: float) -> dict:
    """Run `setup` if `python` is missing, then `python -c probe`: {"available": True, "stdout": ...},
    or {"available": False, "error": ...} with the exact error of whichever step failed."""
    if not python.exists():
        done = subprocess.run(["bash", str(setup)], capture_output=True, text=True, timeout=setup_timeout)
        if done.returncode != 0:
            return {"available": False, "error": (done.stderr or done.stdout)[-2000:]}
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return {"available": False, "error": done.stderr[-2000:]}
    return {"available": True, "stdout": done.stdout.strip()}
