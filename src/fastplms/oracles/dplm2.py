"""Seeded DPLM2 (ByProt ``EsmForDPLM2``, airkingbd/dplm2_*) checkpoints in the official layout, the
in-environment network oracle, and the loader of the committed goldens.

What lives here, for parity tests of our DPLM2 network and sampler against the official bytedance/dplm code
(run by ``tools/goldens/dplm2.py`` from a folder outside this repository, never copied here):

- ``dplm2_official_spec`` / ``dplm2_official_state_dict``: key -> shape and seeded float32 tensors of what an
  airkingbd/dplm2_* ``model.safetensors`` holds: the Hugging Face Esm keys of ``esm2.hf_esm2_state_dict(...,
  vocab=8229, tie_decoder=False)`` (the same numbers for the same seed: reused, not redrawn; the decoder is
  untied, ``EsmForDPLM2.__init__`` forces ``tie_word_embeddings=False``), plus
  ``esm.embeddings.position_embeddings.weight`` (1026, d), which Transformers 4.39 builds even for rotary
  models and the forward never reads. ``dplm2_state_sha256`` is their fingerprint.
- ``write_dplm2_snapshot``: a folder laid out like the Hub's airkingbd/dplm2_150m (config.json with
  ``dplm_type`` "dplm2_esm", model.safetensors, the reconstructed vocab.txt), which the official
  ``MultimodalDiffusionProteinLanguageModel.from_pretrained`` loads.
- ``dplm2_transformers_network`` / ``run_dplm2_network``: the network oracle of
  ``shared/reference/families.md`` §3.6: Transformers 5.13 ``EsmForMaskedLM`` (vocab 8229, untied decoder,
  SDPA) holding the official state; the input embedded **twice** (the official wrapper embeds once and
  ``ModifiedEsmModel`` embeds its ``inputs_embeds`` again, so token dropout's rescale applies twice); and the
  official **batch-wide** split rotary as ``position_ids``: if the batch's ``type_ids`` hold both 1 (aa) and 0
  (struct), every row gets positions ``0..ceil(L/2)-1, 0..floor(L/2)-1``, otherwise ``0..L-1``.
- ``dplm2_goldens``: the committed goldens (``tests/goldens/dplm2_*``), hash-checked against their manifest.

Facts (key names, shapes, ids, config fields, the suppression list) were read off bytedance/dplm@8b3425b and
re-checked by the recipe against the official modules it runs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

# What the official sampler sets to -inf everywhere before choosing a token, in its order
# (MultimodalDiffusionProteinLanguageModel.special_token_list): the runtime's list, checked against the
# official one the goldens record.
from ..modeling_dplm2 import SUPPRESSED as SUPPRESSED_IDS
from ..tokenization_dplm2 import (
    AA_TRACK_SIZE,
    AA_TYPE,
    DPLM2_VOCAB,
    PAD_ID,
    PAD_TYPE,
    STRUCT_TYPE,
    VOCAB_SIZE,
    write_vocab,
)
from .dplm import (
    POSITION_TABLE_KEY,
    dplm_state_sha256,
    esm_config_from_json,
    official_config_json,
    official_spec,
    official_state_dict,
    official_transformers_network,
)

__all__ = [
    "DPLM2_VOCAB",
    "GOLDENS_DIR",
    "MANIFEST",
    "POSITION_TABLE_KEY",
    "SUPPRESSED_IDS",
    "dplm2_config_json",
    "dplm2_embed",
    "dplm2_esm_config",
    "dplm2_goldens",
    "dplm2_official_spec",
    "dplm2_official_state_dict",
    "dplm2_position_ids",
    "dplm2_state_sha256",
    "dplm2_transformers_network",
    "dplm2_type_ids",
    "run_dplm2_network",
    "write_dplm2_snapshot",
]

REPO_ROOT = Path(__file__).resolve().parents[3]
GOLDENS_DIR = REPO_ROOT / "tests" / "goldens"
MANIFEST = "dplm2_manifest.json"


def dplm2_official_spec(num_layers: int, hidden: int, heads: int) -> dict[str, tuple[int, ...]]:
    """Key -> shape of an official ``EsmForDPLM2`` state dict (and checkpoint file), in ``state_dict()`` order.

    ``hf_esm2_spec(vocab=8229)`` with the position table after the word embeddings (``EsmEmbeddings`` registers
    it after ``word_embeddings``) and ``lm_head.bias`` first within the head (a module's own parameters precede
    its children's). The untied ``lm_head.decoder.weight`` and the per-layer rotary ``inv_freq`` buffers (4.39
    persists them) are kept; ``esm.contact_head.regression`` is (1, L * H), e.g. 600 wide at 150m.
    """
    return official_spec(num_layers, hidden, heads, vocab=VOCAB_SIZE, tied=False)


def dplm2_official_state_dict(num_layers: int, hidden: int, heads: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded float32 weights under the official airkingbd/dplm2_* key names (``dplm2_official_spec`` order).

    Every tensor shared with ESM2 is ``hf_esm2_state_dict(..., vocab=8229, seed=seed, tie_decoder=False)``'s
    (same bytes; the decoder is drawn independently of the word embeddings); the position table is drawn by
    ``seeded_weights`` under its own key (N(0, 1/d), unused by the model).
    """
    return official_state_dict(num_layers, hidden, heads, seed=seed, vocab=VOCAB_SIZE, tied=False)


# The weights' fingerprint: sha256 over (key, shape, float32 bytes) of every tensor, in order.
dplm2_state_sha256 = dplm_state_sha256


def dplm2_config_json(num_layers: int, hidden: int, heads: int) -> dict[str, Any]:
    """config.json of an airkingbd/dplm2_* Hub snapshot at these dims: ``EsmForDPLM2``, ``dplm_type``
    "dplm2_esm", vocab 8229, untied embeddings, mask 32 (``<mask_aa>``), pad 1, 1026 positions, token dropout,
    rotary, eps 1e-5, train-time hidden dropout 0.1 (``EsmForDPLM2.__init__`` sets it), Transformers 4.39.2."""
    return official_config_json(
        num_layers, hidden, heads, architecture="EsmForDPLM2", dplm_type="dplm2_esm", vocab=VOCAB_SIZE, tied=False
    )


def dplm2_esm_config(num_layers: int, hidden: int, heads: int, **overrides: Any):
    """A Transformers ``EsmConfig`` carrying ``dplm2_config_json``'s values (bookkeeping fields dropped)."""
    return esm_config_from_json(dplm2_config_json(num_layers, hidden, heads), **overrides)


def write_dplm2_snapshot(
    folder: str | Path,
    num_layers: int,
    hidden: int,
    heads: int,
    *,
    seed: int = 0,
    state: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write a folder laid out like the Hub's airkingbd/dplm2_150m and return it.

    Files: config.json (``dplm2_config_json``), model.safetensors (``dplm2_official_state_dict``, or ``state``
    when given, e.g. already drawn; metadata ``{"format": "pt"}``) and vocab.txt (the reconstructed 8,229-token
    ``DPLM2_VOCAB``, which the official wrapper's ``DPLM2Tokenizer.from_pretrained`` reads).
    """
    from safetensors.torch import save_file

    directory = Path(folder)
    directory.mkdir(parents=True, exist_ok=True)
    if state is None:
        state = dplm2_official_state_dict(num_layers, hidden, heads, seed=seed)
    expected = dplm2_official_spec(num_layers, hidden, heads)
    if {k: tuple(v.shape) for k, v in state.items()} != expected:
        raise ValueError("state does not match dplm2_official_spec at these dims")
    save_file(dict(state), str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = dplm2_config_json(num_layers, hidden, heads)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_vocab(directory / "vocab.txt", DPLM2_VOCAB)
    return directory


def dplm2_transformers_network(
    snapshot_or_state: str | Path | Mapping[str, torch.Tensor], **config_overrides: Any
) -> torch.nn.Module:
    """The network oracle: Transformers ``EsmForMaskedLM`` (SDPA, untied decoder) holding an official DPLM2 state.

    ``snapshot_or_state`` is a folder from ``write_dplm2_snapshot`` (or a real airkingbd/dplm2 snapshot:
    config.json + model.safetensors) or a state dict in the official layout (dims read off its shapes).
    ``load_state_dict(strict=False)`` may only report the position table as unexpected (Transformers 5.13 keeps
    one rotary table on ``esm`` and maps the per-layer ``inv_freq`` keys itself; they are checked equal to it);
    anything else raises. Returned in ``eval()`` (the config's hidden dropout is 0.1), float32.
    """
    return official_transformers_network(
        snapshot_or_state,
        dplm2_config_json,
        config_overrides,
        family="DPLM2",
        tied=False,
        vocab=VOCAB_SIZE,
        tolerate_layer_inv_freq=True,
    )


def dplm2_type_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """The official modality types: 1 for ids < 33 that are not pad, 2 for pad, 0 for the rest."""
    valid = input_ids.ne(PAD_ID)
    types = ((input_ids < AA_TRACK_SIZE) & valid).long()
    return types.masked_fill(~valid, PAD_TYPE)


def dplm2_position_ids(type_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) rotary positions of the official ``ModifiedRotaryEmbedding``: batch-wide split or plain.

    If any row of the batch has an aa (1) and any row a struct (0) type, **every** row is split in two halves
    (``chunk(2)``: ceil(L/2), floor(L/2)) and each half counts from 0; otherwise positions are ``0..L-1``.
    """
    batch, length = type_ids.shape
    if bool((type_ids == AA_TYPE).any()) and bool((type_ids == STRUCT_TYPE).any()):
        first = (length + 1) // 2
        row = torch.cat([torch.arange(first), torch.arange(length - first)])
    else:
        row = torch.arange(length)
    return row.to(type_ids.device).unsqueeze(0).expand(batch, length)


def dplm2_embed(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The official double embedding: ``esm.embeddings`` on the ids, then again on its own output.

    Token dropout (zero ``<mask_aa>`` rows, rescale by 0.88 / (1 - r), r = the row's ``<mask_aa>`` fraction of
    its non-pad tokens) and the pad multiply therefore apply twice, as in the official wrapper + network.
    """
    mask = input_ids.ne(PAD_ID)
    once = model.esm.embeddings(input_ids=input_ids, attention_mask=mask)
    return model.esm.embeddings(input_ids=input_ids, attention_mask=mask, inputs_embeds=once)


@torch.no_grad()
def run_dplm2_network(
    model: torch.nn.Module, input_ids: torch.Tensor, type_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(logits, hidden_states) of the official DPLM2 network on ``input_ids`` (B, L), via ``model`` from
    ``dplm2_transformers_network``.

    ``type_ids`` default to the official rule (``dplm2_type_ids``); they only decide the batch-wide rotary
    split. The attention mask is ``input_ids != <pad>`` on keys (padded queries attend, their outputs are
    defined). ``hidden_states`` has L + 1 entries: entry 0 the twice-embedded input, entry i the input of layer
    i, the last the final-LayerNorm output (the official ``last_hidden_state``).
    """
    if type_ids is None:
        type_ids = dplm2_type_ids(input_ids)
    if type_ids.shape != input_ids.shape:
        raise ValueError(f"type_ids {tuple(type_ids.shape)} and input_ids {tuple(input_ids.shape)} differ in shape")
    mask = input_ids.ne(PAD_ID)
    out = model(
        inputs_embeds=dplm2_embed(model, input_ids),
        attention_mask=mask,
        position_ids=dplm2_position_ids(type_ids),
        output_hidden_states=True,
    )
    return out.logits, tuple(out.hidden_states)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def dplm2_goldens(directory: str | Path = GOLDENS_DIR) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict]:
    """(network tensors, sampler record, manifest) of the committed goldens, after checking both files'
    sha256 against the manifest. Layout: ``tools/goldens/README.md`` (DPLM2)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    manifest = json.loads((directory / MANIFEST).read_text())
    files = {}
    for name, entry in manifest["models"].items():
        path = directory / entry["file"]
        if _sha256(path) != entry["sha256"]:
            raise ValueError(f"{path}: sha256 differs from {MANIFEST}")
        files[name] = path
    network = load_file(str(files["dplm2_network"]))
    sampler = json.loads(files["dplm2_sampler"].read_text())
    return network, sampler, manifest
