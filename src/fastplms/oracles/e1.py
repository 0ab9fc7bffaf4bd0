"""Seeded Profluent E1 checkpoints in the official layout, the golden input panel, and the goldens' loader.

What lives here, for parity tests of our E1 implementation against the official ``E1.modeling.E1ForMaskedLM``
(Profluent-AI/E1; its code is run by ``tools/goldens/e1.py`` from a checkout outside this repository and is
never copied here):

- ``E1Dims`` / ``e1_dims``: a checkpoint's architecture, read from the family manifest (no table here).
- ``e1_official_spec``: key -> shape of ``E1ForMaskedLM(E1Config(...)).state_dict()``, in its order (the
  layout of the Hub snapshots' ``model.safetensors``).
- ``e1_official_state_dict``: seeded float32 tensors for that spec (``e1_rule`` picks the scales), and
  ``e1_state_sha256``, the digest the goldens' manifest records for them.
- ``e1_encode`` / ``e1_batch`` / ``e1_panel``: our own preparation of E1 inputs in the official layout, and the
  fixed panel the goldens in ``tests/goldens/e1_*.safetensors`` were computed on.
- ``e1_goldens``: the committed goldens of one checkpoint, hash-checked against ``e1_manifest.json``.

The layout facts (key names, shapes, vocabulary ids, the input layout) were read off the official code at
Profluent-AI/E1@219c7c7 and are re-checked against it by the recipe and, when a checkout is available
(``FASTPLMS_E1_SRC``), by ``tests/test_e1_goldens.py``. The official recipe runs in the project venv, so this
module may import the ``fastplms`` source package (never the runtime modules of E1, which it checks).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from ..manifest import MANIFEST_DIR, REPO_ROOT, load_manifest
from .seeded_weights import seeded_tensor

__all__ = [
    "BOS_ID",
    "CACHE_ROW",
    "E1_GOLDENS_DIR",
    "E1_MANIFEST_JSON",
    "E1_VOCAB",
    "EOS_ID",
    "MASK_ID",
    "PAD_ID",
    "SEQ_END_ID",
    "SEQ_START_ID",
    "E1Dims",
    "E1Panel",
    "e1_batch",
    "e1_cache_split",
    "e1_config_kwargs",
    "e1_dims",
    "e1_encode",
    "e1_global_layers",
    "e1_goldens",
    "e1_manifest_path",
    "e1_official_spec",
    "e1_official_state_dict",
    "e1_panel",
    "e1_rule",
    "e1_official_config_json",
    "e1_state_sha256",
    "write_e1_snapshot",
]

# The official vocabulary in id order (src/E1/tokenizer.json): six added special tokens, the two sequence
# delimiters "1" and "2", then A..Z (X = 31 is the unknown token).
E1_VOCAB: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<bos_glm>", "<eos_span>", "?", "1", "2") + tuple(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
)
PAD_ID, BOS_ID, EOS_ID, MASK_ID, SEQ_START_ID, SEQ_END_ID = 0, 1, 2, 5, 6, 7
_TOKEN_TO_ID = {tok: i for i, tok in enumerate(E1_VOCAB)}
_RESIDUES = re.compile(r"[A-Z?]+")

E1_GOLDENS_DIR = REPO_ROOT / "tests" / "goldens"
E1_MANIFEST_JSON = "e1_manifest.json"


# ----------------------------------------------------------------------------------------------- dims


class E1Dims(NamedTuple):
    """One checkpoint's architecture, in the manifest's terms (``e1_config_kwargs`` maps them to E1Config)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_num_sequences: int
    max_positions_within_seq: int
    max_positions_global: int
    rope_theta_within_seq: float
    rope_theta_global: float
    global_attention_every_n_layers: int
    clip_qkv: float
    rms_norm_eps: float
    hidden_act: str
    gated_mlp: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def e1_manifest_path(directory: str | Path = MANIFEST_DIR) -> Path:
    """``manifests/e1.toml`` (in ``directory``)."""
    path = Path(directory) / "e1.toml"
    if not path.is_file():
        raise FileNotFoundError(f"no E1 manifest {path}")
    return path


def e1_dims(checkpoint_id: str, manifest: str | Path | None = None) -> E1Dims:
    """The architecture of ``checkpoint_id`` as the E1 manifest states it (read with the strict loader).

    Shared values come from the family's ``[config]`` table, per-checkpoint ones (``num_kv_heads``,
    ``intermediate_size``) from the checkpoint's ``config``; the three dims every family has from the checkpoint.
    """
    path = Path(manifest) if manifest is not None else e1_manifest_path()
    family = load_manifest(path, resolve=False)
    known = [c.id for c in family.checkpoints]
    if checkpoint_id not in known:
        raise KeyError(f"{path.name}: no checkpoint {checkpoint_id!r}; known: {', '.join(known)}")
    ckpt = family.checkpoint(checkpoint_id)
    fields = family.checkpoint_config(checkpoint_id)
    fields.update(num_layers=ckpt.num_layers, hidden_size=ckpt.hidden_size, num_heads=ckpt.num_heads)
    missing = set(E1Dims._fields) - set(fields)
    unknown = set(fields) - set(E1Dims._fields)
    if missing or unknown:
        raise ValueError(f"{path.name}: {checkpoint_id}: missing {sorted(missing)}, unknown {sorted(unknown)}")
    dims = E1Dims(**{name: fields[name] for name in E1Dims._fields})
    _check_dims(dims)
    return dims


def _check_dims(dims: E1Dims) -> None:
    if min(dims.num_layers, dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.intermediate_size) < 1:
        raise ValueError(f"invalid E1 dims: {dims}")
    if dims.hidden_size % dims.num_heads or dims.num_heads % dims.num_kv_heads:
        raise ValueError(f"heads must divide hidden_size and kv heads must divide heads: {dims}")
    if dims.head_dim % 2:
        raise ValueError(f"rotary needs an even head dim, got {dims.head_dim}")
    if dims.vocab_size < len(E1_VOCAB):
        raise ValueError(f"vocab_size {dims.vocab_size} < {len(E1_VOCAB)} tokens")


def e1_config_kwargs(dims: E1Dims) -> dict[str, object]:
    """Keyword arguments of the official ``E1Config`` for ``dims`` (its field names)."""
    return {
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,  # explicit: the official default is 16384, not 3 * d
        "gated_mlp": dims.gated_mlp,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "hidden_act": dims.hidden_act,
        "rms_norm_eps": dims.rms_norm_eps,
        "global_attention_every_n_layers": dims.global_attention_every_n_layers,
        "max_num_sequences": dims.max_num_sequences,
        "max_num_positions_within_seq": dims.max_positions_within_seq,
        "max_num_positions_global": dims.max_positions_global,
        "rope_theta_within_seq": dims.rope_theta_within_seq,
        "rope_theta_global": dims.rope_theta_global,
        "clip_qkv": dims.clip_qkv,
        "vocab_size": dims.vocab_size,
    }


def e1_global_layers(dims: E1Dims) -> list[int]:
    """0-based indices of the block-causal (global) layers: layer i is global iff (i + 1) % n == 0."""
    n = dims.global_attention_every_n_layers
    return [i for i in range(dims.num_layers) if n > 0 and (i + 1) % n == 0]


# ------------------------------------------------------------------------------------------ layout


def e1_official_spec(dims: E1Dims) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the official ``E1ForMaskedLM(E1Config(...)).state_dict()``, in its order.

    The rotary ``inv_freq`` / ``cos_cached`` / ``sin_cached`` buffers are non-persistent, so they are neither in
    the state dict nor in the Hub snapshots. q/k/v/o and the FFN are bias-free; the MLM head has biases.
    """
    _check_dims(dims)
    d, h, f = dims.hidden_size, dims.head_dim, dims.intermediate_size
    spec: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (dims.vocab_size, d),
        "model.embed_seq_id.weight": (dims.max_num_sequences, d),
    }
    for i in range(dims.num_layers):
        p = f"model.layers.{i}."
        spec[p + "norm_attn_norm.self_attn.q_proj.weight"] = (dims.num_heads * h, d)
        spec[p + "norm_attn_norm.self_attn.k_proj.weight"] = (dims.num_kv_heads * h, d)
        spec[p + "norm_attn_norm.self_attn.v_proj.weight"] = (dims.num_kv_heads * h, d)
        spec[p + "norm_attn_norm.self_attn.o_proj.weight"] = (d, dims.num_heads * h)
        spec[p + "norm_attn_norm.input_layernorm.weight"] = (d,)  # RMSNorm before attention
        spec[p + "norm_attn_norm.post_attention_layernorm.weight"] = (d,)  # RMSNorm before the FFN
        spec[p + "ffn.mlp.w1.weight"] = (f, d)  # gate (silu)
        spec[p + "ffn.mlp.w2.weight"] = (d, f)  # down
        spec[p + "ffn.mlp.w3.weight"] = (f, d)  # up
    spec["model.norm.weight"] = (d,)  # final RMSNorm
    spec["mlm_head.0.weight"] = (d, d)  # Linear, then GELU (mlm_head.1, no parameters)
    spec["mlm_head.0.bias"] = (d,)
    spec["mlm_head.2.weight"] = (d,)  # LayerNorm with bias
    spec["mlm_head.2.bias"] = (d,)
    spec["mlm_head.3.weight"] = (dims.vocab_size, d)
    spec["mlm_head.3.bias"] = (dims.vocab_size,)
    return spec


_NORM_WEIGHT_RE = re.compile(r"(input_layernorm|post_attention_layernorm|model\.norm|mlm_head\.2)\.weight$")
# Per-projection multiplier of 1/sqrt(fan_in): with RMS-normed inputs q and k come out at std ~2 and v at ~3,
# so the +-8 clamp of q, k and v (before rotary) bites on a few q/k entries and ~1% of v entries per layer,
# while the attention logits (std ~4) stay far from uniform without saturating.
_PROJ_GAIN = {"q_proj": 2.0, "k_proj": 2.0, "v_proj": 3.0}


def e1_rule(key: str, shape: tuple[int, ...]) -> tuple[str, float]:
    """(kind, std) for E1 tensors, chosen so that a masking, rotary, clamp or scaling bug changes the outputs.

    - ``embed_tokens`` and ``embed_seq_id``: ``normal`` std 1 (the sequence index must visibly matter). Row 0
      of ``embed_tokens`` (``<pad>``) is random too: the official forward looks it up like any other row.
    - RMSNorm and LayerNorm scales: ``ones_jitter`` std 0.1; biases (MLM head): ``zeros_jitter`` std 0.02.
    - q/k/v projections: ``normal`` std ``gain/sqrt(fan_in)`` with the gains of ``_PROJ_GAIN``.
    - other matrices: ``normal`` std ``1/sqrt(fan_in)``, so activations and logits stay O(1).
    """
    if key in ("model.embed_tokens.weight", "model.embed_seq_id.weight"):
        return "normal", 1.0
    if _NORM_WEIGHT_RE.search(key):
        return "ones_jitter", 0.1
    if key.endswith("bias"):
        return "zeros_jitter", 0.02
    if len(shape) == 2:
        projection = key.rsplit(".", 2)[-2]
        return "normal", _PROJ_GAIN.get(projection, 1.0) / math.sqrt(shape[1])
    raise ValueError(f"no E1 rule for {key!r} with shape {shape}")


def e1_official_state_dict(dims: E1Dims, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for ``e1_official_spec`` (per-key streams of ``seeded_weights.seeded_tensor``).

    Loads into the official ``E1ForMaskedLM`` with ``load_state_dict(strict=True)``; the same numbers feed ours.
    """
    out: dict[str, torch.Tensor] = {}
    for key, shape in e1_official_spec(dims).items():
        kind, std = e1_rule(key, shape)
        out[key] = torch.from_numpy(seeded_tensor(key, shape, seed=seed, kind=kind, std=std))
    return out


def e1_state_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over (key, shape, float32 bytes) of every tensor, in order: the weights' fingerprint."""
    digest = hashlib.sha256()
    for key, value in state.items():
        digest.update(f"{key}:{tuple(value.shape)}\n".encode())
        digest.update(value.detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def e1_official_config_json(dims: E1Dims) -> dict[str, object]:
    """config.json of a Profluent-Bio Hub snapshot at ``dims``: the official ``E1Config`` fields (as its
    ``save_pretrained`` writes them, less Transformers' bookkeeping) with the tokenizer's special ids."""
    return {
        "architectures": ["E1ForMaskedLM"],
        "model_type": "E1",
        **e1_config_kwargs(dims),
        "initializer_range": 0.02,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def write_e1_snapshot(folder: str | Path, dims: E1Dims, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A seeded stand-in for a Profluent-Bio Hub snapshot: config.json and model.safetensors (official keys,
    ``dtype`` as the released files: bfloat16). Not the official weights; builds from it are unpinned."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(e1_official_config_json(dims), indent=2) + "\n")
    state = {k: v.to(dtype).contiguous() for k, v in e1_official_state_dict(dims, seed=seed).items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


# -------------------------------------------------------------------------------------------- inputs


def e1_encode(
    instance: str, *, max_num_sequences: int = 512, max_positions_within_seq: int = 8192
) -> dict[str, torch.Tensor | int]:
    """One instance in the official layout: ``"ctx1,ctx2,...,query"`` (or just ``"query"``).

    Every sequence becomes ``<bos> 1 RESIDUES 2 <eos>`` (ids by direct vocabulary lookup; ``?`` is the mask
    token). Returns 1-D int64 ``input_ids``, ``sequence_ids`` (0..k per sequence), ``within_seq_position_ids``
    (restarting at 0 per sequence), ``global_position_ids`` (each sequence offset by the previous offset plus
    its largest within-sequence position plus one) and the int ``context_len`` (tokens of all but the last
    sequence). Rejects empty or all-``?`` sequences, anything outside A-Z and ``?``, more than
    ``max_num_sequences`` sequences and sequences longer than ``max_positions_within_seq`` residues.
    """
    sequences = instance.split(",")
    if len(sequences) > max_num_sequences:
        raise ValueError(f"{len(sequences)} sequences in one instance; at most {max_num_sequences}")
    ids: list[int] = []
    seq_ids: list[int] = []
    within: list[int] = []
    glob: list[int] = []
    offset = 0
    for index, seq in enumerate(sequences):
        if not _RESIDUES.fullmatch(seq) or not seq.replace("?", ""):
            raise ValueError(f"sequence {index} {seq!r}: expected A-Z and '?' only, with at least one residue")
        if len(seq) > max_positions_within_seq:
            raise ValueError(f"sequence {index}: {len(seq)} residues; at most {max_positions_within_seq}")
        tokens = [BOS_ID, SEQ_START_ID, *(_TOKEN_TO_ID[c] for c in seq), SEQ_END_ID, EOS_ID]
        positions = list(range(len(tokens)))
        ids += tokens
        seq_ids += [index] * len(tokens)
        within += positions
        glob += [offset + p for p in positions]
        offset += max(positions) + 1
    context_len = len(ids) - (len(sequences[-1]) + 4)
    as_long = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    return {
        "input_ids": as_long(ids),
        "sequence_ids": as_long(seq_ids),
        "within_seq_position_ids": as_long(within),
        "global_position_ids": as_long(glob),
        "context_len": context_len,
    }


_BATCH_KEYS = {"input_ids": PAD_ID, "sequence_ids": -1, "within_seq_position_ids": -1, "global_position_ids": -1}


def e1_batch(instances: Sequence[str]) -> dict[str, torch.Tensor]:
    """Right-padded (B, S) int64 tensors of ``e1_encode`` rows: ids padded with 0, the three id tensors with -1.

    Also ``context_len``: (B,) int64.
    """
    rows = [e1_encode(s) for s in instances]
    width = max(int(r["input_ids"].numel()) for r in rows)
    out: dict[str, torch.Tensor] = {}
    for key, pad in _BATCH_KEYS.items():
        out[key] = torch.full((len(rows), width), pad, dtype=torch.int64)
        for b, row in enumerate(rows):
            value = row[key]
            out[key][b, : value.numel()] = value
    out["context_len"] = torch.tensor([int(r["context_len"]) for r in rows], dtype=torch.int64)
    return out


class E1Panel(NamedTuple):
    """The golden input panel (official layout, right padding)."""

    instances: list[str]  # "ctx1,...,query" strings; "?" is the mask token
    input_ids: torch.Tensor  # (B, S) int64, <pad> = 0 on padding
    sequence_ids: torch.Tensor  # (B, S) int64, -1 on padding
    within_seq_position_ids: torch.Tensor  # (B, S) int64, -1 on padding
    global_position_ids: torch.Tensor  # (B, S) int64, -1 on padding
    context_len: torch.Tensor  # (B,) int64: tokens before the query (0 for single-sequence rows)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The four id tensors under the official forward's argument names."""
        return {
            "input_ids": self.input_ids,
            "within_seq_position_ids": self.within_seq_position_ids,
            "global_position_ids": self.global_position_ids,
            "sequence_ids": self.sequence_ids,
        }

    @property
    def valid(self) -> torch.Tensor:
        """(B, S) bool: real tokens (the padding has sequence id -1)."""
        return self.sequence_ids >= 0


# Single-sequence rows (0, 2, 4) and retrieval rows (1: two context sequences + query; 3: one context + query),
# "?" masks in queries and contexts, X in two rows, every letter A-Z in row 4; 37 / 55 / 7 / 36 / 31 tokens.
_PANEL_INSTANCES: tuple[str, ...] = (
    "MKTAYIAKQRQISFVKSHFSRQ?EERLGLIEVQ",
    "MKTAYIAKQRQISFV,MRTAYLAKQ?QISW,MKSAYI?KQRQLSF",
    "M?K",
    "GSHMSEQNDRFILX,GSHM?EQNDKFIL?",
    "ACDEFGHIKLMNPQRSTVWYXBZUO?J",
)
# The cache cases run row CACHE_ROW alone (batch 1, no padding): first with the cache holding the row's two
# context sequences (single-sequence query: the official cached path is exact), then holding only the first
# one (a two-sequence "query": the official cached path is not the full forward; only its deviation is kept).
CACHE_ROW = 1


def e1_panel() -> E1Panel:
    """The fixed E1 golden panel: 5 rows, padded to S = 55."""
    batch = e1_batch(_PANEL_INSTANCES)
    return E1Panel(
        list(_PANEL_INSTANCES),
        batch["input_ids"],
        batch["sequence_ids"],
        batch["within_seq_position_ids"],
        batch["global_position_ids"],
        batch["context_len"],
    )


def e1_cache_split(instance: str, n_context: int) -> tuple[dict[str, torch.Tensor], int]:
    """(batch-1 inputs of ``instance``, number of tokens of its first ``n_context`` sequences)."""
    row = e1_encode(instance)
    inputs = {key: row[key].unsqueeze(0) for key in _BATCH_KEYS}  # type: ignore[union-attr]
    sequences = instance.split(",")
    if not 0 < n_context < len(sequences):
        raise ValueError(f"n_context must be in [1, {len(sequences) - 1}], got {n_context}")
    return inputs, sum(len(s) + 4 for s in sequences[:n_context])


# ------------------------------------------------------------------------------------------- goldens


def e1_goldens(
    checkpoint_id: str, goldens_dir: str | Path = E1_GOLDENS_DIR
) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """(recipe manifest, its entry for ``checkpoint_id``, tensors) of the committed E1 goldens.

    The file's sha256 must equal the one the manifest records; the tensors' layout is described in the
    manifest's ``layout`` and in ``tools/goldens/README.md``.
    """
    from safetensors.torch import load_file

    goldens_dir = Path(goldens_dir)
    recipe = json.loads((goldens_dir / E1_MANIFEST_JSON).read_text(encoding="utf-8"))
    entry = recipe["models"][checkpoint_id]
    path = goldens_dir / entry["file"]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != entry["sha256"]:
        raise ValueError(f"{path}: sha256 {digest} differs from {E1_MANIFEST_JSON}'s {entry['sha256']}")
    return recipe, entry, load_file(str(path))
