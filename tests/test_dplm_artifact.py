"""DPLM artifacts: `fastplms build dplm_150m --snapshot <airkingbd layout>`, a fresh-process load, the CLI.

The snapshot is a seeded stand-in for `airkingbd/dplm_150m` at its real dims (config.json with `dplm_type`,
model.safetensors with the official keys: the unused position table, no separate decoder), so the build
is unpinned. The artifact must load offline with the fastplms package unimportable, through every
AutoClass the manifest advertises, generate there, and give exactly what the source-tree model gives.
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
from fastplms.families.dplm import ADAPTER, read_snapshot
from fastplms.families.dplm_parity import build_dplm
from fastplms.manifest import MANIFEST_DIR, load_manifest
from fastplms.oracles.dplm import write_dplm_snapshot

pytestmark = pytest.mark.slow

FAMILY = load_manifest(MANIFEST_DIR / "dplm.toml", resolve=False)
CHECKPOINT = FAMILY.checkpoint("dplm_150m")

# Runs in a fresh offline process after fastplms is made unimportable (`run_fresh`).
FRESH = r"""
import sys
import torch, transformers
from safetensors.torch import load_file, save_file

artifact, inputs_file, out_file = sys.argv[1:4]
inputs = load_file(inputs_file)
out = {}
for backend in ("eager", "sdpa", "flex_attention"):
    model = transformers.AutoModelForMaskedLM.from_pretrained(
        artifact, trust_remote_code=True, attn_implementation=backend
    ).eval()
    with torch.no_grad():
        out[f"logits_{backend}"] = model(**inputs).logits
model.set_attn_implementation("sdpa")
input_ids, partial = model.generate_inputs([12, 7], template="MK_A")
torch.manual_seed(0)
out["generated"] = model.generate(input_ids, max_iter=4, partial_masks=partial)
tokenizer = transformers.AutoTokenizer.from_pretrained(artifact, trust_remote_code=True)
print("DECODED", tokenizer.batch_decode(out["generated"], skip_special_tokens=True))
base = transformers.AutoModel.from_pretrained(artifact, trust_remote_code=True).eval()
with torch.no_grad():
    out["last_hidden_state"] = base(**inputs).last_hidden_state
save_file({k: v.contiguous() for k, v in out.items()}, out_file)
"""


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    return write_dplm_snapshot(tmp_path_factory.mktemp("snapshots") / "dplm_150m", *CHECKPOINT.dims, seed=0)


@pytest.fixture(scope="module")
def artifact(snapshot, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("artifacts") / "DPLM-150M"
    assert cli.main(["build", "dplm_150m", "--snapshot", str(snapshot), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def source_model(snapshot):
    _source, _files, state = read_snapshot(snapshot, FAMILY, CHECKPOINT)
    return build_dplm(state, CHECKPOINT)


def test_artifact_files_config_and_card(artifact) -> None:
    config = json.loads((artifact / "config.json").read_text())
    assert set(config["auto_map"]) == set(FAMILY.auto_classes)
    assert config["allowed_backends"] == ["eager", "sdpa", "flex_attention", "flash_attention_3"]
    assert config["model_type"] == "fastplms_dplm" and config["family"] == "DPLM"
    shipped = {p.name for p in artifact.glob("*.py")}
    assert {"modeling_dplm.py", "modeling_esm2.py", "diffusion.py", "tokenization_esm.py"} <= shipped
    card = (artifact / "README.md").read_text()
    assert "license: apache-2.0" in card.lower() and "generate" in card
    record = json.loads((artifact / PROVENANCE).read_text())
    assert record["family"] == "dplm" and record["transform"] == "dplm-v1" and not record["official_weights"]
    assert record["source"]["repo"] == "airkingbd/dplm_150m"


def test_verify_loads_every_auto_class(artifact) -> None:
    problems, report = verify(artifact)
    assert problems == []
    assert set(report["auto_classes"]) == set(FAMILY.auto_classes) - {"AutoConfig"}


def test_fresh_process_equals_the_source_model(artifact, source_model, tmp_path) -> None:
    inputs = ADAPTER.example_inputs(artifact)
    inputs_file, out_file = tmp_path / "inputs.safetensors", tmp_path / "out.safetensors"
    save_file(inputs, str(inputs_file))
    result = run_fresh(FRESH, artifact, inputs_file, out_file, tmp_path=tmp_path)
    assert "DECODED ['MK" in result.stdout
    fresh = load_file(str(out_file))
    model = source_model
    with torch.no_grad():
        for backend in ("eager", "sdpa", "flex_attention"):
            model.set_attn_implementation(backend)
            assert torch.equal(model(**inputs).logits, fresh[f"logits_{backend}"]), backend
        model.set_attn_implementation("sdpa")
        assert torch.equal(model.esm(**inputs).last_hidden_state, fresh["last_hidden_state"])
    input_ids, partial = model.generate_inputs([12, 7], template="MK_A")
    torch.manual_seed(0)
    assert torch.equal(model.generate(input_ids, max_iter=4, partial_masks=partial), fresh["generated"])


def test_cli_generate_writes_fasta(artifact, source_model, tmp_path, capsys) -> None:
    out = tmp_path / "designs.fasta"
    argv = ["generate", "--model", str(artifact), "--out", str(out), "--length", "15", "--length", "9"]
    argv += ["--num-seqs", "2", "--steps", "3", "--seed", "7", "--template", "M_K", "--batch-size", "3"]
    assert cli.main(argv) == 0
    lines = out.read_text().splitlines()
    headers, sequences = lines[0::2], lines[1::2]
    assert [len(s) for s in sequences] == [15, 15, 9, 9]
    assert all(s[0] == "M" and s[2] == "K" for s in sequences)
    assert headers[0].startswith(">generated_0 length=15 steps=3 strategy=gumbel_argmax seed=7")
    # Seeded random weights emit the rare tokens the official sampler allows; the header counts them.
    odd = [sum(not c.isalpha() or c == "X" for c in s) for s in sequences]
    assert [int(h.split("nonresidue=")[1]) if "nonresidue=" in h else 0 for h in headers] == odd
    # The same batches and generator as the command: identical sequences.
    generator = torch.Generator().manual_seed(7)
    expected = []
    for batch in ([15, 15, 9], [9]):
        input_ids, partial = source_model.generate_inputs(batch, template="M_K")
        tokens = source_model.generate(input_ids, max_iter=3, partial_masks=partial, generator=generator)
        for row, length in zip(tokens.tolist(), batch, strict=True):
            chars = [source_model.vocabulary[t] for t in row[1 : length + 1]]
            expected.append("".join(c if len(c) == 1 else "X" for c in chars))  # <unk>, <null_1>: X
    assert sequences == expected
    capsys.readouterr()
    assert cli.main(argv) == 2  # exists: refused, nothing lost
    assert "--overwrite" in capsys.readouterr().err
    assert out.read_text().splitlines() == lines
    bad = ["generate", "--model", str(artifact), "--out", str(tmp_path / "x.fasta"), "--length", "2"]
    assert cli.main([*bad, "--template", "MKT"]) == 2
    assert "longer than the requested length 2" in capsys.readouterr().err
    assert cli.main([*bad, "--steps", "0"]) == 2
    assert "max_iter" in capsys.readouterr().err
    assert not (tmp_path / "x.fasta").exists()


def test_cli_embed(artifact, source_model, tmp_path) -> None:
    from fastplms.embedding import read_embeddings

    fasta = tmp_path / "queries.fasta"
    fasta.write_text(">a\nMKTAYIAKQRQISFV\n>b\nMLV\n")
    out = tmp_path / "emb.db"
    assert cli.main(["embed", str(fasta), "--model", str(artifact), "--out", str(out)]) == 0
    stored = read_embeddings(out).stack("mean")
    with torch.no_grad():
        for i, query in enumerate(["MKTAYIAKQRQISFV", "MLV"]):
            ids = torch.tensor([[0, *[source_model.vocabulary.index(c) for c in query], 2]])
            want = source_model.esm(input_ids=ids).last_hidden_state[0, 1:-1].mean(0)
            torch.testing.assert_close(stored[i], want, rtol=1e-5, atol=1e-5)
