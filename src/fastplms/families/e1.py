"""Profluent-E1's adapter: official Profluent-Bio Hub snapshots, the E1 config, raw-sequence inputs.

E1 has no tokenizer in our artifacts: its models take the official id tensors, which
`modeling_e1.prepare_e1_inputs` builds from raw sequences (and optional retrieval context).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..artifact.snapshot import BuildError, read_hub_weights, require
from ..configuration_e1 import E1Config
from ..convert.e1 import from_official, official_dims
from ..manifest import Checkpoint, Family, Source
from ..modeling_e1 import prepare_e1_inputs
from . import e1_parity
from .adapter import FamilyAdapter, Parity

USAGE = """\
from transformers import AutoModelForMaskedLM

model = AutoModelForMaskedLM.from_pretrained("<this repo>", trust_remote_code=True, attn_implementation="sdpa")
# E1 takes raw sequences: a query, optionally after homologous context sequences ("?" masks a residue)
batch = model.prepare_inputs(["MKTAYIAKQRQ?SFVKSHFSRQ"], context=[["MKSAYIAKQRQLSFVKSHF"]])
logits = model(**batch).logits  # float32, (batch, tokens, 34)
model.set_attn_implementation("flex_attention")  # switch backends at runtime
"""

# Fed by verify to every AutoClass in the fresh process: a retrieval row (one context sequence and a query
# with a '?' mask) and a short single-sequence row, so the batch has several sequences per row and padding.
VERIFY_QUERIES = ("MKTAYIAKQRQ?SFVKSHFSRQ", "MLV")
VERIFY_CONTEXTS = (("MKSAYIAKQRQLSFVKSHF",), ())


def example_inputs(_artifact: Path) -> dict[str, torch.Tensor]:
    return prepare_e1_inputs(list(VERIFY_QUERIES), [list(c) for c in VERIFY_CONTEXTS])


def make_config(family: Family, checkpoint: Checkpoint) -> E1Config:
    return e1_parity.e1_config(family, checkpoint)


def read_snapshot(
    snapshot: Path, family: Family, checkpoint: Checkpoint
) -> tuple[Source, dict[str, Path], dict[str, torch.Tensor]]:
    """A Profluent-Bio Hub snapshot: config.json (the official E1Config) and model.safetensors."""
    source = checkpoint.source("profluent")
    files = require(snapshot, ["config.json"], f"a Profluent snapshot of {source.repo}")
    official = json.loads(files["config.json"].read_text(encoding="utf-8"))
    # Every architecture field of ours must be stated by the snapshot and equal: a missing one would mean
    # the official code's default, which for several fields is not a released checkpoint's value.
    expected = make_config(family, checkpoint).to_dict()
    fields = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "gated_mlp",
        "rms_norm_eps",
        "global_attention_every_n_layers",
        "max_num_sequences",
        "max_num_positions_within_seq",
        "max_num_positions_global",
        "rope_theta_within_seq",
        "rope_theta_global",
        "clip_qkv",
    ]
    wrong = [
        f"{name} is {official.get(name, '<missing>')!r}, expected {expected[name]!r}"
        for name in fields
        if official.get(name) != expected[name]
    ]
    if wrong:
        raise BuildError(f"snapshot config.json does not match {checkpoint.id}: {'; '.join(wrong)}")
    weight_files, raw = read_hub_weights(snapshot, ("safetensors",))
    dims = official_dims(raw, checkpoint.num_heads)
    want = {
        "num_layers": checkpoint.num_layers,
        "hidden_size": checkpoint.hidden_size,
        "num_kv_heads": expected["num_key_value_heads"],
        "intermediate_size": expected["intermediate_size"],
        "vocab_size": expected["vocab_size"],
        "max_num_sequences": expected["max_num_sequences"],
    }
    mismatch = [f"{k} {dims[k]} (expected {v})" for k, v in want.items() if dims[k] != v]
    if mismatch:
        raise BuildError(f"snapshot weights do not fit {checkpoint.id}: {'; '.join(mismatch)}")
    return source, {"config.json": files["config.json"], **weight_files}, from_official(raw, checkpoint.num_heads)


ADAPTER = FamilyAdapter(
    read_snapshot=read_snapshot,
    make_config=make_config,
    pretrained_auto_class="AutoModelForMaskedLM",
    example_inputs=example_inputs,
    tokenizer=None,
    parity=Parity(e1_parity.measure_report, e1_parity.versions),
    usage=USAGE,
)
