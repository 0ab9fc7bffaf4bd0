"""ANKH artifacts: `fastplms build ankh_base --snapshot <ElnaggarLab layout>` at real dims, a fresh-process load.

The snapshot is a seeded stand-in for `ElnaggarLab/ankh-base` (T5 config.json as 4.x saved it, Transformers'
T5 keys with the embedding copies, a reconstructed v1 tokenizer.json), so the build is unpinned. The artifact
must load offline with fastplms unimportable through every AutoClass, tokenize raw residues, embed, generate
with Transformers' `generate`, and give exactly what the source-tree model built from the same snapshot gives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fresh_process import run_fresh
from safetensors.torch import load_file

from fastplms import cli
from fastplms.artifact.build import PROVENANCE
from fastplms.artifact.verify import verify
from fastplms.families import adapter_for
from fastplms.families.ankh_parity import ankh_family, build_ankh, checkpoint_dims
from fastplms.oracles.t5 import t5_oracle, t5_state_dict, write_ankh_snapshot

pytestmark = pytest.mark.slow

FAMILY = ankh_family()
CHECKPOINT = FAMILY.checkpoint("ankh_base")
DIMS = checkpoint_dims(CHECKPOINT, FAMILY)

FRESH = r"""
import torch, transformers
from safetensors.torch import save_file

artifact, out_file = sys.argv[1:3]
tokenizer = transformers.AutoTokenizer.from_pretrained(artifact, trust_remote_code=True)
batch = tokenizer(["MKTAYIAKQRQISFVKSHFSRQ", "MLV"], padding=True, return_tensors="pt")
out = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
encoder = transformers.AutoModel.from_pretrained(artifact, trust_remote_code=True, attn_implementation="sdpa").eval()
with torch.no_grad():
    out["embeddings"] = encoder(**batch).last_hidden_state
model = transformers.AutoModelForSeq2SeqLM.from_pretrained(artifact, trust_remote_code=True).eval()
with torch.no_grad():
    out["generated"] = model.generate(**batch, max_new_tokens=5, do_sample=False)
result = encoder.embed_dataset({"a": "MKTAYIAKQRQISFVKSHFSRQ", "b": "MLV"}, pooling=("mean",))
out["pooled"] = result.stack("mean")
save_file({k: v.contiguous() for k, v in out.items()}, out_file)
"""


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    return write_ankh_snapshot(tmp_path_factory.mktemp("snapshots") / "ankh_base", DIMS, generation="v1")


@pytest.fixture(scope="module")
def artifact(snapshot, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("artifacts") / "ANKH-base"
    assert cli.main(["build", "ankh_base", "--snapshot", str(snapshot), "--out", str(out)]) == 0
    return out


def test_artifact_files_config_and_card(artifact) -> None:
    config = json.loads((artifact / "config.json").read_text())
    assert set(config["auto_map"]) == set(FAMILY.auto_classes)
    assert config["allowed_backends"] == ["eager", "sdpa"] and config["feed_forward_proj"] == "gated-gelu"
    assert (config["num_hidden_layers"], config["num_decoder_layers"], config["d_kv"]) == (48, 24, 64)
    shipped = {p.name for p in artifact.glob("*.py")}
    assert {"modeling_ankh.py", "configuration_ankh.py", "tokenization_ankh.py", "attention.py"} <= shipped
    record = json.loads((artifact / PROVENANCE).read_text())
    assert record["family"] == "ankh" and record["transform"] == "ankh-v1" and not record["official_weights"]
    assert "tokenizer.json" in record["inputs"]  # the official tokenizer file is an input, hashed
    card = (artifact / "README.md").read_text()
    assert "cc-by-nc-sa-4.0" in card.lower() and "AutoModelForSeq2SeqLM" in card


def test_verify_loads_every_auto_class(artifact) -> None:
    problems, report = verify(artifact)
    assert problems == []
    assert set(report["auto_classes"]) == set(FAMILY.auto_classes) - {"AutoConfig"}
    assert report["tokenizer"]["matches_inputs"]


def test_fresh_process_equals_the_source_model_and_transformers(artifact, snapshot, tmp_path) -> None:
    out_file = tmp_path / "out.safetensors"
    run_fresh(FRESH, artifact, out_file, tmp_path=tmp_path)
    fresh = load_file(str(out_file))
    ids, mask = fresh["input_ids"], fresh["attention_mask"]
    assert ids[1].tolist()[:4] == [19, 4, 6, 1]  # M L V </s> in ANKH's v1 numbering, no leading <unk>
    _source, _files, state = adapter_for(FAMILY).read_snapshot(snapshot, FAMILY, CHECKPOINT)
    official = t5_state_dict(DIMS, seed=0, with_embed_copies=True)
    model = build_ankh(official, DIMS)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        assert torch.equal(model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state, fresh["embeddings"])
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5), fresh["generated"])
        oracle = t5_oracle(DIMS, official)
        assert torch.equal(oracle.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5), fresh["generated"])
        reference = oracle.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(fresh["embeddings"], reference, rtol=0, atol=1e-4)
    for row, n in enumerate((22, 3)):  # embed_dataset: mean over residues, </s> and padding left out
        torch.testing.assert_close(fresh["pooled"][row], fresh["embeddings"][row, :n].mean(0), rtol=1e-5, atol=1e-5)


def test_cli_embed(artifact, tmp_path) -> None:
    from fastplms.embedding import read_embeddings

    fasta = tmp_path / "queries.fasta"
    fasta.write_text(">a\nMKTAYIAKQRQISFVKSHFSRQ\n>b\nMLV\n")
    out = tmp_path / "emb.db"
    assert cli.main(["embed", str(fasta), "--model", str(artifact), "--out", str(out)]) == 0
    stored = read_embeddings(out).stack("mean")
    official = t5_state_dict(DIMS, seed=0, with_embed_copies=True)
    oracle = t5_oracle(DIMS, official)
    ids = torch.tensor([[19, 4, 6, 1]])  # M L V </s>
    with torch.no_grad():
        want = oracle.encoder(input_ids=ids).last_hidden_state[0, :3].mean(0)
    torch.testing.assert_close(stored[1], want, rtol=0, atol=1e-4)
