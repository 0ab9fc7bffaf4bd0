"""Scripts run in a fresh offline interpreter where fastplms is unimportable, as a user loads an artifact.

A helper module of the artifact tests (imported as ``fresh_process``: pytest puts ``tests/`` on ``sys.path``).
The preamble and the environment are ``fastplms.artifact.verify``'s, so ``fastplms verify`` and the tests load
artifacts the same way.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fastplms.artifact.verify import NO_FASTPLMS, offline_env

__all__ = ["NO_FASTPLMS", "offline_env", "run_fresh"]


def run_fresh(script: str, *args: object, tmp_path: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Run ``NO_FASTPLMS + script`` with ``args`` (as strings) in ``tmp_path``, offline (``offline_env``,
    remote code cached in ``tmp_path``), and return the finished process after checking it exited 0."""
    result = subprocess.run(
        [sys.executable, "-c", NO_FASTPLMS + script, *map(str, args)],
        env=offline_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result
