"""ESM2's adapter: fair-esm `.pt` or `facebook/esm2_*` snapshots, the ESM2 config, its tokenizer."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from ..artifact.snapshot import BuildError, read_hub_weights, require
from ..configuration_esm2 import ESM2Config
from ..convert.common import load_weights
from ..convert.esm2 import from_fair_esm, from_transformers
from ..manifest import Checkpoint, Family, Source
from ..tokenization_esm import ESM2_VOCAB
from . import esm2_parity
from .adapter import TOKENIZED_MLM_USAGE, FamilyAdapter, Parity, Tokenizer, manifest_config, tokenized_inputs

# Encoded by verify in the fresh process: a plain protein and a short one, so the batch is padded.
VERIFY_SEQUENCES = ("MKTAYIAKQRQISFVKSHFSRQ", "MLV")


def read_snapshot(
    snapshot: Path, family: Family, checkpoint: Checkpoint
) -> tuple[Source, dict[str, Path], dict[str, torch.Tensor]]:
    """A fair-esm `.pt` (with its contact regression) when present, else a Transformers snapshot."""
    fair = checkpoint.source("fair-esm")
    if (snapshot / fair.file).is_file():
        stem = Path(fair.file).stem
        files = require(snapshot, [fair.file, f"{stem}-contact-regression.pt"], "fair-esm layout")
        state = load_weights(files[fair.file])
        contact = load_weights(files[f"{stem}-contact-regression.pt"])
        return fair, files, from_fair_esm(state, checkpoint.num_heads, contact)
    source = checkpoint.source("transformers")
    if not (snapshot / "config.json").is_file():
        raise BuildError(
            f"snapshot {snapshot} is neither a Transformers snapshot of {source.repo} (config.json) nor a "
            f"fair-esm checkpoint ({fair.file})"
        )
    config = json.loads((snapshot / "config.json").read_text())
    expected = {
        "num_hidden_layers": checkpoint.num_layers,
        "hidden_size": checkpoint.hidden_size,
        "num_attention_heads": checkpoint.num_heads,
        "vocab_size": len(ESM2_VOCAB),
    }
    wrong = [f"{k} is {config.get(k)!r}, expected {v}" for k, v in expected.items() if config.get(k) != v]
    if wrong:
        raise BuildError(f"snapshot config.json does not match {checkpoint.id}: {'; '.join(wrong)}")
    files, state = read_hub_weights(snapshot, ("safetensors", "bin"))
    return source, {"config.json": snapshot / "config.json", **files}, from_transformers(state, checkpoint.num_heads)


ADAPTER = FamilyAdapter(
    read_snapshot=read_snapshot,
    make_config=functools.partial(manifest_config, ESM2Config),
    pretrained_auto_class="AutoModelForMaskedLM",
    example_inputs=tokenized_inputs(VERIFY_SEQUENCES),
    # 1024 residues plus <cls> and <eos>: the length ESM2 was trained on (its position limit).
    tokenizer=Tokenizer("tokenization_esm", ESM2_VOCAB, 1026, VERIFY_SEQUENCES),
    usage=TOKENIZED_MLM_USAGE,
    parity=Parity(esm2_parity.measure_report, esm2_parity.versions),
)
