"""Golden-output recipes for oracles that cannot share the main venv (see README.md here)."""
