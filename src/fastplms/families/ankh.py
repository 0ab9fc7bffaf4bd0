"""ANKH's adapter: ElnaggarLab T5 snapshots, the ANKH config (fields the manifest leaves open read from the
snapshot), the snapshot's own tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..artifact.snapshot import BuildError, read_hub_weights, require
from ..configuration_ankh import ANKHConfig
from ..convert.ankh import from_transformers
from ..manifest import Checkpoint, Family, Source
from . import ankh_parity
from .adapter import FamilyAdapter, Parity, Tokenizer, manifest_config, tokenized_inputs

# Encoded by verify in the fresh process (padded batch); the decoder input is the start token and two residues.
VERIFY_SEQUENCES = ("MKTAYIAKQRQISFVKSHFSRQ", "MLV")
TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer_config.json", "special_tokens_map.json")

# Our config field <- Transformers' T5Config field.
T5_FIELDS = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "d_model",
    "num_attention_heads": "num_heads",
    "num_decoder_layers": "num_decoder_layers",
    "d_kv": "d_kv",
    "intermediate_size": "d_ff",
    "feed_forward_proj": "feed_forward_proj",
    "vocab_size": "vocab_size",
    "relative_attention_num_buckets": "relative_attention_num_buckets",
    "relative_attention_max_distance": "relative_attention_max_distance",
    "layer_norm_eps": "layer_norm_epsilon",
}

USAGE = """\
import torch
from transformers import AutoModel, AutoModelForSeq2SeqLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("<this repo>", trust_remote_code=True)
batch = tokenizer(["MKTAYIAKQRQISFVKSHFSRQ", "MLV"], padding=True, return_tensors="pt")  # residues + </s>
encoder = AutoModel.from_pretrained("<this repo>", trust_remote_code=True, attn_implementation="sdpa")
embeddings = encoder(**batch).last_hidden_state  # (2, 23, d); the last valid position is </s>

model = AutoModelForSeq2SeqLM.from_pretrained("<this repo>", trust_remote_code=True, attn_implementation="sdpa")
generated = model.generate(**batch, max_new_tokens=20, do_sample=False)  # Transformers' generate, cached

# embed a whole FASTA file (mean-pooled over residues; </s> excluded)
result = encoder.embed_dataset("proteins.fasta", pooling=("mean",))
"""


def snapshot_fields(snapshot: Path) -> dict:
    """Our config fields as the snapshot's T5 config.json states them (absent ones left out)."""
    files = require(snapshot, ["config.json"], "an ElnaggarLab T5 snapshot")
    official = json.loads(files["config.json"].read_text(encoding="utf-8"))
    fields = {ours: official[theirs] for ours, theirs in T5_FIELDS.items() if theirs in official}
    if "num_decoder_layers" not in fields and "num_layers" in official:
        fields["num_decoder_layers"] = official["num_layers"]  # T5Config's default: as deep as the encoder
    return fields


def snapshot_config(snapshot: Path, checkpoint: Checkpoint) -> dict:
    """The fields the manifest leaves to the snapshot (`from_snapshot`), each one required to be stated."""
    fields = snapshot_fields(snapshot)
    missing = [name for name in checkpoint.from_snapshot if name not in fields]
    if missing:
        raise BuildError(f"{checkpoint.id}: snapshot config.json does not state {missing}")
    return {name: fields[name] for name in checkpoint.from_snapshot}


def make_config(family: Family, checkpoint: Checkpoint, **from_snapshot) -> ANKHConfig:
    """The manifest's dims and fields, plus those read from the snapshot; a field left to a snapshot that is
    not given is an error (ANKHConfig's defaults are ankh-base's, which would be a silent guess)."""
    missing = sorted(set(checkpoint.from_snapshot) - set(from_snapshot))
    if missing:
        raise ValueError(f"{checkpoint.id}: {missing} are only known from the snapshot's config.json")
    return manifest_config(ANKHConfig, family, checkpoint, **family.checkpoint_config(checkpoint.id), **from_snapshot)


def read_snapshot(
    snapshot: Path, family: Family, checkpoint: Checkpoint
) -> tuple[Source, dict[str, Path], dict[str, torch.Tensor]]:
    """An ElnaggarLab snapshot: its T5 config must state what the manifest says; its weights are converted."""
    source = checkpoint.source("elnaggarlab")
    stated = snapshot_fields(snapshot)
    expected = make_config(family, checkpoint, **snapshot_config(snapshot, checkpoint)).to_dict()
    wrong = [
        f"{theirs} is {stated.get(ours, '<missing>')!r}, expected {expected[ours]!r}"
        for ours, theirs in T5_FIELDS.items()
        if stated.get(ours) != expected[ours]
    ]
    official = json.loads((snapshot / "config.json").read_text(encoding="utf-8"))
    if official.get("tie_word_embeddings", True) is not False:
        wrong.append("tie_word_embeddings is not false; ANKH's LM head is untied")
    if wrong:
        raise BuildError(f"snapshot config.json does not match {checkpoint.id}: {'; '.join(wrong)}")
    weight_files, state = read_hub_weights(snapshot, ("safetensors", "bin"))
    # The tokenizer files the artifact's tokenizer is made from are inputs too: hashed into the provenance.
    tokenizer = {name: snapshot / name for name in TOKENIZER_FILES if (snapshot / name).is_file()}
    if not {"tokenizer.json", "spiece.model"} & set(tokenizer):
        raise BuildError(f"snapshot {snapshot} has neither tokenizer.json nor spiece.model")
    inputs = {"config.json": snapshot / "config.json", **weight_files, **tokenizer}
    return source, inputs, from_transformers(state)


def example_inputs(artifact: Path) -> dict[str, torch.Tensor]:
    """The tokenized verify sequences, and a decoder input (start token, two residues) for the seq2seq class."""
    inputs = tokenized_inputs(VERIFY_SEQUENCES)(artifact)
    residues = inputs["input_ids"][:, :2]
    inputs["decoder_input_ids"] = torch.cat([torch.zeros_like(residues[:, :1]), residues], dim=1)
    return inputs


ADAPTER = FamilyAdapter(
    read_snapshot=read_snapshot,
    make_config=make_config,
    pretrained_auto_class="AutoModelForSeq2SeqLM",
    example_inputs=example_inputs,
    # No length limit of its own (relative positions): Transformers' "no limit" value.
    tokenizer=Tokenizer("tokenization_ankh", (), int(1e30), VERIFY_SEQUENCES, vocab_from_snapshot=True),
    parity=Parity(ankh_parity.measure_report, ankh_parity.versions),
    usage=USAGE,
    snapshot_config=snapshot_config,
)
