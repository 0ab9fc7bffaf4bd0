"""Seeded DPLM (ByProt ``EsmForDPLM``, airkingbd/dplm_*) checkpoints in the official layout, and the
in-environment network oracle.

What lives here, for parity tests of our DPLM network and sampler against the official bytedance/dplm code (run
by ``tools/goldens/dplm.py`` from a checkout outside this repository and never copied here):

- ``dplm_official_spec`` / ``dplm_official_state_dict``: key -> shape and seeded float32 tensors of what an
  airkingbd ``model.safetensors`` holds: the Hugging Face Esm keys of ``esm2.hf_esm2_state_dict(...,
  tie_decoder=True)`` (the same numbers for the same seed: they are reused, not redrawn), plus
  ``esm.embeddings.position_embeddings.weight`` (1026, d), which Transformers 4.39 builds even for rotary models
  and the forward never reads, and without ``lm_head.decoder.weight``: the decoder is tied to the word
  embeddings and Transformers saves tied weights once. ``dplm_state_sha256`` is their fingerprint.
- ``write_dplm_snapshot``: a folder laid out like the Hub's airkingbd/dplm_150m (config.json, model.safetensors,
  vocab.txt, tokenizer_config.json, special_tokens_map.json).
- ``dplm_transformers_network`` / ``run_dplm_network`` / ``dplm_network_outputs``: the network oracle of
  ``shared/reference/families.md`` §2.6: Transformers' ``EsmForMaskedLM`` with SDPA attention, tied decoder,
  the official state loaded with ``strict=False`` (only the position table may be unexpected), ``eval()``, and
  always ``attention_mask = input_ids != <pad>``, which is what the official ``EsmForDPLM.forward`` passes
  whatever the caller gives. The reference measured it bit-identical to the official network on CPU fp32.
- ``official_spec`` / ``official_state_dict`` / ``official_config_json`` / ``esm_config_from_json`` /
  ``official_transformers_network``: the same, parametrised by vocabulary and decoder tying; ``oracles.dplm2``
  builds on them (DPLM2 is DPLM with an 8,229-token vocabulary and an untied decoder).

Facts (key names, shapes, ids, config fields) were read off bytedance/dplm@8b3425b and the reference; the recipe
re-checks the state layout against the network it loads into.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .esm2 import _SPECIAL_TOKENS, _TOKENIZER_CONFIG, ESM2_VOCAB, _check_dims, hf_esm2_spec, hf_esm2_state_dict
from .seeded_weights import seeded_tensor

__all__ = [
    "BOS_ID",
    "DPLM_VOCAB",
    "EOS_ID",
    "MASK_ID",
    "PAD_ID",
    "POSITION_TABLE_KEY",
    "SUPPRESSED_IDS",
    "X_ID",
    "dplm_config_json",
    "dplm_esm_config",
    "dplm_network_outputs",
    "dplm_official_spec",
    "dplm_official_state_dict",
    "dplm_state_sha256",
    "dplm_transformers_network",
    "esm_config_from_json",
    "official_config_json",
    "official_spec",
    "official_state_dict",
    "official_transformers_network",
    "run_dplm_network",
    "write_dplm_snapshot",
]

# The ESM alphabet (airkingbd/dplm_* vocab.txt): <cls>0 <pad>1 <eos>2 <unk>3, residues 4-23, X24 B25 U26 Z27 O28
# .29 -30 <null_1>31 <mask>32.
DPLM_VOCAB: tuple[str, ...] = ESM2_VOCAB
BOS_ID, PAD_ID, EOS_ID, X_ID, MASK_ID = 0, 1, 2, 24, 32
# What the official sampler sets to -inf before choosing a token (dplm.py forward_decoder / resample).
SUPPRESSED_IDS: frozenset[int] = frozenset({MASK_ID, X_ID, PAD_ID, BOS_ID, EOS_ID})
MAX_POSITIONS = 1026
POSITION_TABLE_KEY = "esm.embeddings.position_embeddings.weight"
DECODER_KEY = "lm_head.decoder.weight"
WORD_EMBEDDINGS_KEY = "esm.embeddings.word_embeddings.weight"
_LAYER_INV_FREQ_SUFFIX = "attention.self.rotary_embeddings.inv_freq"
# config.json fields that are not EsmConfig arguments.
_BOOKKEEPING = ("transformers_version", "torch_dtype", "model_type", "_name_or_path")


def official_spec(num_layers: int, hidden: int, heads: int, *, vocab: int, tied: bool) -> dict[str, tuple[int, ...]]:
    """Key -> shape of an official ``EsmForDPLM`` (``tied``) or ``EsmForDPLM2`` (untied) state, in
    ``state_dict()`` order: ``hf_esm2_spec(vocab=vocab)`` with the position table after the word embeddings
    (``EsmEmbeddings`` registers it after ``word_embeddings``), ``lm_head.bias`` first within the head (a
    module's own parameters precede its children's) and, when ``tied``, no decoder (Transformers saves tied
    weights once). The per-layer rotary ``inv_freq`` buffers are kept (4.39 persists them)."""
    base = hf_esm2_spec(num_layers, hidden, heads, vocab=vocab)
    spec: dict[str, tuple[int, ...]] = {}
    for key, shape in base.items():
        if tied and key == DECODER_KEY:
            continue
        if key == "lm_head.dense.weight":
            spec["lm_head.bias"] = base["lm_head.bias"]
        if key == "lm_head.bias":
            continue
        spec[key] = shape
        if key == WORD_EMBEDDINGS_KEY:
            spec[POSITION_TABLE_KEY] = (MAX_POSITIONS, hidden)
    return spec


def official_state_dict(
    num_layers: int, hidden: int, heads: int, *, seed: int, vocab: int, tied: bool
) -> dict[str, torch.Tensor]:
    """Seeded float32 weights in ``official_spec`` order: every tensor shared with ESM2 is
    ``hf_esm2_state_dict(..., seed=seed, vocab=vocab, tie_decoder=tied)``'s (same bytes); the position table is
    drawn by ``seeded_weights`` under its own key (N(0, 1/d), unused by the model)."""
    esm = hf_esm2_state_dict(num_layers, hidden, heads, seed=seed, vocab=vocab, tie_decoder=tied)
    position = torch.from_numpy(
        seeded_tensor(POSITION_TABLE_KEY, (MAX_POSITIONS, hidden), seed=seed, kind="normal", std=hidden**-0.5)
    )
    state: dict[str, torch.Tensor] = {}
    for key, shape in official_spec(num_layers, hidden, heads, vocab=vocab, tied=tied).items():
        value = position if key == POSITION_TABLE_KEY else esm.pop(key)
        assert tuple(value.shape) == shape, key
        state[key] = value
    assert set(esm) <= ({DECODER_KEY} if tied else set()), sorted(esm)
    return state


def dplm_official_spec(num_layers: int, hidden: int, heads: int) -> dict[str, tuple[int, ...]]:
    """Key -> shape of an official ``EsmForDPLM`` checkpoint file, in ``state_dict()`` order.

    ``hf_esm2_spec`` with the position table after the word embeddings (``EsmEmbeddings`` registers it after
    ``word_embeddings``), ``lm_head.bias`` first within the head (a module's own parameters precede its
    children's) and no tied decoder. The per-layer rotary ``inv_freq`` buffers are kept (4.39 persists them).
    """
    return official_spec(num_layers, hidden, heads, vocab=len(DPLM_VOCAB), tied=True)


def dplm_official_state_dict(
    num_layers: int,
    hidden: int,
    heads: int,
    *,
    seed: int = 0,
    lm_head_bias_shift: Mapping[int, float] | None = None,
) -> dict[str, torch.Tensor]:
    """Seeded float32 weights under the official airkingbd/dplm_* key names (``dplm_official_spec`` order).

    Every tensor shared with ESM2 is ``hf_esm2_state_dict(..., seed=seed, tie_decoder=True)``'s (same bytes);
    the position table is drawn by ``seeded_weights`` under its own key (N(0, 1/d), unused by the model).
    ``lm_head_bias_shift`` adds float32 constants to ``lm_head.bias`` entries (token id -> shift), e.g. to bias
    the head toward one token so that the sampler's repeat resampling fires.
    """
    state = official_state_dict(num_layers, hidden, heads, seed=seed, vocab=len(DPLM_VOCAB), tied=True)
    if lm_head_bias_shift:
        bias = state["lm_head.bias"].clone()
        for token, shift in sorted(lm_head_bias_shift.items()):
            if not 0 <= int(token) < bias.numel():
                raise ValueError(f"lm_head_bias_shift: token id {token} out of range")
            bias[int(token)] += torch.tensor(float(shift), dtype=torch.float32)
        state["lm_head.bias"] = bias
    return state


def dplm_state_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over (key, shape, float32 bytes) of every tensor, in order: the weights' fingerprint."""
    digest = hashlib.sha256()
    for key, value in state.items():
        digest.update(f"{key}:{tuple(value.shape)}\n".encode())
        digest.update(value.detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def official_config_json(
    num_layers: int, hidden: int, heads: int, *, architecture: str, dplm_type: str, vocab: int, tied: bool
) -> dict[str, Any]:
    """config.json of an airkingbd DPLM / DPLM2 Hub snapshot at these dims: the fields both families' real
    configs carry (mask 32, pad 1, 1026 positions, token dropout, rotary, eps 1e-5, train-time hidden dropout
    0.1, saved by Transformers 4.39.2); ``architecture``, ``dplm_type``, ``vocab`` and ``tied`` set the rest."""
    _check_dims(num_layers, hidden, heads)
    return {
        "architectures": [architecture],
        "attention_probs_dropout_prob": 0.0,
        "classifier_dropout": None,
        "dplm_type": dplm_type,
        "emb_layer_norm_before": False,
        "esmfold_config": None,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": 4 * hidden,
        "is_folding_model": False,
        "layer_norm_eps": 1e-05,
        "mask_token_id": MASK_ID,
        "max_position_embeddings": MAX_POSITIONS,
        "model_type": "esm",
        "num_attention_heads": heads,
        "num_hidden_layers": num_layers,
        "pad_token_id": PAD_ID,
        "position_embedding_type": "rotary",
        "tie_word_embeddings": tied,
        "token_dropout": True,
        "torch_dtype": "float32",
        "transformers_version": "4.39.2",
        "use_cache": True,
        "vocab_list": None,
        "vocab_size": vocab,
    }


def esm_config_from_json(values: Mapping[str, Any], **overrides: Any):
    """A Transformers ``EsmConfig`` carrying a config.json's values (bookkeeping fields dropped), then
    ``overrides``."""
    from transformers import EsmConfig

    kept = {k: v for k, v in values.items() if k not in _BOOKKEEPING}
    kept.update(overrides)
    return EsmConfig(**kept)


def dplm_config_json(num_layers: int, hidden: int, heads: int) -> dict[str, Any]:
    """config.json of an airkingbd/dplm_* Hub snapshot at these dims (the fields of the real dplm_650m config:
    ``EsmForDPLM``, ``dplm_type`` "dplm_esm", mask 32, pad 1, 1026 positions, token dropout, rotary, eps 1e-5,
    train-time hidden dropout 0.1, tied embeddings, saved by Transformers 4.39.2)."""
    return official_config_json(
        num_layers, hidden, heads, architecture="EsmForDPLM", dplm_type="dplm_esm", vocab=len(DPLM_VOCAB), tied=True
    )


def dplm_esm_config(num_layers: int, hidden: int, heads: int, **overrides: Any):
    """A Transformers ``EsmConfig`` carrying ``dplm_config_json``'s values (bookkeeping fields dropped)."""
    return esm_config_from_json(dplm_config_json(num_layers, hidden, heads), **overrides)


def write_dplm_snapshot(
    folder: str | Path,
    num_layers: int,
    hidden: int,
    heads: int,
    *,
    seed: int = 0,
    lm_head_bias_shift: Mapping[int, float] | None = None,
) -> Path:
    """Write a folder laid out like the Hub's airkingbd/dplm_150m and return it.

    Files: config.json (``dplm_config_json``), model.safetensors (``dplm_official_state_dict``; metadata
    ``{"format": "pt"}``), vocab.txt (the 33 ESM tokens), tokenizer_config.json, special_tokens_map.json.
    """
    from safetensors.torch import save_file

    directory = Path(folder)
    directory.mkdir(parents=True, exist_ok=True)
    state = dplm_official_state_dict(num_layers, hidden, heads, seed=seed, lm_head_bias_shift=lm_head_bias_shift)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = dplm_config_json(num_layers, hidden, heads)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (directory / "vocab.txt").write_text("\n".join(DPLM_VOCAB) + "\n")
    (directory / "tokenizer_config.json").write_text(json.dumps(_TOKENIZER_CONFIG, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(_SPECIAL_TOKENS, indent=2) + "\n")
    return directory


def _dims_from_state(state: Mapping[str, torch.Tensor]) -> tuple[int, int, int]:
    """(num_layers, hidden, heads) of an official state: heads from the contact head's width L * H."""
    hidden = int(state[WORD_EMBEDDINGS_KEY].shape[1])
    layers = 1 + max(int(k.split(".")[3]) for k in state if k.startswith("esm.encoder.layer."))
    width = int(state["esm.contact_head.regression.weight"].shape[1])
    if width % layers:
        raise ValueError(f"contact head width {width} is not a multiple of {layers} layers")
    return layers, hidden, width // layers


def official_transformers_network(
    snapshot_or_state: str | Path | Mapping[str, torch.Tensor],
    config_json: Callable[[int, int, int], Mapping[str, Any]],
    config_overrides: Mapping[str, Any],
    *,
    family: str,
    tied: bool,
    vocab: int | None = None,
    tolerate_layer_inv_freq: bool = False,
) -> torch.nn.Module:
    """Transformers ``EsmForMaskedLM`` (SDPA, float32, ``eval()``) holding an official DPLM-family state.

    ``snapshot_or_state`` is a snapshot folder (config.json + model.safetensors) or a state dict in the official
    layout, whose config is ``config_json(*dims)`` with the dims read off its shapes; ``config_overrides`` win.
    The config must say ``tie_word_embeddings=tied`` (and ``vocab_size=vocab`` when given).
    ``load_state_dict(strict=False)`` may only report the position table as unexpected (and, with
    ``tolerate_layer_inv_freq``, the per-layer rotary ``inv_freq`` keys) and, when ``tied``, the decoder as
    missing; anything else raises. The decoder must then be the word embeddings (``tied``) or a separate
    tensor holding the checkpoint's decoder, and every checkpoint ``inv_freq`` must equal the model's.
    """
    from transformers import EsmForMaskedLM

    if isinstance(snapshot_or_state, (str, Path)):
        from safetensors.torch import load_file

        folder = Path(snapshot_or_state)
        config = esm_config_from_json(json.loads((folder / "config.json").read_text()), **config_overrides)
        state = load_file(str(folder / "model.safetensors"))
    else:
        state = dict(snapshot_or_state)
        config = esm_config_from_json(config_json(*_dims_from_state(state)), **config_overrides)
    if tied and not config.tie_word_embeddings:
        raise ValueError(f"{family} checkpoints tie the decoder to the word embeddings (tie_word_embeddings=True)")
    if not tied and config.tie_word_embeddings:
        raise ValueError(f"{family} checkpoints have an untied decoder (tie_word_embeddings=False)")
    if vocab is not None and config.vocab_size != vocab:
        raise ValueError(f"{family} has {vocab} tokens, the config says {config.vocab_size}")
    model = EsmForMaskedLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    result = model.load_state_dict(state, strict=False)
    unexpected = set(result.unexpected_keys) - {POSITION_TABLE_KEY}
    if tolerate_layer_inv_freq:
        unexpected = {k for k in unexpected if not k.endswith(_LAYER_INV_FREQ_SUFFIX)}
    missing = set(result.missing_keys) - ({DECODER_KEY} if tied else set())
    if unexpected or missing:
        raise ValueError(
            f"official {family} state does not fit: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    decoder, embeddings = model.lm_head.decoder.weight, model.esm.embeddings.word_embeddings.weight
    if tied and decoder is not embeddings:
        raise ValueError("the LM decoder is not tied to the word embeddings")
    if not tied:
        if decoder is embeddings:
            raise ValueError(f"the LM decoder is tied to the word embeddings; {family}'s is not")
        if not torch.equal(decoder, state[DECODER_KEY]):
            raise ValueError("the LM decoder does not hold the checkpoint's decoder")
    for layer in range(config.num_hidden_layers):
        key = f"esm.encoder.layer.{layer}.{_LAYER_INV_FREQ_SUFFIX}"
        if key in state and not torch.equal(state[key], model.esm.rotary_embeddings.inv_freq):
            raise ValueError(f"layer {layer}: the checkpoint's rotary inv_freq differs from the model's")
    return model.eval()


def dplm_transformers_network(
    snapshot_or_state: str | Path | Mapping[str, torch.Tensor], **config_overrides: Any
) -> torch.nn.Module:
    """The network oracle: Transformers ``EsmForMaskedLM`` (SDPA, tied decoder) holding an official DPLM state.

    ``snapshot_or_state`` is a folder from ``write_dplm_snapshot`` (or a real airkingbd snapshot: config.json +
    model.safetensors) or a state dict in the official layout, whose dims are read off its shapes.
    ``load_state_dict(strict=False)`` may only report the position table as unexpected and the tied decoder as
    missing (Transformers 5.13 maps the per-layer rotary ``inv_freq`` keys itself); anything else raises.
    Returned in ``eval()`` (the config's hidden dropout is 0.1), float32.
    """
    return official_transformers_network(
        snapshot_or_state, dplm_config_json, config_overrides, family="DPLM", tied=True
    )


def dplm_network_outputs(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"logits", "last_hidden_state"}`` as the official ``EsmForDPLM.forward`` returns them: the attention
    mask is always ``input_ids != <pad>``; ``last_hidden_state`` is the final-LayerNorm output."""
    attention_mask = input_ids.ne(PAD_ID)
    sequence_output = model.esm(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return {"logits": model.lm_head(sequence_output), "last_hidden_state": sequence_output}


@torch.no_grad()
def run_dplm_network(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(logits, hidden_states) of the network oracle; ``hidden_states`` has L + 1 entries: entry 0 the embedding
    output, the last the final-LayerNorm output. The mask is always ``input_ids != <pad>``."""
    out = model(input_ids=input_ids, attention_mask=input_ids.ne(PAD_ID), output_hidden_states=True)
    return out.logits, tuple(out.hidden_states)
