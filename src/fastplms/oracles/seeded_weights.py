"""Seeded, framework-independent weight generator for parity checkpoints.

The same (seed, key, shape, kind, std) always yields the same float32 bytes, on any machine, so our
checkpoints and the oracle checkpoints (Transformers, fair-esm, EvolutionaryScale esm in another venv)
can be built from identical numbers without ever shipping weight files around.

This module imports only numpy and the standard library on purpose: other virtual environments load it by
file path (``importlib.util.spec_from_file_location``) without needing torch or fastplms installed.

Reproducibility rests on two stable pieces: sha256 (to turn ``f"{seed}:{key}"`` into generator entropy)
and numpy's ``PCG64`` bit generator seeded through ``SeedSequence`` with ``standard_normal``/``random``
drawn in float64. ``tests/test_seeded_weights.py`` pins a few golden values so a numpy change that alters
the stream is caught rather than silently producing different "reference" checkpoints.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping

import numpy as np

__all__ = ["KINDS", "Rule", "default_rule", "seeded_state_dict", "seeded_tensor"]

# "zeros_jitter" is numerically identical to "normal"; it exists so rules can say what a tensor *is*
# (a bias that would be zero-initialised in training) without changing the numbers.
KINDS = ("normal", "ones_jitter", "zeros_jitter", "uniform")

Rule = Callable[[str, tuple[int, ...]], tuple[str, float]]

# Suffixes named as LayerNorm-style scale parameters; matched on the whole key ending.
_NORM_WEIGHT_SUFFIXES = ("LayerNorm.weight", "layer_norm.weight", "norm.weight", "ln.weight")


def _generator(seed: int, key: str) -> np.random.Generator:
    # Hash instead of Python's hash() (salted per process) so the stream is stable across runs/machines.
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    entropy = int.from_bytes(digest, "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def _check_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    out = tuple(int(d) for d in shape)
    if any(d < 0 for d in out):
        raise ValueError(f"negative dimension in shape {shape}")
    return out


def seeded_tensor(
    key: str, shape: tuple[int, ...], *, seed: int = 0, kind: str = "normal", std: float = 0.02
) -> np.ndarray:
    """Return a float32 array that depends only on (seed, key, shape, kind, std).

    kinds:
      - ``normal``: ``std * N(0, 1)``.
      - ``zeros_jitter``: same numbers as ``normal``; use it for biases to document intent.
      - ``ones_jitter``: ``1 + std * N(0, 1)``, for LayerNorm scales (a plain normal would flip signs).
      - ``uniform``: uniform on ``[-a, a)`` with ``a = std * sqrt(3)``, so ``std`` is the real standard
        deviation for every kind.
    """
    shape = _check_shape(shape)
    rng = _generator(seed, key)
    # Draw in float64 and cast once: float64 streams are the ones numpy keeps stable, and the cast is exact
    # rounding, so the float32 bytes are reproducible.
    if kind in ("normal", "zeros_jitter"):
        values = std * rng.standard_normal(shape, dtype=np.float64)
    elif kind == "ones_jitter":
        values = 1.0 + std * rng.standard_normal(shape, dtype=np.float64)
    elif kind == "uniform":
        half_width = std * math.sqrt(3.0)
        values = half_width * (2.0 * rng.random(shape, dtype=np.float64) - 1.0)
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    return np.ascontiguousarray(values, dtype=np.float32)


def default_rule(key: str, shape: tuple[int, ...]) -> tuple[str, float]:
    """Choose (kind, std) from the parameter name.

    - rotary ``inv_freq`` buffers: raise. They are a formula, not weights; callers leave them out of the
      spec (or pass them via ``seeded_state_dict(fixed=...)``) filled with the real rotary formula.
    - LayerNorm-style scales (``LayerNorm.weight``, ``layer_norm.weight``, ``*_layer_norm.weight``,
      ``norm.weight``, ``ln.weight``, ``.gamma``): ``ones_jitter`` with std 0.1, so the norm stays close to
      identity while still exercising the scale.
    - biases (``*bias``, ``.beta``): ``zeros_jitter`` with std 0.02 (numerically a normal).
    - everything else (linear weights, embeddings): ``normal`` with std 0.02.
    """
    del shape  # the default rule is name-based; custom rules may use the shape (e.g. fan-in scaling)
    if key.endswith("inv_freq"):
        raise ValueError(
            f"{key!r} is a rotary inv_freq buffer: compute it with the model's formula and pass it via "
            "`fixed=` (or leave it out of the spec) instead of drawing random numbers"
        )
    if key.endswith(_NORM_WEIGHT_SUFFIXES) or key.endswith(".gamma") or key == "gamma":
        return "ones_jitter", 0.1
    if key.endswith("bias") or key.endswith(".beta") or key == "beta":
        return "zeros_jitter", 0.02
    return "normal", 0.02


def seeded_state_dict(
    spec: Mapping[str, tuple[int, ...]],
    *,
    seed: int = 0,
    rules: Rule | None = None,
    fixed: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Generate one float32 array per key of ``spec`` (key -> shape), in ``spec`` order.

    Each tensor is drawn from its own key-derived stream, so the result does not depend on the order of
    ``spec`` or on which other keys are present. ``rules(key, shape) -> (kind, std)`` replaces
    ``default_rule``. ``fixed`` supplies non-random tensors (e.g. rotary ``inv_freq``); their shapes must
    match the spec and they are returned as float32 copies.
    """
    rule = rules if rules is not None else default_rule
    fixed = fixed or {}
    unknown = set(fixed) - set(spec)
    if unknown:
        raise ValueError(f"fixed tensors not in spec: {sorted(unknown)}")
    out: dict[str, np.ndarray] = {}
    for key, raw_shape in spec.items():
        shape = _check_shape(raw_shape)
        if key in fixed:
            value = np.array(fixed[key], dtype=np.float32)
            if value.shape != shape:
                raise ValueError(f"fixed tensor {key!r} has shape {value.shape}, spec says {shape}")
            out[key] = value
            continue
        kind, std = rule(key, shape)
        out[key] = seeded_tensor(key, shape, seed=seed, kind=kind, std=std)
    return out
