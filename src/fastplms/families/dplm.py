"""DPLM's adapter: airkingbd `EsmForDPLM` snapshots, the DPLM config, ESM2's tokenizer."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from ..artifact.snapshot import BuildError, read_hub_weights, require
from ..configuration_dplm import DPLMConfig
from ..convert.dplm import from_byprot
from ..manifest import Checkpoint, Family, Source
from ..tokenization_esm import ESM2_VOCAB
from . import dplm_parity
from .adapter import FamilyAdapter, Parity, Tokenizer, manifest_config, tokenized_inputs

VERIFY_SEQUENCES = ("MKTAYIAKQRQISFVKSHFSRQ", "MLV")

USAGE = """\
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

model = AutoModelForMaskedLM.from_pretrained("<this repo>", trust_remote_code=True, attn_implementation="sdpa")
tokenizer = AutoTokenizer.from_pretrained("<this repo>", trust_remote_code=True)
batch = tokenizer(["MKTAYIAKQRQISFVKSHFSRQ"], return_tensors="pt")
logits = model(**batch).logits

# generate: 4 proteins of 100 residues in 100 denoising steps, seeded
input_ids, partial_masks = model.generate_inputs([100] * 4)  # or a template: generate_inputs(template="MK__A___")
torch.manual_seed(0)
tokens = model.generate(input_ids, max_iter=100, partial_masks=partial_masks)
proteins = tokenizer.batch_decode(tokens, skip_special_tokens=True)

# embed a whole FASTA file (mean-pooled, special tokens excluded)
result = model.embed_dataset("proteins.fasta", pooling=("mean",))
"""


def byprot_reader(dplm_type: str, vocab_size: int, *, tied: bool):
    """The snapshot reader of an airkingbd ByProt family: config.json (its `dplm_type`, the checkpoint's dims,
    ESM2's other architecture fields) and its weights, converted by `convert.dplm.from_byprot`."""

    def read_snapshot(
        snapshot: Path, family: Family, checkpoint: Checkpoint
    ) -> tuple[Source, dict[str, Path], dict[str, torch.Tensor]]:
        source = checkpoint.source("byprot")
        files = require(snapshot, ["config.json"], f"a ByProt snapshot of {source.repo}")
        config = json.loads(files["config.json"].read_text(encoding="utf-8"))
        expected = {
            "dplm_type": dplm_type,
            "vocab_size": vocab_size,
            "num_hidden_layers": checkpoint.num_layers,
            "hidden_size": checkpoint.hidden_size,
            "num_attention_heads": checkpoint.num_heads,
            "intermediate_size": 4 * checkpoint.hidden_size,
            "position_embedding_type": "rotary",
            "token_dropout": True,
            "emb_layer_norm_before": False,
            "mask_token_id": 32,
            "pad_token_id": 1,
            "max_position_embeddings": 1026,
        }
        wrong = [
            f"{key} is {config.get(key, '<missing>')!r}, expected {value!r}"
            for key, value in expected.items()
            if config.get(key) != value
        ]
        if config.get("tie_word_embeddings", True) is not tied:
            wrong.append(f"tie_word_embeddings is {config.get('tie_word_embeddings', True)!r}, expected {tied!r}")
        if wrong:
            raise BuildError(f"snapshot config.json does not match {checkpoint.id}: {'; '.join(wrong)}")
        weight_files, state = read_hub_weights(snapshot, ("safetensors", "bin"))
        converted = from_byprot(state, checkpoint.num_heads, tied=tied)
        return source, {"config.json": files["config.json"], **weight_files}, converted

    return read_snapshot


read_snapshot = byprot_reader("dplm_esm", len(ESM2_VOCAB), tied=True)


ADAPTER = FamilyAdapter(
    read_snapshot=read_snapshot,
    make_config=functools.partial(manifest_config, DPLMConfig),
    pretrained_auto_class="AutoModelForMaskedLM",
    example_inputs=tokenized_inputs(VERIFY_SEQUENCES),
    tokenizer=Tokenizer("tokenization_esm", ESM2_VOCAB, 1026, VERIFY_SEQUENCES),
    usage=USAGE,
    parity=Parity(dplm_parity.measure_report, dplm_parity.versions),
)
