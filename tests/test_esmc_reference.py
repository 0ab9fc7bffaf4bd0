"""ESMC reference layout, seeded weights, golden panel and the committed goldens of the official ESMC.

The goldens in ``tests/goldens/`` come from ``tools/goldens/esmc.py`` run in the oracle venv ``.venv-esmc``
(EvolutionaryScale ``esm``). Tests that need that venv are skipped when it is absent; everything else runs
in the main venv from hard-coded facts about the official layout.
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
from safetensors.torch import load_file

from fastplms.manifest import MANIFEST_DIR, load_manifest
from fastplms.oracles.esmc import (
    CHAIN_BREAK_ID,
    ESMC_VOCAB,
    MASK_ID,
    PAD_ID,
    esmc_ffn_hidden,
    esmc_official_spec,
    esmc_official_state_dict,
    esmc_panel,
    esmc_tokenize,
)

REPO = Path(__file__).resolve().parents[1]
GOLDENS = REPO / "tests" / "goldens"
MANIFEST = GOLDENS / "esmc_manifest.json"
ORACLE_PYTHON = REPO / ".venv-esmc" / "bin" / "python"
REFERENCE = REPO / "src" / "fastplms" / "oracles" / "esmc.py"
# The released models' dims, as the manifest states them: id -> (n_layers, d_model, n_heads).
ESMC_DIMS = {c.id: c.dims for c in load_manifest(MANIFEST_DIR / "esmc.toml", resolve=False).checkpoints}
needs_oracle = pytest.mark.skipif(not ORACLE_PYTHON.exists(), reason="oracle venv .venv-esmc not set up")

# ESMC(d_model=64, n_heads=4, n_layers=2, ...).state_dict(), as listed by the official esm 3.2.1.post1 model.
TINY_DIMS = (2, 64, 4)
TINY_OFFICIAL_SPEC = [
    ("embed.weight", (64, 64)),
    *[
        item
        for i in range(2)
        for item in [
            (f"transformer.blocks.{i}.attn.layernorm_qkv.0.weight", (64,)),
            (f"transformer.blocks.{i}.attn.layernorm_qkv.0.bias", (64,)),
            (f"transformer.blocks.{i}.attn.layernorm_qkv.1.weight", (192, 64)),
            (f"transformer.blocks.{i}.attn.out_proj.weight", (64, 64)),
            (f"transformer.blocks.{i}.attn.q_ln.weight", (64,)),
            (f"transformer.blocks.{i}.attn.k_ln.weight", (64,)),
            (f"transformer.blocks.{i}.ffn.0.weight", (64,)),
            (f"transformer.blocks.{i}.ffn.0.bias", (64,)),
            (f"transformer.blocks.{i}.ffn.1.weight", (512, 64)),
            (f"transformer.blocks.{i}.ffn.3.weight", (64, 256)),
        ]
    ],
    ("transformer.norm.weight", (64,)),
    ("sequence_head.0.weight", (64, 64)),
    ("sequence_head.0.bias", (64,)),
    ("sequence_head.2.weight", (64,)),
    ("sequence_head.2.bias", (64,)),
    ("sequence_head.3.weight", (64, 64)),
    ("sequence_head.3.bias", (64,)),
]
# (number of keys, number of parameters) of the official state dicts at real dims (counted on the esm model).
REAL_SPEC_SIZES = {"esmc_300m": (308, 332997184), "esmc_600m": (368, 575036992), "esmc_6b": (808, 6352005184)}
# sha256 over (key, float32 bytes) of esmc_official_state_dict(2, 64, 4, seed=0): catches any drift in the
# generator or the rule, which would silently invalidate the committed goldens.
TINY_STATE_SHA256 = "569723090149d613e1ab7cc921744b882d3844b1240ce5d74fa7d8dd72251e00"

GOLDEN_KEYS = {
    "input_ids",
    "attention_mask",
    "sequence_id",
    "hidden_state_layers",
    "logits",
    "embeddings",
    "hidden_states",
    "seqid_logits",
    "seqid_embeddings",
}


def _state_sha256(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key, value in state.items():
        digest.update(key.encode())
        digest.update(value.numpy().tobytes())
    return digest.hexdigest()


def test_tiny_spec_matches_official_layout():
    assert list(esmc_official_spec(*TINY_DIMS).items()) == TINY_OFFICIAL_SPEC


@pytest.mark.parametrize("name", sorted(ESMC_DIMS))
def test_real_dims_spec(name):
    n_layers, d_model, n_heads = ESMC_DIMS[name]
    assert d_model // n_heads == 64
    spec = esmc_official_spec(n_layers, d_model, n_heads)
    assert (len(spec), sum(math.prod(s) for s in spec.values())) == REAL_SPEC_SIZES[name]
    hidden = {"esmc_300m": 2560, "esmc_600m": 3072, "esmc_6b": 6912}[name]
    assert esmc_ffn_hidden(d_model) == hidden
    last = f"transformer.blocks.{n_layers - 1}."
    assert spec[last + "ffn.1.weight"] == (2 * hidden, d_model)
    assert spec[last + "ffn.3.weight"] == (d_model, hidden)
    assert spec["embed.weight"] == (64, d_model) and spec["sequence_head.3.weight"] == (64, d_model)
    assert not any(k.endswith("inv_freq") for k in spec)


def test_invalid_dims_rejected():
    with pytest.raises(ValueError):
        esmc_official_spec(2, 65, 4)


def test_seeded_state_dict_is_deterministic_and_scaled():
    a = esmc_official_state_dict(*TINY_DIMS, seed=0)
    b = esmc_official_state_dict(*TINY_DIMS, seed=0)
    c = esmc_official_state_dict(*TINY_DIMS, seed=1)
    assert list(a) == list(esmc_official_spec(*TINY_DIMS))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(v.dtype == torch.float32 for v in a.values())
    assert not torch.equal(a["embed.weight"], c["embed.weight"])
    assert _state_sha256(a) == TINY_STATE_SHA256
    # Scales: embeddings ~N(0,1), norm scales ~1 +- 0.1, matrices ~1/sqrt(fan_in).
    assert 0.8 < a["embed.weight"].std() < 1.2
    for key in ("transformer.blocks.0.attn.q_ln.weight", "transformer.norm.weight", "sequence_head.2.weight"):
        assert abs(a[key].mean() - 1) < 0.05 and 0.05 < a[key].std() < 0.15
    w = a["transformer.blocks.0.ffn.3.weight"]
    assert abs(w.std() * math.sqrt(w.shape[1]) - 1) < 0.1


def test_tokenize_uses_official_ids():
    assert len(ESMC_VOCAB) == 33 and ESMC_VOCAB[MASK_ID] == "<mask>" and ESMC_VOCAB[CHAIN_BREAK_ID] == "|"
    assert esmc_tokenize("MK<mask>LVAGHW") == [0, 20, 15, 32, 4, 7, 5, 6, 21, 22, 2]
    assert esmc_tokenize("A|C") == [0, 5, 31, 23, 2]
    assert esmc_tokenize("AJ", add_special_tokens=False) == [5, 3]  # unknown character -> <unk>


def test_panel_shape_and_masks():
    sequences, input_ids, attention_mask, sequence_id = esmc_panel()
    assert len(sequences) == 4 and input_ids.shape == (4, 72) and input_ids.dtype == torch.int64
    assert attention_mask.sum(1).tolist() == [3, 11, 35, 72]
    assert torch.equal(attention_mask, (input_ids != PAD_ID).long())
    assert (input_ids[:, 0] == 0).all() and input_ids[0, :3].tolist() == [0, 20, 2]
    assert all((row == MASK_ID).any() for row in input_ids[1:])
    assert torch.equal(sequence_id == -1, attention_mask == 0)
    # Row 2: <cls> + 16 residues + "|" -> chain 0; 16 residues + <eos> -> chain 1.
    assert input_ids[2, 17] == CHAIN_BREAK_ID
    assert sequence_id[2, :35].tolist() == [0] * 18 + [1] * 17
    assert sequence_id[[0, 1, 3]].max() == 0


def test_golden_files_match_manifest():
    manifest = json.loads(MANIFEST.read_text())
    assert manifest["seed"] == 0
    panel = esmc_panel()
    assert manifest["panel"]["sequences"] == panel.sequences
    assert manifest["panel"]["input_ids"] == panel.input_ids.tolist()
    assert manifest["panel"]["sequence_id"] == panel.sequence_id.tolist()
    assert set(manifest["models"]) == {"esmc_300m", "esmc_600m"}
    n_valid = int(panel.attention_mask.sum())
    for name, entry in manifest["models"].items():
        path = GOLDENS / entry["file"]
        data = path.read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], f"{path} does not match esmc_manifest.json"
        assert len(data) < 4 * 1024 * 1024
        n_layers, d_model, n_heads = ESMC_DIMS[name]
        assert (entry["n_layers"], entry["d_model"], entry["n_heads"]) == (n_layers, d_model, n_heads)
        with safe_open(str(path), "pt") as f:
            assert json.loads(f.metadata()["esmc_golden"])["model"] == name
        tensors = load_file(str(path))
        assert set(tensors) == GOLDEN_KEYS
        assert torch.equal(tensors["input_ids"], panel.input_ids)
        assert torch.equal(tensors["attention_mask"], panel.attention_mask)
        assert torch.equal(tensors["sequence_id"], panel.sequence_id)
        layers = [0, n_layers // 2, n_layers - 1]
        assert tensors["hidden_state_layers"].tolist() == entry["hidden_state_layers"] == layers
        assert tensors["logits"].shape == tensors["seqid_logits"].shape == (4, 72, 64)
        assert tensors["embeddings"].shape == tensors["seqid_embeddings"].shape == (n_valid, d_model)
        assert tensors["hidden_states"].shape == (3, n_valid, d_model)
        for key in ("logits", "embeddings", "hidden_states", "seqid_logits", "seqid_embeddings"):
            assert tensors[key].dtype == torch.float32 and torch.isfinite(tensors[key]).all()
        # Only the multi-chain row (2) differs between the padding-derived and the explicit sequence_id mask.
        diff = (tensors["logits"] - tensors["seqid_logits"]).abs().amax(dim=(1, 2))
        assert diff[[0, 1, 3]].max() == 0 and diff[2] > 1e-2


ORACLE_CHECK = r"""
import json, sys, importlib.util, torch
spec = importlib.util.spec_from_file_location("esmc_reference_by_path", sys.argv[1])
ref = importlib.util.module_from_spec(spec); spec.loader.exec_module(ref)
from esm.models.esmc import ESMC
from esm.tokenization import EsmSequenceTokenizer
tok = EsmSequenceTokenizer()
def build(l, d, h):
    return ESMC(d_model=d, n_heads=h, n_layers=l, tokenizer=tok, use_flash_attn=False)
def layout(model):
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
report = {}
tiny = build(2, 64, 4)
report["tiny"] = list(ref.esmc_official_spec(2, 64, 4).items()) == layout(tiny)
tiny.load_state_dict(ref.esmc_official_state_dict(2, 64, 4), strict=True)
for name, dims in json.loads(sys.argv[2]).items():
    with torch.device("meta"):
        model = build(*dims)
    report[name] = list(ref.esmc_official_spec(*dims).items()) == layout(model)
panel = ref.esmc_panel()
report["panel_ids"] = torch.equal(tiny._tokenize(panel.sequences), panel.input_ids)
report["vocab"] = [tok.convert_ids_to_tokens(i) for i in range(tok.vocab_size)] == list(ref.ESMC_VOCAB)
report["encode"] = all(tok.encode(s) == ref.esmc_tokenize(s) for s in panel.sequences + ["AJ", "<mask>|X-."])
print(json.dumps(report))
"""


@needs_oracle
def test_spec_tokenizer_and_panel_against_official_esm():
    result = subprocess.run(
        [str(ORACLE_PYTHON), "-c", ORACLE_CHECK, str(REFERENCE), json.dumps(ESMC_DIMS)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == dict.fromkeys(["tiny", *ESMC_DIMS, "panel_ids", "vocab", "encode"], True)


@needs_oracle
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FASTPLMS_ESMC_RECHECK"), reason="set FASTPLMS_ESMC_RECHECK=1 (~4 min)")
def test_golden_recipe_reproduces_bit_for_bit():
    result = subprocess.run(
        [str(ORACLE_PYTHON), "-m", "tools.goldens.esmc", "--out", str(GOLDENS), "--check"],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def test_reference_imports_without_transformers_or_fastplms():
    # The oracle venv loads the module by file path: it must not need transformers or the fastplms package.
    path = str(REFERENCE)
    code = (
        "import importlib.util, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('transformers', 'fastplms'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"spec = importlib.util.spec_from_file_location('r', {path!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(m.esmc_panel().input_ids.shape)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
