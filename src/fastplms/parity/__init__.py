"""Parity against the official implementations: metrics and the generic driver (never shipped)."""
