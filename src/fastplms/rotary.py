"""Rotary position embedding (rotate-half), shared by every family that uses it.

Runtime module (ships inside artifacts; imports torch only). Three steps, each a function so that a family
composes them in its own dtype order (ESM2 rotates a pre-scaled float32 q and casts afterwards; ESMC casts
the tables to the q dtype first):

- `inverse_frequencies(head_dim, theta)`: the float32 frequencies, from a formula rather than a buffer, so
  nothing is left uninitialized when Transformers materializes a model without its non-persistent buffers;
- `rotary_tables(positions, inv_freq)`: cos and sin for any integer position tensor (a packed row index,
  a gathered position id, split positions), to be indexed or cast by the caller;
- `apply_rotary(x, cos, sin)`: rotate-half on (..., heads, head_dim) tensors, packed (tokens, heads,
  head_dim) in our models.
"""

from __future__ import annotations

import torch


def inverse_frequencies(head_dim: int, theta: float, *, negative_power: bool = False) -> torch.Tensor:
    """float32 (head_dim // 2,) inverse frequencies theta^(-2i / head_dim).

    Computed on the CPU (`rotary_tables` moves them), so every device sees the same bits, as the official
    models, which build them once on the CPU and move them with the model. The two spellings of the same
    number round differently in the last bit, so each family uses its official one: `1 / theta**e` (ESM2,
    ESMC) or, with `negative_power`, `theta**-e` (E1).
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return theta**-exponent if negative_power else 1.0 / theta**exponent


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin of shape (*positions.shape, 1, head_dim) for integer `positions`.

    The singleton axis broadcasts over heads. Both halves of the last axis repeat the same angles, which
    is the layout `apply_rotary`'s rotate-half expects.
    """
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    angles = torch.cat((freqs, freqs), dim=-1)[..., None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of `x` (..., heads, head_dim) by tables that broadcast to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
