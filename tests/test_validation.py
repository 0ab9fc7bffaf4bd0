import math

import numpy as np
import pytest
import torch

from fastplms.parity.metrics import (
    jensen_shannon,
    max_abs,
    parity_report,
    pooled_cosine,
    relative_l2,
    relative_q999,
    residue_cosine_p1,
    top1_agreement,
)

VECTOR_METRICS = [max_abs, relative_l2, relative_q999, residue_cosine_p1, pooled_cosine]
LOGIT_METRICS = [top1_agreement, jensen_shannon]


def _pair(seed: int = 0, shape=(3, 5, 8)) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(shape, generator=gen)
    ours = ref + 0.05 * torch.randn(shape, generator=gen)
    return ours, ref


def test_identical_tensors():
    x = torch.randn(2, 4, 6)
    report = parity_report(x, x.clone(), logits=True)
    assert report == {
        "max_abs": 0.0,
        "relative_l2": 0.0,
        "relative_q999": 0.0,
        "residue_cosine_p1": pytest.approx(1.0, abs=1e-12),
        "pooled_cosine": pytest.approx(1.0, abs=1e-12),
        "top1_agreement": 1.0,
        "jensen_shannon": pytest.approx(0.0, abs=1e-15),
    }


def test_hand_computed_elementwise():
    ref = torch.tensor([[[3.0, 4.0]]])  # ||ref|| = 5
    ours = torch.tensor([[[3.0, 1.0]]])  # diff = (0, -3)
    assert max_abs(ours, ref) == 3.0
    assert relative_l2(ours, ref) == pytest.approx(3.0 / 5.0)
    # Two elements: q999 interpolates between the two sorted values, 0.999 of the way to the top.
    assert relative_q999(ours, ref) == pytest.approx((0.999 * 3.0) / (3.0 + 0.999 * 1.0))


def test_relative_q999_matches_numpy():
    ours, ref = _pair(1, shape=(4, 50, 16))
    expected = np.quantile((ours - ref).abs().double().numpy(), 0.999) / np.quantile(ref.abs().double().numpy(), 0.999)
    assert relative_q999(ours, ref) == pytest.approx(expected, rel=1e-12)


def test_hand_computed_cosines():
    ref = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])
    ours = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [1.0, 1.0]]])  # cosines 1, 0, 1
    # Sorted cosines (0, 1, 1); the 1st percentile sits 0.02 of the way from 0 to 1.
    assert residue_cosine_p1(ours, ref) == pytest.approx(0.02)
    # Pooled: ours mean (1, 1/3), ref mean (2/3, 2/3) -> cos = (8/9) / (sqrt(10)/3 * sqrt(8)/3).
    assert pooled_cosine(ours, ref) == pytest.approx(8.0 / math.sqrt(80.0))
    # Minimum over sequences: add a perfect second sequence and the result is unchanged.
    ours2 = torch.cat([ours, ref])
    ref2 = torch.cat([ref, ref])
    assert pooled_cosine(ours2, ref2) == pytest.approx(8.0 / math.sqrt(80.0))


def test_zero_vectors_cosine_convention():
    zeros = torch.zeros(1, 2, 3)
    assert residue_cosine_p1(zeros, zeros) == 1.0
    assert pooled_cosine(torch.ones(1, 2, 3), zeros) == 0.0
    assert relative_l2(zeros, zeros) == 0.0
    assert relative_l2(torch.ones(1, 2, 3), zeros) == math.inf


def test_hand_computed_logit_metrics():
    ref = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]], dtype=torch.float64))
    # The exact zero becomes a -inf logit, which must contribute 0 * log 0 = 0.
    ours = torch.log(torch.tensor([[[1.0, 0.0], [0.9, 0.1], [0.7, 0.3]]], dtype=torch.float64))
    # Position 0: JS between (1, 0) and (0.5, 0.5) = 0.5*ln(4/3) + 0.25*ln(2/3) + 0.25*ln(2).
    js0 = 0.5 * math.log(4 / 3) + 0.25 * math.log(2 / 3) + 0.25 * math.log(2)
    m = (0.45, 0.55)
    js2 = 0.5 * (0.7 * math.log(0.7 / m[0]) + 0.3 * math.log(0.3 / m[1])) + 0.5 * (
        0.2 * math.log(0.2 / m[0]) + 0.8 * math.log(0.8 / m[1])
    )
    assert jensen_shannon(ours, ref) == pytest.approx((js0 + 0.0 + js2) / 3, rel=1e-9)
    # Confident ref positions are 1 (0.9) and 2 (0.8); the tie at position 0 (0.5 >= 0.5) also counts.
    # argmax agrees at 0 and 1, not at 2.
    assert top1_agreement(ours, ref) == pytest.approx(2 / 3)
    assert top1_agreement(ours, ref, confidence=0.6) == pytest.approx(1 / 2)
    assert top1_agreement(ours, ref, confidence=0.95) == 1.0


def test_js_handles_masked_vocab_and_bound():
    ref = torch.tensor([[[0.0, -math.inf, 0.0]]])
    ours = torch.tensor([[[0.0, -math.inf, 0.0]]])
    assert jensen_shannon(ours, ref) == 0.0
    disjoint = jensen_shannon(torch.tensor([[[100.0, -100.0]]]), torch.tensor([[[-100.0, 100.0]]]))
    assert disjoint == pytest.approx(math.log(2.0))


@pytest.mark.parametrize("metric", VECTOR_METRICS + LOGIT_METRICS)
def test_invalid_positions_are_ignored(metric):
    ours, ref = _pair(2)
    valid = torch.ones(3, 5, dtype=torch.bool)
    valid[0, 3:] = False
    valid[2, 1] = False
    expected = metric(ours, ref, valid)
    for garbage in (1e30, math.nan, -math.inf):
        dirty_ours, dirty_ref = ours.clone(), ref.clone()
        dirty_ours[~valid] = garbage
        dirty_ref[~valid] = -garbage if not math.isnan(garbage) else garbage
        assert metric(dirty_ours, dirty_ref, valid) == expected
    # Only valid positions count: the result equals computing on the gathered positions alone.
    gathered = metric(ours[valid][None], ref[valid][None])
    if metric is not pooled_cosine:  # pooling groups by sequence, so gathering changes the groups
        assert gathered == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_integer_mask_accepted():
    ours, ref = _pair(3)
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, 2:] = 0
    assert relative_l2(ours, ref, mask) == relative_l2(ours, ref, mask.bool())


@pytest.mark.parametrize("metric", [max_abs, relative_l2, relative_q999, residue_cosine_p1, pooled_cosine])
def test_nan_at_valid_position_is_not_hidden(metric):
    ours, ref = _pair(4)
    ours[1, 2, 3] = math.nan
    assert math.isnan(metric(ours, ref))


def test_float32_inputs_computed_in_float64():
    ref = torch.full((1, 1, 4), 1e8, dtype=torch.float32)
    ours = ref.clone()
    ours[0, 0, 0] = 1e8 + 8.0  # representable in fp32; the diff must survive exactly
    assert max_abs(ours, ref) == 8.0


@pytest.mark.parametrize("metric", VECTOR_METRICS + LOGIT_METRICS)
def test_errors(metric):
    ours, ref = _pair(5)
    with pytest.raises(ValueError, match="shape mismatch"):
        metric(ours, ref[:, :4])
    with pytest.raises(ValueError, match="valid has shape"):
        metric(ours, ref, torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="no positions"):
        metric(ours, ref, torch.zeros(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        metric(ours, ref, torch.ones(3, 5))


def test_vector_metrics_need_feature_dim():
    x = torch.randn(2, 3)
    for metric in (residue_cosine_p1, pooled_cosine, top1_agreement, jensen_shannon):
        with pytest.raises(ValueError, match="dim"):
            metric(x, x)
    assert set(parity_report(x, x)) == {"max_abs", "relative_l2", "relative_q999"}


def test_report_keys():
    ours, ref = _pair(6)
    assert set(parity_report(ours, ref)) == {
        "max_abs",
        "relative_l2",
        "relative_q999",
        "residue_cosine_p1",
        "pooled_cosine",
    }
    report = parity_report(ours, ref, logits=True)
    assert {"top1_agreement", "jensen_shannon"} <= set(report)
    assert 0.0 < report["relative_l2"] < 0.1
    assert 0.99 < report["pooled_cosine"] <= 1.0
