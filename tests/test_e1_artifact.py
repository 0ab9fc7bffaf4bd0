"""Profluent-E1 artifacts: `fastplms build e1_150m --snapshot <Hub layout>` and a fresh-process load.

The snapshot is a seeded stand-in for `Profluent-Bio/E1-150m` at its real dims (config.json with the official
E1Config fields, model.safetensors with the official keys in bfloat16), so the build is unpinned. The artifact
must load offline, with the fastplms package unimportable, through every AutoClass the manifest advertises,
and give exactly what the source-tree model built from the same snapshot gives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fresh_process import run_fresh
from safetensors.torch import load_file, save_file

from fastplms import cli
from fastplms.artifact.build import PROVENANCE
from fastplms.artifact.verify import verify
from fastplms.families.e1 import example_inputs, make_config, read_snapshot
from fastplms.manifest import MANIFEST_DIR, load_manifest
from fastplms.modeling_e1 import E1ForMaskedLM, E1Model
from fastplms.oracles.e1 import e1_dims, write_e1_snapshot

pytestmark = pytest.mark.slow

FAMILY = load_manifest(MANIFEST_DIR / "e1.toml", resolve=False)
CHECKPOINT = FAMILY.checkpoint("e1_150m")

# Runs in a fresh offline process after fastplms is made unimportable (`run_fresh`).
FRESH = r"""
import sys
import torch, transformers
from safetensors.torch import load_file, save_file

artifact, inputs_file, out_file = sys.argv[1:4]
inputs = load_file(inputs_file)
out = {}
for backend in ("eager", "sdpa"):
    model = transformers.AutoModelForMaskedLM.from_pretrained(
        artifact, trust_remote_code=True, attn_implementation=backend
    ).eval()
    with torch.no_grad():
        out[f"logits_{backend}"] = model(**inputs).logits
    prepared = model.prepare_inputs(["MKTAYIAKQRQ?SFVKSHFSRQ", "MLV"], [["MKSAYIAKQRQLSFVKSHF"], []])
    assert all(torch.equal(prepared[k], inputs[k]) for k in inputs), "prepare_inputs differs in the artifact"
base = transformers.AutoModel.from_pretrained(artifact, trust_remote_code=True).eval()
with torch.no_grad():
    out["last_hidden_state"] = base(**inputs).last_hidden_state
save_file({k: v.contiguous() for k, v in out.items()}, out_file)
"""


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    return write_e1_snapshot(tmp_path_factory.mktemp("snapshots") / "E1-150m", e1_dims("e1_150m"))


@pytest.fixture(scope="module")
def artifact(snapshot, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("artifacts") / "Profluent-E1-150M"
    assert cli.main(["build", "e1_150m", "--snapshot", str(snapshot), "--out", str(out)]) == 0
    return out


def test_artifact_files_config_and_card(artifact) -> None:
    config = json.loads((artifact / "config.json").read_text())
    assert set(config["auto_map"]) == set(FAMILY.auto_classes)
    assert config["allowed_backends"] == ["eager", "sdpa", "flex_attention"]
    assert (config["num_key_value_heads"], config["rope_theta_global"], config["intermediate_size"]) == (
        12,
        500000.0,
        2304,
    )
    assert {"modeling_e1.py", "configuration_e1.py", "attention.py", "plm_base.py", "rotary.py"} <= {
        p.name for p in artifact.glob("*.py")
    }
    assert not (artifact / "tokenizer_config.json").exists()  # raw sequences: model.prepare_inputs
    card = (artifact / "README.md").read_text()
    assert "license: other" in card and f"license_link: {CHECKPOINT.license_link}" in card
    assert "Built with Profluent-E1" in card and "prepare_inputs" in card
    record = json.loads((artifact / PROVENANCE).read_text())
    assert record["family"] == "e1" and record["transform"] == "e1-v1" and not record["official_weights"]
    assert record["source"]["repo"] == "Profluent-Bio/E1-150m"


def test_verify_loads_every_auto_class(artifact) -> None:
    problems, report = verify(artifact)
    assert problems == []
    assert set(report["auto_classes"]) == set(FAMILY.auto_classes) - {"AutoConfig"}


def test_fresh_process_equals_the_source_model(artifact, snapshot, tmp_path) -> None:
    inputs = example_inputs(artifact)
    inputs_file, out_file = tmp_path / "inputs.safetensors", tmp_path / "out.safetensors"
    save_file(inputs, str(inputs_file))
    run_fresh(FRESH, artifact, inputs_file, out_file, tmp_path=tmp_path)
    fresh = load_file(str(out_file))
    _source, _files, state = read_snapshot(snapshot, FAMILY, CHECKPOINT)
    config = make_config(FAMILY, CHECKPOINT)
    with torch.device("meta"):
        model = E1ForMaskedLM(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    with torch.no_grad():
        for backend in ("eager", "sdpa"):
            model.set_attn_implementation(backend)
            assert torch.equal(model(**inputs).logits, fresh[f"logits_{backend}"]), backend
        base = E1Model(config)
        base.load_state_dict({k.removeprefix("e1."): v for k, v in state.items() if k.startswith("e1.")})
        assert torch.equal(base.eval()(**inputs).last_hidden_state, fresh["last_hidden_state"])


def test_cli_embed_with_and_without_a_context(artifact, snapshot, tmp_path) -> None:
    from fastplms.embedding import read_embeddings

    fasta = tmp_path / "queries.fasta"
    fasta.write_text(">a\nMKTAYIAKQRQISFV\n>b\nMLV\n")
    a3m = tmp_path / "homologs.a3m"
    a3m.write_text(">c0\nMKSAYIAKQRQLSF\n>c1\nMRT-AYlaKQ\n")
    stored = {}
    for name, extra in (("plain", []), ("context", ["--context", str(a3m)])):
        out = tmp_path / name
        assert cli.main(["embed", str(fasta), "--model", str(artifact), "--out", str(out), *extra]) == 0
        stored[name] = read_embeddings(out).stack("mean")
    _source, _files, state = read_snapshot(snapshot, FAMILY, CHECKPOINT)
    base = E1Model(make_config(FAMILY, CHECKPOINT))
    base.load_state_dict({k.removeprefix("e1."): v for k, v in state.items() if k.startswith("e1.")})
    base.eval()
    with torch.no_grad():
        for i, query in enumerate(["MKTAYIAKQRQISFV", "MLV"]):
            alone = base.prepare_inputs(query)
            after = base.prepare_inputs(query, ["MKSAYIAKQRQLSF", "MRTAYLAKQ"])
            start = after["input_ids"].shape[1] - len(query) - 2
            want_plain = base(**alone).last_hidden_state[0, 2 : 2 + len(query)].mean(0)
            want_context = base(**after).last_hidden_state[0, start : start + len(query)].mean(0)
            torch.testing.assert_close(stored["plain"][i], want_plain, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(stored["context"][i], want_context, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(stored["plain"], stored["context"])
