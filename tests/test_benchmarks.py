"""The benchmark harness's own logic: batching, FLOP models, and the generated page being current.

The measurements themselves are not tests (timed tests prove nothing on a shared CI machine); these
check the pieces every number in docs/benchmarks.md rests on.
"""

from __future__ import annotations

import random

import torch

from benchmarks.ankh import ankh_flops
from benchmarks.embed import _length_sorted_batches, dataset_lengths, useful_flops
from benchmarks.esmc import esmc_flops
from benchmarks.report import OUT, pick_records, render
from fastplms.configuration_ankh import ANKHConfig
from fastplms.configuration_esm2 import ESM2Config
from fastplms.configuration_esmc import ESMCConfig
from fastplms.modeling_ankh import ANKHModel
from fastplms.modeling_esm2 import ESM2Model
from fastplms.modeling_esmc import ESMCModel
from fastplms.oracles.t5 import T5Dims


def test_docs_benchmarks_page_is_generated_from_the_committed_records():
    assert OUT.read_text() == render(pick_records([])), "stale: run `python -m benchmarks.report`"


def test_length_sorted_batches_cover_every_record_once_within_the_budget():
    lengths = dataset_lengths("lognormal", 300, seed=3)
    for budget in (1024, 2048, 4096):
        batches = _length_sorted_batches(lengths, budget)
        assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
        for batch in batches:
            width = max(lengths[i] for i in batch) + 2
            assert len(batch) == 1 or len(batch) * width <= budget
            assert lengths[batch[0]] == max(lengths[i] for i in batch)  # longest first


def test_dataset_profiles_have_the_documented_shape():
    lognormal = sorted(dataset_lengths("lognormal", 2000, seed=0))
    assert 260 <= lognormal[1000] <= 340 and lognormal[-1] <= 1022
    short = dataset_lengths("short", 500, seed=0)
    assert min(short) >= 100 and max(short) <= 140


def _matmul_weights(model: torch.nn.Module) -> int:
    """Weights and biases of every Linear inside the encoder layers (what a token multiplies through)."""
    return sum(p.numel() for name, p in model.named_parameters() if name.startswith("layers.") and "norm" not in name)


def _flops_from_modules(model: torch.nn.Module, layers: int, hidden: int, lengths: list[int]) -> float:
    params = _matmul_weights(model)
    return float(sum((n + 2) * 2 * params + layers * 4 * hidden * (n + 2) ** 2 for n in lengths))


def test_flop_models_count_the_models_matmul_weights():
    lengths = [random.Random(i).randint(1, 900) for i in range(20)]
    esm2 = ESM2Model(ESM2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256))
    assert useful_flops(lengths, 3, 64) == _flops_from_modules(esm2, 3, 64, lengths)
    esmc = ESMCModel(ESMCConfig(hidden_size=96, num_hidden_layers=2, num_attention_heads=4))
    assert esmc_flops(lengths, 2, 96) == _flops_from_modules(esmc, 2, 96, lengths)


def test_ankh_flop_model_counts_the_t5_encoders_matmul_weights():
    """T5: T = L + 1 tokens (</s>), heads * d_kv-wide attention (here narrower than hidden), gated FFN, no biases;
    the relative bias table lives outside the layers and is no matmul."""
    lengths = [random.Random(i).randint(1, 900) for i in range(20)]
    dims = T5Dims(2, 1, 64, 4, 8, 96, 144, "gated-gelu")
    encoder = ANKHModel(
        ANKHConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_decoder_layers=1,
            num_attention_heads=4,
            d_kv=8,
            intermediate_size=96,
        )
    )
    params, inner = _matmul_weights(encoder), dims.heads * dims.d_kv
    assert ankh_flops(lengths, dims) == float(sum((n + 1) * 2 * params + 2 * 4 * inner * (n + 1) ** 2 for n in lengths))
