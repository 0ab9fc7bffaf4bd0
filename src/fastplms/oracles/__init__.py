"""Official-layout checkpoints with seeded weights, and the code that runs the official oracles (never shipped)."""
