"""DPLM at real dims (dplm_150m): the forward against Transformers, generation against the official sampler.

The sampler goldens (tests/goldens/dplm_sampler.json) are token tensors of ByteDance's own
`DiffusionProteinLanguageModel.generate` (tools/goldens/dplm.py) on seeded official-layout weights; ours
must reproduce them token for token on CPU, seeded the same way.
"""

from __future__ import annotations

import pytest
import torch

from fastplms.convert.dplm import from_byprot
from fastplms.families.dplm_parity import build_dplm, dplm_family, run_golden_case, sampler_goldens
from fastplms.families.esm2_parity import esm2_panel
from fastplms.oracles.dplm import dplm_official_state_dict, dplm_transformers_network, run_dplm_network

pytestmark = pytest.mark.slow

CHECKPOINT = dplm_family().checkpoint("dplm_150m")
GOLDENS = sampler_goldens()


@pytest.fixture(scope="module")
def models():
    """Ours per golden weight recipe (built once each), plus the base recipe's official state."""
    built = {}

    def get(weights: dict):
        key = (weights["seed"], tuple(sorted((weights.get("lm_head_bias_shift") or {}).items())))
        if key not in built:
            shift = {int(k): v for k, v in (weights.get("lm_head_bias_shift") or {}).items()}
            seed = weights["seed"]
            official = dplm_official_state_dict(*CHECKPOINT.dims, seed=seed, lm_head_bias_shift=shift or None)
            built[key] = (official, build_dplm(from_byprot(official, CHECKPOINT.num_heads), CHECKPOINT))
        return built[key]

    return get


def test_goldens_are_at_real_dims() -> None:
    for case in GOLDENS["cases"]:
        weights = case["weights"]
        assert (weights["num_layers"], weights["hidden"], weights["heads"]) == CHECKPOINT.dims


@pytest.mark.parametrize("case", GOLDENS["cases"], ids=[c["name"] for c in GOLDENS["cases"]])
def test_generate_reproduces_the_official_sampler(models, case) -> None:
    _official, model = models(case["weights"])
    model.set_attn_implementation("sdpa")
    assert torch.equal(run_golden_case(model, case), torch.tensor(case["output_tokens"]))


def test_forward_matches_transformers_at_real_dims_padding_included(models) -> None:
    official, model = models(GOLDENS["cases"][0]["weights"])
    input_ids, _ = esm2_panel(0, lengths=(1, 12, 37, 60))
    ref_logits, ref_hidden = run_dplm_network(dplm_transformers_network(official), input_ids)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model(input_ids, output_hidden_states=True)
    assert (input_ids == 1).any()
    rel = (out.logits - ref_logits).norm() / ref_logits.norm()
    assert rel < 1e-5
    for ours, ref in zip(out.hidden_states, ref_hidden, strict=True):
        assert (ours - ref).norm() / ref.norm() < 1e-5
