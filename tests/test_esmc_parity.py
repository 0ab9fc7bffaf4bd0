"""ESM++ (ESMC) parity against the official EvolutionaryScale `esm` ESMC, through committed goldens.

The oracle cannot share this venv, so `tools/goldens/esmc.py` ran it (esm 3.2.1.post1, FP32 CPU) on the
seeded official-layout weights of `fastplms.oracles.esmc` at each checkpoint's real dims, on the fixed
`esmc_panel()`, and committed the outputs under `tests/goldens/`. Here the same weights are regenerated,
converted from the official `esm` layout with `convert.esmc.from_esm`, and our model runs the same panel on
every CPU backend, once with the padding mask (official `sequence_id=None`) and once with the panel's integer
`sequence_id` (two chains in one row). Every comparison is over valid (non-padding) positions.

Official `hidden_states[i]` is block i's output before the final norm; ours is `hidden_states[i + 1]`
(ours leads with the embeddings) for every block but the last, and our last entry (= `last_hidden_state`)
is the official `embeddings` (post-norm).
"""

from __future__ import annotations

import gc
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastplms.attention import clear_flex_attention_caches
from fastplms.configuration_esmc import ESMCConfig
from fastplms.convert.esmc import from_esm
from fastplms.manifest import MANIFEST_DIR, load_manifest
from fastplms.modeling_esmc import ESMCForMaskedLM
from fastplms.oracles.esmc import esmc_official_state_dict, esmc_panel
from fastplms.parity.driver import cpu_backends
from fastplms.parity.metrics import max_abs, relative_l2
from fastplms.tokenization_esm import ESMC_VOCAB, ESMTokenizer, write_vocab

pytestmark = pytest.mark.slow

GOLDENS = Path(__file__).resolve().parent / "goldens"
RECIPE = json.loads((GOLDENS / "esmc_manifest.json").read_text())
FAMILY = load_manifest(MANIFEST_DIR / "esmc.toml", resolve=False)
MODELS = [c.id for c in FAMILY.checkpoints if c.id in RECIPE["models"]]
BACKENDS = cpu_backends(FAMILY)
VARIANTS = ("padding", "sequence_id")
TOLERANCE = 1e-5


def goldens(name: str) -> dict[str, torch.Tensor]:
    path = GOLDENS / RECIPE["models"][name]["file"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == RECIPE["models"][name]["sha256"], path
    return load_file(str(path))


def build_ours(name: str) -> ESMCForMaskedLM:
    layers, hidden, heads = FAMILY.checkpoint(name).dims
    state = from_esm(esmc_official_state_dict(layers, hidden, heads, seed=RECIPE["seed"]))
    config = ESMCConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads)
    with torch.device("meta"):
        model = ESMCForMaskedLM(config)
    # Assigned, not copied: the seeded tensors become the parameters (one copy of the weights in memory).
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def measure(name: str) -> dict[tuple[str, str], dict[str, float]]:
    gold = goldens(name)
    panel = esmc_panel()
    assert torch.equal(gold["input_ids"], panel.input_ids) and torch.equal(gold["sequence_id"], panel.sequence_id)
    ids, mask, sid = panel.input_ids, panel.attention_mask, panel.sequence_id
    valid = mask.bool()
    model = build_ours(name)
    # Ours leads with the embeddings and ends with the final-norm output (compared as embeddings).
    last = len(model.esmc.layers)
    layers = [(j, int(i) + 1) for j, i in enumerate(gold["hidden_state_layers"]) if int(i) + 1 < last]
    records: dict[tuple[str, str], dict[str, float]] = {}
    try:
        for backend in BACKENDS:
            model.set_attn_implementation(backend)
            for variant in VARIANTS:
                kwargs = {"attention_mask": mask} if variant == "padding" else {"sequence_id": sid}
                with torch.no_grad():
                    out = model(ids, output_hidden_states=True, **kwargs)
                    # The official `embeddings` (the final norm of the last block's output) is our last entry.
                    embeddings = out.hidden_states[-1]
                prefix = "" if variant == "padding" else "seqid_"
                record = {
                    "logits_relative_l2": relative_l2(out.logits, gold[prefix + "logits"], valid),
                    "logits_max_abs": max_abs(out.logits, gold[prefix + "logits"], valid),
                    "embeddings_relative_l2": relative_l2(embeddings[valid], gold[prefix + "embeddings"]),
                    "padding_max_abs": float(out.logits[~valid].abs().max()),
                }
                if variant == "padding":
                    record["hidden_states_relative_l2"] = max(
                        relative_l2(out.hidden_states[i][valid], gold["hidden_states"][j]) for j, i in layers
                    )
                records[(backend, variant)] = record
                print(f"{name} {backend:15s} {variant:11s} " + " ".join(f"{k}={v:.2e}" for k, v in record.items()))
    finally:
        clear_flex_attention_caches()
        del model
        gc.collect()
    return records


@pytest.fixture(scope="module")
def measured():
    cache: dict[str, dict] = {}

    def get(name: str) -> dict[tuple[str, str], dict[str, float]]:
        if name not in cache:
            cache[name] = measure(name)
        return cache[name]

    return get


def test_goldens_cover_the_released_open_checkpoints():
    assert "esmc_300m" in MODELS
    assert RECIPE["versions"]["esm"] == "3.2.1.post1"


def test_our_tokenizer_reproduces_the_panel(tmp_path):
    panel = esmc_panel()
    tokenizer = ESMTokenizer(write_vocab(tmp_path / "vocab.txt", ESMC_VOCAB))
    batch = tokenizer(panel.sequences, padding=True, return_tensors="pt")
    assert torch.equal(batch["input_ids"], panel.input_ids)
    assert torch.equal(batch["attention_mask"], panel.attention_mask)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MODELS)
def test_matches_official_goldens(name, backend, measured):
    records = measured(name)
    for variant in VARIANTS:
        record = records[(backend, variant)]
        for key, value in record.items():
            if key.endswith("relative_l2"):
                assert value <= TOLERANCE, (variant, key, value)
        assert record["padding_max_abs"] == 0, variant


@pytest.mark.parametrize("name", [c.id for c in FAMILY.checkpoints])
def test_conversion_shapes_at_real_dims(name):
    """Both official layouts (esm, Biohub) at real dims, meta tensors only: what the parity report records."""
    from fastplms.families.esmc_parity import check_esmc_conversion_shapes

    record = check_esmc_conversion_shapes(name)
    assert record["ok"], record["problems"]
    assert record["layouts"] == ["biohub", "esm"]
    spec = FAMILY.checkpoint(name)
    assert record["dims"] == {"layers": spec.num_layers, "hidden": spec.hidden_size, "heads": spec.num_heads}
