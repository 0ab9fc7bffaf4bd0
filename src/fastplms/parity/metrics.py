"""Parity metrics shared by tests, reports and docs.

Every metric compares ``ours`` against ``ref`` over VALID positions only: tensors are ``(batch, seq, ...)``
and ``valid`` is a ``(batch, seq)`` mask (``None`` = everything valid). Padding rows hold whatever a
kernel happened to write there, so including them would make the numbers meaningless in both directions.

All arithmetic is float64 so the metric itself adds no error on top of the bf16/fp32 differences being
measured. NaNs at valid positions are propagated (the metric becomes NaN and any ``<=`` threshold fails)
instead of being sorted or averaged away.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "jensen_shannon",
    "max_abs",
    "parity_report",
    "pooled_cosine",
    "relative_l2",
    "relative_q999",
    "residue_cosine_p1",
    "top1_agreement",
]


def _valid_mask(ours: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    if ours.shape != ref.shape:
        raise ValueError(f"shape mismatch: ours {tuple(ours.shape)} vs ref {tuple(ref.shape)}")
    if ours.dim() < 2:
        raise ValueError(f"expected (batch, seq, ...) tensors, got shape {tuple(ours.shape)}")
    if valid is None:
        return torch.ones(ours.shape[:2], dtype=torch.bool, device=ours.device)
    if valid.shape != ours.shape[:2]:
        raise ValueError(f"valid has shape {tuple(valid.shape)}, expected {tuple(ours.shape[:2])}")
    if valid.is_floating_point() or valid.is_complex():
        raise ValueError("valid must be a bool (or 0/1 integer) mask")
    valid = valid.to(device=ours.device, dtype=torch.bool)
    if not bool(valid.any()):
        raise ValueError("valid selects no positions")
    return valid


def _select(ours: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the valid positions as ``(n_valid, ...)`` float64 tensors."""
    mask = _valid_mask(ours, ref, valid)
    ref = ref.to(ours.device)
    return ours[mask].to(torch.float64), ref[mask].to(torch.float64)


def _quantile(x: torch.Tensor, q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of all elements.

    ``torch.quantile`` refuses inputs above 2**24 elements, which full hidden states of large models exceed,
    so this uses two ``kthvalue`` calls instead.
    """
    flat = x.reshape(-1)
    if bool(torch.isnan(flat).any()):
        return math.nan
    position = q * (flat.numel() - 1)
    lower = math.floor(position)
    upper = min(lower + 1, flat.numel() - 1)
    low_value = float(torch.kthvalue(flat, lower + 1).values)
    high_value = float(torch.kthvalue(flat, upper + 1).values)
    return low_value + (high_value - low_value) * (position - lower)


def _ratio(numerator: float, denominator: float) -> float:
    # A zero reference only matches a zero difference; anything else is infinitely wrong, not NaN.
    if denominator == 0.0:
        return 0.0 if numerator == 0.0 else math.inf
    return numerator / denominator


def _cosine_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine of ``(n, d)`` tensors, with cos(0, 0) = 1 and cos(0, x != 0) = 0."""
    norm_a = a.norm(dim=-1)
    norm_b = b.norm(dim=-1)
    denom = norm_a * norm_b
    cos = (a * b).sum(dim=-1) / torch.where(denom > 0, denom, torch.ones_like(denom))
    both_zero = (norm_a == 0) & (norm_b == 0)
    return torch.where(both_zero, torch.ones_like(cos), cos)


def _require_vectors(ours: torch.Tensor, name: str) -> None:
    if ours.dim() < 3:
        raise ValueError(f"{name} needs (batch, seq, ..., dim) tensors, got shape {tuple(ours.shape)}")


def max_abs(ours: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """Largest absolute difference over valid positions."""
    a, b = _select(ours, ref, valid)
    return float((a - b).abs().max())


def relative_l2(ours: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """``||ours - ref|| / ||ref||`` (Frobenius norm over all valid elements)."""
    a, b = _select(ours, ref, valid)
    return _ratio(float((a - b).norm()), float(b.norm()))


def relative_q999(ours: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """99.9th percentile of ``|ours - ref|`` divided by the 99.9th percentile of ``|ref|``.

    Unlike max_abs this ignores a handful of outlier elements, and unlike relative_l2 it is not dominated
    by the bulk of near-zero activations.
    """
    a, b = _select(ours, ref, valid)
    return _ratio(_quantile((a - b).abs(), 0.999), _quantile(b.abs(), 0.999))


def residue_cosine_p1(ours: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """1st percentile, over valid residues, of the cosine between ours and ref along the last dim."""
    _require_vectors(ours, "residue_cosine_p1")
    a, b = _select(ours, ref, valid)
    cos = _cosine_rows(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))
    return _quantile(cos, 0.01)


def pooled_cosine(ours: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """Worst (minimum) cosine, over sequences, between mean-pooled valid-residue vectors."""
    _require_vectors(ours, "pooled_cosine")
    mask = _valid_mask(ours, ref, valid)
    pooled_a, pooled_b = [], []
    for row in range(ours.shape[0]):
        if not bool(mask[row].any()):
            continue  # a sequence with no valid residue has no embedding to compare
        pooled_a.append(ours[row][mask[row]].to(torch.float64).mean(dim=0).reshape(-1))
        pooled_b.append(ref[row].to(ours.device)[mask[row]].to(torch.float64).mean(dim=0).reshape(-1))
    cos = _cosine_rows(torch.stack(pooled_a), torch.stack(pooled_b))
    if bool(torch.isnan(cos).any()):
        return math.nan
    return float(cos.min())


def top1_agreement(
    ours_logits: torch.Tensor,
    ref_logits: torch.Tensor,
    valid: torch.Tensor | None = None,
    confidence: float = 0.5,
) -> float:
    """Fraction of confident positions where the argmax tokens agree.

    A position counts only when the reference puts at least ``confidence`` probability on its top token:
    near-ties flip argmax under any rounding, so they say nothing about correctness. Returns 1.0 when no
    position is confident.
    """
    _require_vectors(ours_logits, "top1_agreement")
    a, b = _select(ours_logits, ref_logits, valid)
    a = a.reshape(-1, a.shape[-1])
    b = b.reshape(-1, b.shape[-1])
    confident = b.softmax(dim=-1).amax(dim=-1) >= confidence
    if not bool(confident.any()):
        return 1.0
    agree = a[confident].argmax(dim=-1) == b[confident].argmax(dim=-1)
    return float(agree.to(torch.float64).mean())


def jensen_shannon(ours_logits: torch.Tensor, ref_logits: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """Mean Jensen-Shannon divergence (natural log, so at most ln 2) between the softmax distributions."""
    _require_vectors(ours_logits, "jensen_shannon")
    a, b = _select(ours_logits, ref_logits, valid)
    log_p = a.reshape(-1, a.shape[-1]).log_softmax(dim=-1)
    log_q = b.reshape(-1, b.shape[-1]).log_softmax(dim=-1)
    # log of the mixture computed in log space so tiny probabilities do not underflow to log(0).
    log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)

    def kl_to_mixture(log_x: torch.Tensor) -> torch.Tensor:
        x = log_x.exp()
        # 0 * log 0 = 0; the where also hides -inf - -inf from -inf logits (masked vocabulary entries).
        terms = torch.where(x > 0, x * (log_x - log_m), torch.zeros_like(x))
        return terms.sum(dim=-1)

    js = 0.5 * kl_to_mixture(log_p) + 0.5 * kl_to_mixture(log_q)
    # Rounding can push an exact match a hair below zero; a divergence is never negative.
    return float(js.clamp_min(0.0).mean())


def parity_report(
    ours: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor | None = None, *, logits: bool = False
) -> dict[str, float]:
    """All applicable metrics as a dict.

    The cosine metrics need a feature dim, so they are included only for tensors with at least 3 dims;
    ``jensen_shannon`` and ``top1_agreement`` are included only when ``logits=True``.
    """
    report = {
        "max_abs": max_abs(ours, ref, valid),
        "relative_l2": relative_l2(ours, ref, valid),
        "relative_q999": relative_q999(ours, ref, valid),
    }
    if ours.dim() >= 3:
        report["residue_cosine_p1"] = residue_cosine_p1(ours, ref, valid)
        report["pooled_cosine"] = pooled_cosine(ours, ref, valid)
    if logits:
        report["top1_agreement"] = top1_agreement(ours, ref, valid)
        report["jensen_shannon"] = jensen_shannon(ours, ref, valid)
    return report
