"""ESMC's (ESM++) adapter: EvolutionaryScale `esm` or Biohub snapshots, the ESMC config, its tokenizer."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from ..artifact.snapshot import BuildError, read_hub_weights
from ..configuration_esmc import ESMCConfig
from ..convert.common import load_weights
from ..convert.esmc import VOCAB_ROWS, dims, from_biohub, from_esm
from ..manifest import Checkpoint, Family, Source
from ..tokenization_esm import ESMC_VOCAB
from . import esmc_parity
from .adapter import TOKENIZED_MLM_USAGE, FamilyAdapter, Parity, Tokenizer, manifest_config, tokenized_inputs

# Encoded by verify in the fresh process: two chains joined by "|" and a short protein (padded batch).
VERIFY_SEQUENCES = ("MKTAYIAKQR|QISFVKSHFSRQ", "MLV")
# Names Hub configs use for ESMC's dimensions: the Transformers port has used both spellings.
_CONFIG_DIMS = {
    "num_layers": ("n_layers", "num_hidden_layers"),
    "hidden_size": ("d_model", "hidden_size"),
    "num_heads": ("n_heads", "num_attention_heads"),
}


def read_snapshot(
    snapshot: Path, family: Family, checkpoint: Checkpoint
) -> tuple[Source, dict[str, Path], dict[str, torch.Tensor]]:
    """EvolutionaryScale `esm` layout (the .pth at the source's `file`) or a Biohub safetensors snapshot."""
    esm = next((s for s in checkpoint.sources if s.kind == "esm"), None)
    if esm is not None and (snapshot / esm.file).is_file():
        files = {esm.file: snapshot / esm.file}
        source, state = esm, from_esm(load_weights(files[esm.file]))
    else:
        biohub = next((s for s in checkpoint.sources if s.kind == "biohub"), None)
        if biohub is None or not (snapshot / "config.json").is_file():
            expected = [f"an esm snapshot of {esm.repo} ({esm.file})"] if esm is not None else []
            if biohub is not None:
                expected.append(f"a Biohub snapshot of {biohub.repo} (config.json + safetensors)")
            raise BuildError(f"snapshot {snapshot} is not {' nor '.join(expected) or 'a known ESMC layout'}")
        config = json.loads((snapshot / "config.json").read_text())
        wrong = []
        for attr, names in _CONFIG_DIMS.items():
            found = [(name, config[name]) for name in names if name in config]
            want = getattr(checkpoint, attr)
            wrong += [f"{name} is {value!r}, expected {want}" for name, value in found if value != want]
        if config.get("vocab_size", VOCAB_ROWS) != VOCAB_ROWS:
            wrong.append(f"vocab_size is {config['vocab_size']!r}, expected {VOCAB_ROWS}")
        if wrong:
            raise BuildError(f"snapshot config.json does not match {checkpoint.id}: {'; '.join(wrong)}")
        files, raw = read_hub_weights(snapshot, ("safetensors",))
        files = {"config.json": snapshot / "config.json", **files}
        source, state = biohub, from_biohub(raw)
    layers, hidden = dims(state)
    if (layers, hidden) != (checkpoint.num_layers, checkpoint.hidden_size):
        raise BuildError(
            f"snapshot weights have {layers} layers, hidden size {hidden}; {checkpoint.id} has "
            f"{checkpoint.num_layers} layers, hidden size {checkpoint.hidden_size}"
        )
    return source, files, state


ADAPTER = FamilyAdapter(
    read_snapshot=read_snapshot,
    make_config=functools.partial(manifest_config, ESMCConfig),
    pretrained_auto_class="AutoModelForMaskedLM",
    example_inputs=tokenized_inputs(VERIFY_SEQUENCES),
    # ESMC has no position limit (rotary only); 2048 tokens is the nominal length its Biohub configs
    # and hosted APIs use, and what the tokenizer truncates to when asked.
    tokenizer=Tokenizer("tokenization_esm", ESMC_VOCAB, 2048, VERIFY_SEQUENCES),
    usage=TOKENIZED_MLM_USAGE,
    parity=Parity(esmc_parity.measure_report, esmc_parity.versions),
)
