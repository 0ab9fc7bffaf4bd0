"""State transforms from official checkpoint layouts to ours, one module per family (never shipped)."""
