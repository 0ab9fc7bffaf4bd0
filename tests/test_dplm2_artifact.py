"""DPLM2 artifacts: `fastplms build dplm2_150m --snapshot <airkingbd layout>`, a fresh-process load.

The snapshot is a seeded stand-in for `airkingbd/dplm2_150m` at its real dims (config.json with `dplm_type`
"dplm2_esm", the official keys with the untied decoder and the unused position table, the reconstructed
vocab.txt), so the build is unpinned. The artifact must load offline with the fastplms package unimportable,
through every AutoClass, tokenize packed rows, generate, refuse other backends, and equal the source model.
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
from fastplms.families.dplm2_parity import build_dplm2
from fastplms.manifest import MANIFEST_DIR, load_manifest
from fastplms.oracles.dplm2 import write_dplm2_snapshot

pytestmark = pytest.mark.slow

FAMILY = load_manifest(MANIFEST_DIR / "dplm2.toml", resolve=False)
CHECKPOINT = FAMILY.checkpoint("dplm2_150m")
ADAPTER = adapter_for(FAMILY)

# Runs in a fresh offline process after fastplms is made unimportable (`run_fresh`).
FRESH = r"""
import sys
import torch, transformers
from safetensors.torch import save_file

artifact, out_file = sys.argv[1:3]
tokenizer = transformers.AutoTokenizer.from_pretrained(artifact, trust_remote_code=True)
batch = tokenizer.pack(structures=["0012,0451,8191", "0007"], sequences=["MKT", "A"], return_tensors="pt")
model = transformers.AutoModelForMaskedLM.from_pretrained(artifact, trust_remote_code=True).eval()
try:
    model.set_attn_implementation("eager")
except ValueError as error:
    print("REFUSED", error)
out = {"input_ids": batch["input_ids"]}
with torch.no_grad():
    out["logits"] = model(**batch).logits
ids, fixed = model.generate_inputs(sequences=["MKTAY"])
torch.manual_seed(0)
out["folded"] = model.generate(ids, max_iter=3, partial_masks=fixed)
half = out["folded"].shape[1] // 2  # a packed row: the structure track, then the amino acids
print("STRUCTURE", tokenizer.decode_structure(out["folded"][0, :half]))
base = transformers.AutoModel.from_pretrained(artifact, trust_remote_code=True).eval()
with torch.no_grad():
    out["last_hidden_state"] = base(input_ids=batch["input_ids"]).last_hidden_state
save_file({k: v.contiguous() for k, v in out.items()}, out_file)
"""


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    return write_dplm2_snapshot(tmp_path_factory.mktemp("snapshots") / "dplm2_150m", *CHECKPOINT.dims, seed=0)


@pytest.fixture(scope="module")
def artifact(snapshot, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("artifacts") / "DPLM2-150M"
    assert cli.main(["build", "dplm2_150m", "--snapshot", str(snapshot), "--out", str(out)]) == 0
    return out


def test_artifact_files_config_and_card(artifact) -> None:
    config = json.loads((artifact / "config.json").read_text())
    assert set(config["auto_map"]) == set(FAMILY.auto_classes)
    assert config["allowed_backends"] == ["sdpa"] and config["vocab_size"] == 8229
    assert "0.01 target" in config["unsupported_backends"]["eager"]
    shipped = {p.name for p in artifact.glob("*.py")}
    assert {"modeling_dplm2.py", "modeling_dplm.py", "diffusion.py", "tokenization_dplm2.py"} <= shipped
    assert len((artifact / "vocab.txt").read_text().splitlines()) == 8229
    record = json.loads((artifact / PROVENANCE).read_text())
    assert record["family"] == "dplm2" and record["transform"] == "dplm2-v1"


def test_verify_loads_every_auto_class(artifact) -> None:
    problems, report = verify(artifact)
    assert problems == []
    assert set(report["auto_classes"]) == set(FAMILY.auto_classes) - {"AutoConfig"}


def test_fresh_process_equals_the_source_model(artifact, snapshot, tmp_path) -> None:
    out_file = tmp_path / "out.safetensors"
    result = run_fresh(FRESH, artifact, out_file, tmp_path=tmp_path)
    assert "REFUSED" in result.stdout and "0.01 target" in result.stdout
    fresh = load_file(str(out_file))
    _source, _files, state = ADAPTER.read_snapshot(snapshot, FAMILY, CHECKPOINT)
    model = build_dplm2(state, CHECKPOINT)
    ids = fresh["input_ids"]
    assert ids.tolist()[1] == [33, 43, 34, 1, 1, 0, 5, 2, 1, 1]  # packed: each track padded to its longest
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, fresh["logits"])
        assert torch.equal(model.esm(input_ids=ids).last_hidden_state, fresh["last_hidden_state"])
    input_ids, fixed = model.generate_inputs(sequences=["MKTAY"])
    torch.manual_seed(0)
    assert torch.equal(model.generate(input_ids, max_iter=3, partial_masks=fixed), fresh["folded"])
    assert "STRUCTURE " in result.stdout and len(result.stdout.split("STRUCTURE ")[1].split(",")) == 5
