"""What the generic builder, verifier and parity driver ask of a family, and helpers adapters share.

Everything a family declares once for all its checkpoints (dims, backends, dtypes, AutoClasses) is in
its manifest; an adapter holds only what is code: how to read an official snapshot, how to make the
runtime config, how to write the tokenizer, what to feed the artifact's models, how to measure parity.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..manifest import Checkpoint, Family, Source
from ..parity.driver import ParityRun

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# (snapshot folder, family, checkpoint) -> (the source it matched, input files by name, our state dict)
SnapshotReader = Callable[[Path, Family, Checkpoint], tuple[Source, dict[str, Path], dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class Tokenizer:
    """The tokenizer an artifact ships, written by `<module>.tokenizer_files(folder, vocab, model_max_length)`."""

    module: str  # a runtime module; it ships beside the modeling modules
    vocab: tuple[str, ...]
    model_max_length: int
    # Sequences `verify` encodes with the artifact's AutoTokenizer in the fresh process; the ids must
    # equal the example inputs for every key both have.
    check: tuple[str, ...]
    # The vocabulary is the official snapshot's own files: `tokenizer_files(folder, snapshot, length)` is called.
    vocab_from_snapshot: bool = False


@dataclass(frozen=True)
class Parity:
    """A family's parity measurement, as `tools.measure_parity <family>` runs it."""

    measure: Callable[[ParityRun], None]  # fills run.records and run.notes
    versions: Callable[[], dict[str, str]]  # oracle and package versions the report records


@dataclass(frozen=True)
class FamilyAdapter:
    """One family's code for the generic builder (`artifact.build`), verifier and parity driver."""

    read_snapshot: SnapshotReader
    make_config: Callable[[Family, Checkpoint], PretrainedConfig]
    # The AutoClass whose model holds every checkpoint weight: config.json's `architectures`.
    pretrained_auto_class: str
    # Artifact folder -> the keyword tensors `verify` passes to every AutoClass's forward (a seq2seq
    # family adds its decoder inputs here).
    example_inputs: Callable[[Path], dict[str, torch.Tensor]]
    tokenizer: Tokenizer | None  # None: the family's models take no tokenizer (raw sequences)
    parity: Parity
    usage: str  # the model card's "Use" example, a Python snippet with "<this repo>" as the model path
    # A checkpoint's config fields the manifest leaves to the snapshot (`from_snapshot`): snapshot folder and
    # checkpoint -> {field: value}, read from the official config.json; make_config takes them as keywords.
    snapshot_config: Callable[[Path, Checkpoint], dict] | None = None


# The "Use" example of a masked-LM family with an AutoTokenizer.
TOKENIZED_MLM_USAGE = """\
from transformers import AutoModelForMaskedLM, AutoTokenizer

model = AutoModelForMaskedLM.from_pretrained("<this repo>", trust_remote_code=True, attn_implementation="sdpa")
tokenizer = AutoTokenizer.from_pretrained("<this repo>", trust_remote_code=True)
batch = tokenizer(["MKTAYIAKQRQISFVKSHFSRQ"], return_tensors="pt")
logits = model(**batch).logits
model.set_attn_implementation("flex_attention")  # switch backends at runtime

# embed a whole FASTA file (mean-pooled, special tokens excluded)
result = model.embed_dataset("proteins.fasta", pooling=("mean",))
"""


def manifest_config(config_class: type, family: Family, checkpoint: Checkpoint, **fields) -> PretrainedConfig:
    """A runtime config as the manifest says: the checkpoint's dims, the family's backends, dtypes and BF16
    policy (baked into every artifact's config.json), plus family-specific `fields`."""
    return config_class(
        hidden_size=checkpoint.hidden_size,
        num_hidden_layers=checkpoint.num_layers,
        num_attention_heads=checkpoint.num_heads,
        allowed_backends=list(family.backends),
        allowed_dtypes=list(family.dtypes),
        bf16_policy=family.bf16,
        family=family.name,
        # Only where the manifest gives reasons, so other families' configs stay as they were.
        **({"unsupported_backends": dict(family.unsupported)} if family.unsupported else {}),
        **fields,
    )


def entry_modules(family: Family, adapter: FamilyAdapter) -> set[str]:
    """Runtime modules an artifact of `family` is built from: AutoClass targets and the tokenizer module."""
    modules = {target.split(".")[0] for target in family.auto_classes.values()}
    return modules | ({adapter.tokenizer.module} if adapter.tokenizer else set())


def tokenized_inputs(sequences: Sequence[str]) -> Callable[[Path], dict[str, torch.Tensor]]:
    """Example inputs: `sequences` encoded (padded) by the source-tree class of the artifact's AutoTokenizer."""

    def encode(artifact: Path) -> dict[str, torch.Tensor]:
        config = json.loads((artifact / "tokenizer_config.json").read_text(encoding="utf-8"))
        slow, fast = config["auto_map"]["AutoTokenizer"]
        module, name = (slow or fast).split(".")
        tokenizer = getattr(importlib.import_module(f"fastplms.{module}"), name).from_pretrained(str(artifact))
        return dict(tokenizer(list(sequences), padding=True, return_tensors="pt"))

    return encode
