"""Seeded ESM2 checkpoints in the official layouts, and the fair-esm loader, for parity runs.

Two layouts carry the *same* numbers:

- Hugging Face (``facebook/esm2_*``): the key names real hub files carry, including the per-layer
  ``attention.self.rotary_embeddings.inv_freq`` buffers and ``LayerNorm.weight/bias`` (Transformers 5.13's
  ``save_pretrained`` would write ``LayerNorm.gamma/beta`` and drop ``inv_freq``; loaders must cope with
  the real form, so that is what we write).
- fair-esm (``esm2_t*.pt`` + ``*-contact-regression.pt``): what
  ``esm.pretrained.load_model_and_alphabet_local`` reads through ``_load_model_and_alphabet_core_v2``.

Every tensor is drawn by ``fastplms.oracles.seeded_weights`` under its Hugging Face key, then renamed for fair-esm,
so for equal (dims, seed) both layouts hold bit-identical weights.

Decoder tying: fair-esm's ``ESM2`` builds its LM head with ``weight=self.embed_tokens.weight`` (one shared
Parameter), so every real ESM2 checkpoint stores ``lm_head.decoder.weight`` equal to the word embeddings.
``tie_decoder=True`` (default) reproduces that. ``tie_decoder=False`` draws an independent decoder, which
only the HF layout can represent; it exists to prove a loader keeps the decoder as written. Our configs set
``tie_word_embeddings=False`` so Transformers never overwrites the written decoder with the embeddings.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from transformers import EsmConfig

from .seeded_weights import Rule, seeded_state_dict

__all__ = [
    "ESM2_VOCAB",
    "Outputs",
    "esm2_rule",
    "fair_esm2_key",
    "fair_esm2_state_dict",
    "hf_esm2_config",
    "hf_esm2_spec",
    "hf_esm2_state_dict",
    "load_fair_esm_local",
    "rotary_inv_freq",
    "run_fair_esm",
    "run_transformers",
    "write_fair_esm_pt",
    "write_hf_snapshot",
]

# The ESM-1b/ESM2 alphabet in id order (identical for fair-esm's Alphabet and the hub vocab.txt).
ESM2_VOCAB: tuple[str, ...] = (
    ("<cls>", "<pad>", "<eos>", "<unk>") + tuple("LAGVSERTIDPKQNFYMHWCXBUZO.-") + ("<null_1>", "<mask>")
)
PAD_ID = 1
MASK_ID = 32

_SPECIAL_TOKENS = {
    "cls_token": "<cls>",
    "eos_token": "<eos>",
    "mask_token": "<mask>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
}
# The hub tokenizer_config.json carries transformers' "unbounded" sentinel, int(1e30) as written by Python.
_TOKENIZER_CONFIG = {"model_max_length": 1000000000000000019884624838656, "tokenizer_class": "EsmTokenizer"}


def esm2_rule(key: str, shape: tuple[int, ...]) -> tuple[str, float]:
    """(kind, std) for ESM2 tensors.

    Matrices use std = 1/sqrt(fan_in) rather than the generic 0.02: with 0.02 the attention logits are
    ~0, every head is uniform and the LM logits are flat, so a parity test would pass even with broken
    rotary, masking or softmax scaling. Fan-in scaling keeps activations and attention logits O(1).
    All LayerNorm scales (including ``emb_layer_norm_after``, which the generic rule does not recognise)
    are ``ones_jitter`` 0.1; biases are small jitter around zero.
    """
    module = key.rsplit(".", 2)[-2].lower() if key.count(".") else ""
    if "layernorm" in module or "layer_norm" in module:
        return ("ones_jitter", 0.1) if key.endswith("weight") else ("zeros_jitter", 0.02)
    if key.endswith("bias"):
        return "zeros_jitter", 0.02
    if len(shape) == 2:
        return "normal", 1.0 / math.sqrt(shape[1])
    return "normal", 0.02


def rotary_inv_freq(head_dim: int) -> torch.Tensor:
    """The rotary buffer both implementations compute: 1 / 10000^(arange(0, d, 2) / d), float32."""
    return 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _check_dims(num_layers: int, hidden: int, heads: int) -> int:
    if num_layers < 1 or hidden < 1 or heads < 1 or hidden % heads:
        raise ValueError(f"invalid ESM2 dims: layers={num_layers} hidden={hidden} heads={heads}")
    head_dim = hidden // heads
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head dim, got {head_dim}")
    return head_dim


def hf_esm2_spec(num_layers: int, hidden: int, heads: int, *, vocab: int = 33) -> dict[str, tuple[int, ...]]:
    """Official HF key -> shape, in the order real ``EsmForMaskedLM`` checkpoints list them."""
    head_dim = _check_dims(num_layers, hidden, heads)
    ffn = 4 * hidden
    spec: dict[str, tuple[int, ...]] = {"esm.embeddings.word_embeddings.weight": (vocab, hidden)}
    for i in range(num_layers):
        p = f"esm.encoder.layer.{i}."
        for proj in ("query", "key", "value"):
            spec[f"{p}attention.self.{proj}.weight"] = (hidden, hidden)
            spec[f"{p}attention.self.{proj}.bias"] = (hidden,)
        spec[f"{p}attention.self.rotary_embeddings.inv_freq"] = (head_dim // 2,)
        spec[f"{p}attention.output.dense.weight"] = (hidden, hidden)
        spec[f"{p}attention.output.dense.bias"] = (hidden,)
        spec[f"{p}attention.LayerNorm.weight"] = (hidden,)
        spec[f"{p}attention.LayerNorm.bias"] = (hidden,)
        spec[f"{p}intermediate.dense.weight"] = (ffn, hidden)
        spec[f"{p}intermediate.dense.bias"] = (ffn,)
        spec[f"{p}output.dense.weight"] = (hidden, ffn)
        spec[f"{p}output.dense.bias"] = (hidden,)
        spec[f"{p}LayerNorm.weight"] = (hidden,)
        spec[f"{p}LayerNorm.bias"] = (hidden,)
    spec["esm.encoder.emb_layer_norm_after.weight"] = (hidden,)
    spec["esm.encoder.emb_layer_norm_after.bias"] = (hidden,)
    spec["esm.contact_head.regression.weight"] = (1, num_layers * heads)
    spec["esm.contact_head.regression.bias"] = (1,)
    spec["lm_head.dense.weight"] = (hidden, hidden)
    spec["lm_head.dense.bias"] = (hidden,)
    spec["lm_head.layer_norm.weight"] = (hidden,)
    spec["lm_head.layer_norm.bias"] = (hidden,)
    spec["lm_head.decoder.weight"] = (vocab, hidden)
    spec["lm_head.bias"] = (vocab,)
    return spec


def hf_esm2_state_dict(
    num_layers: int,
    hidden: int,
    heads: int,
    *,
    seed: int = 0,
    vocab: int = 33,
    rules: Rule | None = esm2_rule,
    tie_decoder: bool = True,
) -> dict[str, torch.Tensor]:
    """Seeded float32 weights under the official ``facebook/esm2_*`` key names.

    ``rules=None`` falls back to ``seeded_weights.default_rule``. See the module docstring for
    ``tie_decoder``.
    """
    spec = hf_esm2_spec(num_layers, hidden, heads, vocab=vocab)
    inv_freq = rotary_inv_freq(hidden // heads).numpy()
    fixed = {key: inv_freq for key in spec if key.endswith("inv_freq")}
    arrays = seeded_state_dict(spec, seed=seed, rules=rules, fixed=fixed)
    state = {key: torch.from_numpy(value) for key, value in arrays.items()}
    if tie_decoder:
        # A copy, not a view: safetensors refuses aliased tensors, and real files store two tensors.
        state["lm_head.decoder.weight"] = state["esm.embeddings.word_embeddings.weight"].clone()
    return state


def hf_esm2_config(num_layers: int, hidden: int, heads: int, **overrides: Any) -> EsmConfig:
    """An ``EsmConfig`` with the values the real ESM2 hub configs carry, at the given dims.

    ``tie_word_embeddings=False`` keeps the written decoder (see module docstring); ``overrides`` win.
    """
    _check_dims(num_layers, hidden, heads)
    values: dict[str, Any] = {
        "architectures": ["EsmForMaskedLM"],
        "vocab_size": len(ESM2_VOCAB),
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "intermediate_size": 4 * hidden,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": 1026,
        "layer_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "position_embedding_type": "rotary",
        "emb_layer_norm_before": False,
        "token_dropout": True,
        "pad_token_id": PAD_ID,
        "mask_token_id": MASK_ID,
        "tie_word_embeddings": False,
    }
    values.update(overrides)
    return EsmConfig(**values)


# HF name fragment -> fair-esm ESM2 module name fragment, applied inside one encoder layer.
_LAYER_RENAMES = (
    ("attention.self.query.", "self_attn.q_proj."),
    ("attention.self.key.", "self_attn.k_proj."),
    ("attention.self.value.", "self_attn.v_proj."),
    ("attention.self.rotary_embeddings.inv_freq", "self_attn.rot_emb.inv_freq"),
    ("attention.output.dense.", "self_attn.out_proj."),
    ("attention.LayerNorm.", "self_attn_layer_norm."),
    ("intermediate.dense.", "fc1."),
    ("output.dense.", "fc2."),
    ("LayerNorm.", "final_layer_norm."),
)
_LAYER_KEY = re.compile(r"^esm\.encoder\.layer\.(\d+)\.(.+)$")
_TOP_RENAMES = {
    "esm.embeddings.word_embeddings.weight": "embed_tokens.weight",
    "esm.encoder.emb_layer_norm_after.weight": "emb_layer_norm_after.weight",
    "esm.encoder.emb_layer_norm_after.bias": "emb_layer_norm_after.bias",
    "esm.contact_head.regression.weight": "contact_head.regression.weight",
    "esm.contact_head.regression.bias": "contact_head.regression.bias",
    "lm_head.decoder.weight": "lm_head.weight",
}


def fair_esm2_key(hf_key: str) -> str:
    """Map an official HF ESM2 key to the fair-esm ``ESM2`` module key."""
    match = _LAYER_KEY.match(hf_key)
    if match:
        index, rest = match.groups()
        for old, new in _LAYER_RENAMES:
            if rest.startswith(old):
                return f"layers.{index}.{new}{rest[len(old) :]}"
        raise KeyError(hf_key)
    if hf_key in _TOP_RENAMES:
        return _TOP_RENAMES[hf_key]
    if hf_key.startswith("lm_head."):  # dense, layer_norm and bias keep their names
        return hf_key
    raise KeyError(hf_key)


def fair_esm2_state_dict(
    num_layers: int, hidden: int, heads: int, *, seed: int = 0, rules: Rule | None = esm2_rule
) -> dict[str, torch.Tensor]:
    """The same weights as ``hf_esm2_state_dict`` under fair-esm ``ESM2.state_dict()`` keys.

    Always tied: fair-esm's LM head shares the embedding Parameter, so it cannot hold a separate decoder.
    """
    hf = hf_esm2_state_dict(num_layers, hidden, heads, seed=seed, rules=rules, tie_decoder=True)
    return {fair_esm2_key(key): value for key, value in hf.items()}


def _tokenizer_files(directory: Path) -> None:
    (directory / "vocab.txt").write_text("\n".join(ESM2_VOCAB) + "\n")
    (directory / "tokenizer_config.json").write_text(json.dumps(_TOKENIZER_CONFIG, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(_SPECIAL_TOKENS, indent=2) + "\n")


def write_hf_snapshot(
    path: str | Path,
    num_layers: int,
    hidden: int,
    heads: int,
    *,
    seed: int = 0,
    format: Literal["safetensors", "bin"] = "safetensors",
    rules: Rule | None = esm2_rule,
    tie_decoder: bool = True,
) -> Path:
    """Write a directory laid out like ``facebook/esm2_t6_8M_UR50D`` and return it.

    Files: config.json, model.safetensors (or pytorch_model.bin), vocab.txt, tokenizer_config.json,
    special_tokens_map.json.
    """
    if format not in ("safetensors", "bin"):
        raise ValueError(f"format must be 'safetensors' or 'bin', got {format!r}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    state = hf_esm2_state_dict(num_layers, hidden, heads, seed=seed, rules=rules, tie_decoder=tie_decoder)
    if format == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(state, directory / "pytorch_model.bin")
    hf_esm2_config(num_layers, hidden, heads).to_json_file(str(directory / "config.json"))
    _tokenizer_files(directory)
    return directory


def _fair_file_key(module_key: str) -> str:
    # Real fair-esm files store fairseq names: encoder body under "encoder.sentence_encoder.", the LM head
    # under "encoder."; _load_model_and_alphabet_core_v2 strips exactly these prefixes.
    if module_key.startswith("lm_head."):
        return f"encoder.{module_key}"
    return f"encoder.sentence_encoder.{module_key}"


def write_fair_esm_pt(
    path: str | Path,
    num_layers: int,
    hidden: int,
    heads: int,
    *,
    seed: int = 0,
    rules: Rule | None = esm2_rule,
) -> Path:
    """Write a fair-esm ESM2 checkpoint plus its ``-contact-regression.pt`` and return the ``.pt`` path.

    ``path`` is either the ``.pt`` file (its name must start with ``esm2``: fair-esm picks the ESM2 loader
    from the file name) or a directory, in which case ``esm2_t{layers}_{hidden}d_seed{seed}.pt`` is used.
    The main file holds ``{"model": fairseq-named tensors, "cfg": {"model": Namespace(...)}}`` and the
    contact head lives only in the regression file, as in the released checkpoints. Loading it with
    torch>=2.6 needs ``argparse.Namespace`` allow-listed (see ``load_fair_esm_local``).
    """
    target = Path(path)
    if target.suffix != ".pt":
        target = target / f"esm2_t{num_layers}_{hidden}d_seed{seed}.pt"
    if not target.stem.startswith("esm2"):
        raise ValueError(f"fair-esm only uses the ESM2 loader for names starting with 'esm2': {target.name}")
    target.parent.mkdir(parents=True, exist_ok=True)
    state = fair_esm2_state_dict(num_layers, hidden, heads, seed=seed, rules=rules)
    regression = {key: state.pop(key) for key in list(state) if key.startswith("contact_head.")}
    cfg = argparse.Namespace(
        encoder_layers=num_layers,
        encoder_embed_dim=hidden,
        encoder_ffn_embed_dim=4 * hidden,  # not read by fair-esm (it uses 4*embed_dim); kept for humans
        encoder_attention_heads=heads,
        token_dropout=True,
    )
    torch.save({"model": {_fair_file_key(k): v for k, v in state.items()}, "cfg": {"model": cfg}}, target)
    regression_path = target.with_name(f"{target.stem}-contact-regression.pt")
    torch.save({"model": regression}, regression_path)
    return target


def load_fair_esm_local(path: str | Path) -> tuple[torch.nn.Module, Any]:
    """``esm.pretrained.load_model_and_alphabet_local`` with the checkpoint's Namespace allow-listed.

    fair-esm calls ``torch.load`` without ``weights_only``; since torch 2.6 that defaults to True and
    rejects the ``argparse.Namespace`` that fair-esm checkpoints (ours and the real ones) carry.
    """
    import esm.pretrained

    with torch.serialization.safe_globals([argparse.Namespace]):
        return esm.pretrained.load_model_and_alphabet_local(str(path))


class Outputs(NamedTuple):
    """What parity compares: LM logits, every hidden state (embeddings first) and contact maps."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]
    contacts: torch.Tensor


@torch.inference_mode()
def run_transformers(snapshot: str | Path, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Outputs:
    """Transformers' ``EsmForMaskedLM`` on a snapshot of the ``facebook/esm2_*`` layout, FP32."""
    from transformers import EsmForMaskedLM

    # Eager: the definition, and the only Transformers backend that returns attention maps for contacts.
    model = EsmForMaskedLM.from_pretrained(snapshot, attn_implementation="eager", dtype=torch.float32).eval()
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    contacts = model.predict_contacts(input_ids, attention_mask)
    return Outputs(out.logits, tuple(out.hidden_states), contacts)


@torch.inference_mode()
def run_fair_esm(checkpoint_pt: str | Path, input_ids: torch.Tensor, num_layers: int) -> Outputs:
    """fair-esm's ``ESM2`` on a ``.pt`` checkpoint; padding comes from the ``<pad>`` id in ``input_ids``."""
    model, _alphabet = load_fair_esm_local(checkpoint_pt)
    model.eval()
    out = model(input_ids, repr_layers=list(range(num_layers + 1)), return_contacts=True)
    hidden = tuple(out["representations"][i] for i in range(num_layers + 1))
    return Outputs(out["logits"], hidden, out["contacts"])
