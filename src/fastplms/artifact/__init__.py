"""Hub artifacts: build, verify, publish and model cards (source package; never shipped)."""
