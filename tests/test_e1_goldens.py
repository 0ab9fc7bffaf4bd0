"""Profluent E1: official layout, seeded weights, input panel and the committed goldens of the official code.

The goldens in ``tests/goldens/e1_*.safetensors`` come from ``tools/goldens/e1.py`` running Profluent-AI/E1's
own code (a checkout outside this repository, ``FASTPLMS_E1_ORACLE``). These tests regenerate the seeded weights
and the panel with the same functions the recipe used and check them against what its manifest recorded, so the
recipe and the tests share one definition. Only the test that runs the official code needs the checkout.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fastplms.oracles.e1 import (
    CACHE_ROW,
    E1_GOLDENS_DIR,
    E1_MANIFEST_JSON,
    E1_VOCAB,
    MASK_ID,
    PAD_ID,
    e1_batch,
    e1_cache_split,
    e1_dims,
    e1_encode,
    e1_global_layers,
    e1_goldens,
    e1_official_spec,
    e1_official_state_dict,
    e1_panel,
    e1_state_sha256,
)

REPO = Path(__file__).resolve().parents[1]
RECIPE = json.loads((E1_GOLDENS_DIR / E1_MANIFEST_JSON).read_text(encoding="utf-8"))
GOLDEN_MODELS = sorted(RECIPE["models"])
ORACLE = Path(os.environ.get("FASTPLMS_E1_ORACLE", "/nonexistent"))
needs_oracle = pytest.mark.skipif(
    not (ORACLE / "tree" / "src" / "E1" / "modeling.py").is_file(),
    reason="no official E1 checkout (FASTPLMS_E1_ORACLE, made by tools/goldens/setup_e1_oracle.sh)",
)

# Parameter counts of the official E1ForMaskedLM at each checkpoint's dims: the bf16 model.safetensors sizes
# (less their headers) are twice these (shared/reference/families.md §1.2).
PARAMETERS = {"e1_150m": 154_423_330, "e1_300m": 274_317_346, "e1_600m": 641_438_754}
# Layer 0 and the head of the official state dict at e1_150m dims, as the official model lists them.
LAYER0_AND_HEAD_150M = [
    ("model.embed_tokens.weight", (34, 768)),
    ("model.embed_seq_id.weight", (512, 768)),
    ("model.layers.0.norm_attn_norm.self_attn.q_proj.weight", (768, 768)),
    ("model.layers.0.norm_attn_norm.self_attn.k_proj.weight", (768, 768)),
    ("model.layers.0.norm_attn_norm.self_attn.v_proj.weight", (768, 768)),
    ("model.layers.0.norm_attn_norm.self_attn.o_proj.weight", (768, 768)),
    ("model.layers.0.norm_attn_norm.input_layernorm.weight", (768,)),
    ("model.layers.0.norm_attn_norm.post_attention_layernorm.weight", (768,)),
    ("model.layers.0.ffn.mlp.w1.weight", (2304, 768)),
    ("model.layers.0.ffn.mlp.w2.weight", (768, 2304)),
    ("model.layers.0.ffn.mlp.w3.weight", (2304, 768)),
]
HEAD_150M = [
    ("model.norm.weight", (768,)),
    ("mlm_head.0.weight", (768, 768)),
    ("mlm_head.0.bias", (768,)),
    ("mlm_head.2.weight", (768,)),
    ("mlm_head.2.bias", (768,)),
    ("mlm_head.3.weight", (34, 768)),
    ("mlm_head.3.bias", (34,)),
]


def load_goldens(name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest entry, tensors) of one checkpoint's goldens, hash-checked; for the parity tests."""
    _, entry, tensors = e1_goldens(name)
    return entry, tensors


# ---------------------------------------------------------------------------------------- layout, dims


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_spec_sizes_match_the_released_checkpoints(name: str) -> None:
    spec = e1_official_spec(e1_dims(name))
    assert sum(math.prod(shape) for shape in spec.values()) == PARAMETERS[name]
    assert len(spec) == 2 + 9 * e1_dims(name).num_layers + 7


def test_spec_layout_at_150m() -> None:
    items = list(e1_official_spec(e1_dims("e1_150m")).items())
    assert items[: len(LAYER0_AND_HEAD_150M)] == LAYER0_AND_HEAD_150M
    assert items[-len(HEAD_150M) :] == HEAD_150M
    assert not any("rotary" in key or "inv_freq" in key for key, _ in items)


def test_dims_from_the_manifest() -> None:
    d = e1_dims("e1_600m")
    assert (d.num_layers, d.hidden_size, d.num_heads, d.num_kv_heads, d.intermediate_size) == (30, 1280, 20, 20, 3840)
    assert (d.rope_theta_within_seq, d.rope_theta_global) == (1e4, 5e5)
    assert (d.max_positions_within_seq, d.max_positions_global, d.max_num_sequences) == (8192, 65536, 512)
    assert e1_global_layers(d) == [2, 5, 8, 11, 14, 17, 20, 23, 26, 29]
    assert e1_global_layers(e1_dims("e1_150m")) == [2, 5, 8, 11, 14, 17]
    with pytest.raises(KeyError, match="e1_1b"):
        e1_dims("e1_1b")


def test_vocabulary() -> None:
    assert len(E1_VOCAB) == 34 and E1_VOCAB[:8] == ("<pad>", "<bos>", "<eos>", "<bos_glm>", "<eos_span>", "?", "1", "2")
    assert E1_VOCAB.index("A") == 8 and E1_VOCAB.index("X") == 31 and E1_VOCAB.index("Z") == 33


def test_seeded_weights_are_deterministic_and_scaled() -> None:
    d = e1_dims("e1_150m")._replace(num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=4, intermediate_size=96)
    a, b = e1_official_state_dict(d, seed=0), e1_official_state_dict(d, seed=0)
    assert list(a) == list(e1_official_spec(d)) and e1_state_sha256(a) == e1_state_sha256(b)
    assert e1_state_sha256(e1_official_state_dict(d, seed=1)) != e1_state_sha256(a)
    norm = a["model.layers.0.norm_attn_norm.input_layernorm.weight"]
    assert abs(float(norm.mean()) - 1.0) < 0.05 and float(norm.std()) < 0.2
    assert abs(float(a["model.embed_seq_id.weight"].std()) - 1.0) < 0.05
    q, o = a["model.layers.0.norm_attn_norm.self_attn.q_proj.weight"], a["model.layers.0.ffn.mlp.w2.weight"]
    assert abs(float(q.std()) * math.sqrt(64) - 2.0) < 0.1 and abs(float(o.std()) * math.sqrt(96) - 1.0) < 0.1


# --------------------------------------------------------------------------------------------- inputs


def test_encode_layout_of_a_three_sequence_row() -> None:
    # The reference's measured example: 22, 19 and 8 residues -> 26, 23 and 12 tokens.
    row = e1_encode(",".join(["A" * 22, "C" * 19, "D?" * 4]))
    assert row["sequence_ids"].tolist() == [0] * 26 + [1] * 23 + [2] * 12
    assert row["within_seq_position_ids"].tolist() == [*range(26), *range(23), *range(12)]
    assert row["global_position_ids"].tolist() == list(range(61))
    assert row["context_len"] == 49
    ids = row["input_ids"].tolist()
    assert ids[:3] == [1, 6, 8] and ids[24:28] == [7, 2, 1, 6] and ids[-2:] == [7, 2] and ids.count(MASK_ID) == 4


def test_batch_pads_ids_with_zero_and_the_rest_with_minus_one() -> None:
    batch = e1_batch(["MK", "M,KL"])
    assert batch["input_ids"][0].tolist() == [1, 6, 20, 18, 7, 2] + [PAD_ID] * 5
    for key in ("sequence_ids", "within_seq_position_ids", "global_position_ids"):
        assert batch[key][0, 6:].tolist() == [-1] * 5
    assert batch["context_len"].tolist() == [0, 5]


@pytest.mark.parametrize(
    ("instance", "match"),
    [("mkl", "A-Z"), ("???", "at least one residue"), ("MK,", "sequence 1"), ("MK1", "A-Z"), ("M K", "A-Z")],
)
def test_encode_rejects(instance: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        e1_encode(instance)


def test_encode_limits() -> None:
    with pytest.raises(ValueError, match="at most 512"):
        e1_encode(",".join(["M"] * 513))
    with pytest.raises(ValueError, match="at most 8"):
        e1_encode("M" * 9, max_positions_within_seq=8)


def test_panel_and_cache_split() -> None:
    panel = e1_panel()
    assert panel.input_ids.shape == (5, 55) and panel.context_len.tolist() == [0, 37, 0, 18, 0]
    assert {len(s.split(",")) for s in panel.instances} == {1, 2, 3}
    assert bool((panel.input_ids == MASK_ID).any(dim=1).all())  # a mask in every row
    assert bool((panel.input_ids[~panel.valid] == PAD_ID).all()) and bool((~panel.valid).any())
    inputs, context = e1_cache_split(panel.instances[CACHE_ROW], n_context=2)
    assert context == 37 and torch.equal(inputs["input_ids"][0], panel.input_ids[CACHE_ROW])


# -------------------------------------------------------------------------------------------- goldens


def test_manifest_panel_is_e1_panel() -> None:
    panel = e1_panel()
    recorded = RECIPE["panel"]
    assert recorded["instances"] == panel.instances and recorded["context_len"] == panel.context_len.tolist()
    for key, value in panel.model_inputs().items():
        assert recorded[key] == value.tolist(), key
    assert RECIPE["upstream"]["commit"] == "219c7c7a3a803b8552ae6a44ce6dd24f133fefbd"
    assert GOLDEN_MODELS == ["e1_150m", "e1_300m"]


@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_manifest_dims_spec_and_weights_regenerate(name: str) -> None:
    entry = RECIPE["models"][name]
    dims = e1_dims(name)
    assert entry["dims"] == dims._asdict() and entry["global_layers"] == e1_global_layers(dims)
    spec = e1_official_spec(dims)
    assert entry["spec"] == {"keys": len(spec), "parameters": PARAMETERS[name]}
    assert e1_state_sha256(e1_official_state_dict(dims, seed=RECIPE["seed"])) == entry["state_sha256"]


@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_golden_file(name: str) -> None:
    entry, t = load_goldens(name)
    path = E1_GOLDENS_DIR / entry["file"]
    assert path.stat().st_size == entry["bytes"] < 5_000_000
    with safe_open(str(path), "pt") as f:
        assert list(f.metadata()) == ["e1_golden"]
    panel, dims = e1_panel(), e1_dims(name)
    for key, value in panel.model_inputs().items():
        assert torch.equal(t[key], value), key
    assert torch.equal(t["context_len"], panel.context_len)
    b, s = panel.input_ids.shape
    layers = [0, dims.num_layers // 2, dims.num_layers]
    assert t["hidden_state_layers"].tolist() == layers == entry["hidden_state_layers"]
    assert t["logits"].shape == (b, s, dims.vocab_size) and t["hidden_states"].shape == (3, b, s, dims.hidden_size)
    width = int((panel.sequence_ids[CACHE_ROW] >= 0).sum())
    context = int(t["cache_context_len"])
    assert context == int(panel.context_len[CACHE_ROW])
    assert t["cache_full_logits"].shape == (1, width, dims.vocab_size)
    assert t["cache_logits"].shape == (1, width - context, dims.vocab_size)
    assert t["cache_embeddings"].shape == (1, width - context, dims.hidden_size)
    for value in t.values():
        assert value.dtype in (torch.int64, torch.float32) and bool(torch.isfinite(value.float()).all())


@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_golden_facts(name: str) -> None:
    """What the official run showed: the last hidden state is the embeddings, the cache is exact for a one-
    sequence query and not for a two-sequence one, padding is deterministic, the clamp was exercised."""
    entry, t = load_goldens(name)
    width = t["cache_full_logits"].shape[1]
    context = int(t["cache_context_len"])
    assert torch.equal(t["cache_logits"], t["cache_full_logits"][:, context:])
    assert torch.equal(t["cache_embeddings"], t["cache_full_embeddings"][:, context:])
    assert torch.equal(t["cache_full_logits"][0], t["logits"][CACHE_ROW, :width])  # batched = alone, on CPU
    assert torch.equal(t["cache_full_embeddings"][0], t["hidden_states"][-1, CACHE_ROW, :width])
    assert entry["cache_single_query"]["max_abs_logits_vs_full"] == 0.0
    multi = entry["cache_two_sequence_query"]
    assert multi["first_query_sequence_max_abs_logits"] == 0.0 and multi["second_query_sequence_max_abs_logits"] > 0.1
    assert entry["in_process_rerun_bitwise_equal"] and entry["hidden_states_count"] == e1_dims(name).num_layers + 1
    assert 0 < entry["clip_fraction"]["q_proj"] < 1e-3 and 1e-3 < entry["clip_fraction"]["v_proj"] < 0.05


def test_goldens_hash_check_refuses_a_changed_file(tmp_path: Path) -> None:
    for name in (E1_MANIFEST_JSON, RECIPE["models"]["e1_150m"]["file"]):
        (tmp_path / name).write_bytes((E1_GOLDENS_DIR / name).read_bytes())
    golden = tmp_path / RECIPE["models"]["e1_150m"]["file"]
    golden.write_bytes(golden.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(ValueError, match="sha256"):
        e1_goldens("e1_150m", tmp_path)
    assert hashlib.sha256(golden.read_bytes()).hexdigest() != RECIPE["models"]["e1_150m"]["sha256"]


# ------------------------------------------------------------------------------- the official code itself

ORACLE_CHECK = r"""
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path[:0] = [sys.argv[1] + "/tree/src", sys.argv[1] + "/site"]
import torch
from E1.batch_preparer import E1BatchPreparer
from E1.config import E1Config
from E1.modeling import E1ForMaskedLM
from E1.tokenizer import get_tokenizer
from fastplms.oracles import e1 as ref

vocab = get_tokenizer().get_vocab()
assert [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] == list(ref.E1_VOCAB)
panel = ref.e1_panel()
official = E1BatchPreparer().get_batch_kwargs(panel.instances, device=torch.device("cpu"))
for key, value in panel.model_inputs().items():
    assert torch.equal(official[key], value), key
assert official["context_len"] == panel.context_len.tolist()
dims = ref.e1_dims("e1_150m")._replace(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)
model = E1ForMaskedLM(E1Config(**ref.e1_config_kwargs(dims)))
assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == list(ref.e1_official_spec(dims).items())
model.load_state_dict(ref.e1_official_state_dict(dims), strict=True)
print("ok")
"""


@needs_oracle
def test_layout_vocab_and_panel_against_the_official_code() -> None:
    """Our facts against the official checkout: vocabulary, batch preparer, state-dict layout (with GQA)."""
    result = subprocess.run(
        [sys.executable, "-c", ORACLE_CHECK, str(ORACLE)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@needs_oracle
@pytest.mark.skipif(os.environ.get("FASTPLMS_E1_RECHECK") != "1", reason="set FASTPLMS_E1_RECHECK=1 (about 2 min)")
def test_recipe_reproduces_the_goldens_bit_for_bit() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tools.goldens.e1", "--check", "--oracle", str(ORACLE)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
