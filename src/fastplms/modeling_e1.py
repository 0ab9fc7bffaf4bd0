"""Profluent-E1, exact to Profluent's official code (Profluent-AI/E1@219c7c7). Built with Profluent-E1.

Official semantics (src/E1/modeling.py, model/{attention,ffn,flex_attention}.py), written anew here:

- embeddings: `embed_tokens(input_ids) + embed_seq_id(sequence_ids clamped at 0)`;
- L pre-RMSNorm layers: h = x + o_proj(attention(RMSNorm(x))), out = h + w2(silu(w1 n) * w3 n) with
  n = RMSNorm(h); RMSNorm is `F.rms_norm` with `rms_norm_eps`, cast back to its input dtype;
- attention: bias-free q/k/v/o projections (GQA: `num_key_value_heads`), q, k **and v** clamped to
  +-`clip_qkv` before rotary, rotate-half rotary with inverse frequencies theta^(-2i/d) whose cos/sin are
  cast to the q dtype and taken at each token's position id, softmax scale 1/sqrt(head_dim);
- layer i is global iff (i + 1) % `global_attention_every_n_layers` == 0: global layers are block-causal
  (a token sees every token of its own and of every earlier sequence of its row; semantics `block_causal`)
  with `global_position_ids` and `rope_theta_global`; the others see their own sequence only (semantics
  `sequence`) with `within_seq_position_ids` and `rope_theta_within_seq`;
- a final RMSNorm, and the MLM head Linear-GELU(erf)-LayerNorm(eps = `rms_norm_eps`)-Linear with float32
  logits.

Inputs, in the official layout (see `prepare_e1_inputs` for building them from sequences): `input_ids`,
`sequence_ids` (0..k per row, -1 on padding), `within_seq_position_ids` and `global_position_ids`, and an
optional `attention_mask` that must agree with `sequence_ids`. Without `sequence_ids`, every row is one
sequence: the tokens `attention_mask` marks, or, without a mask, every token that is not `<pad>`. Missing
positions are derived from `sequence_ids` as the official batch preparer makes them (position in the
sequence; position among the row's tokens). As in the official code, within-sequence positions must be below
`max_num_positions_within_seq`; global positions are not limited.

Outputs: `last_hidden_state` is the final-norm output (the official `embeddings`); `hidden_states` holds
L + 1 tensors, the input to each layer, then the final-norm output, exactly the official `hidden_states`.
**Padding positions are the official ones, not zeros**: there a padded token's attention output is zero, so
its state is its embedding (`embed_tokens[<pad>] + embed_seq_id[0]`) run through the residual FFNs only.
Here the valid tokens run packed (the attention plans drop padding); each distinct padding token id is one
extra row after them that skips attention, and `E1Encoded.padded` writes it to every padding position of
that id, so logits and hidden states match the official code at every position at the cost of about one row.

Retrieval context: `model.encode_context(sequences)` (or the kept `model.context_cache(sequences)`, an LRU)
encodes a context once, keeping every layer's keys and values; `model(**queries, context_cache=cache)` runs
queries prepared without context after it (their sequence ids and global positions shifted to follow it). Every
row's keys are the context's then its own, so the result is the single-shot forward over context + query
(on eager up to BLAS rounding by matmul shape; docs/e1.md), for queries of several sequences too.

Precision: under autocast the embeddings are cast to the autocast dtype, as the official code does on CUDA
(its CPU branch reads CUDA's autocast flag only and stays float32; here CPU and CUDA behave alike). Masked-LM
labels follow Transformers (-100 is ignored), not the official loss (which ignores label 0).

Licensing: the code is under Apache-2.0; E1 weights are under the Profluent-E1 Clickthrough License
Agreement, whose Attribution Guidelines ask for "Built with Profluent-E1": every model construction prints
that attribution once (to stderr).
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.utils import ModelOutput

from .attention import AttentionPlan, attend, mask_state, pad
from .compiled import weights_key
from .configuration_e1 import E1Config
from .embedding import ResidueEncoder
from .heads import MaskedLMModel, SequenceClassificationModel, TokenClassificationModel
from .plm_base import AttentionLayer, Encoded, FastPLMPreTrainedModel, run_encoder
from .rotary import apply_rotary, inverse_frequencies, rotary_tables

ATTRIBUTION = (
    "Built with Profluent-E1. Profluent-E1 weights are licensed under the Profluent-E1 Clickthrough License "
    "Agreement (https://github.com/Profluent-AI/E1/blob/main/LICENSE) and its Attribution Guidelines "
    "(https://github.com/Profluent-AI/E1/blob/main/ATTRIBUTION)."
)
# The official vocabulary in id order: six added special tokens, the sequence delimiters "1" and "2", A..Z.
E1_VOCAB: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<bos_glm>", "<eos_span>", "?", "1", "2") + tuple(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
)
RESIDUES = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
SEQUENCE_START, SEQUENCE_END = "1", "2"
DEFAULT_CONTEXT_TOKENS = 8192  # `sample_context`'s token budget
CONTEXT_SUFFIXES = (".a3m", ".fasta")  # a context directory's file per record id, in lookup order


class RMSNorm(nn.RMSNorm):
    """`F.rms_norm` over the last axis with the config's eps, cast back to the input dtype (the official norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(x.dtype)


@dataclass
class E1Encoded(Encoded):
    """`Encoded` whose packed tensors carry, after the valid tokens, one row per distinct padding token id.

    `pad_index`: flat (batch * seq) positions of the padding; `pad_rows`: for each, its row among those
    trailing rows. `padded` writes them there, so padding positions hold the official padded outputs.
    """

    pad_index: torch.Tensor | None = None
    pad_rows: torch.Tensor | None = None

    def padded(self, packed: torch.Tensor) -> torch.Tensor:
        n = self.indices.numel()
        out = pad(packed[:n], self.indices, self.batch, self.seq)
        if self.pad_index is None:
            return out
        flat = out.reshape(self.batch * self.seq, *out.shape[2:])
        flat = flat.index_copy(0, self.pad_index, packed[n:].index_select(0, self.pad_rows))
        return flat.reshape(out.shape)


@dataclass
class E1ContextCache:
    """A retrieval context encoded once: every layer's keys and values of its tokens (post-clamp, post-rotary,
    in the activation dtype, before any GQA grouping), for queries run after it (`context_cache=`).

    The context is one row of `num_sequences` sequences and `length` tokens; a query's sequences are numbered
    after them and its global positions continue at `next_global_position`, so the query attends exactly as
    it would at the end of the context in one forward (context tokens never see later sequences).
    """

    keys: list[torch.Tensor]  # per layer (length, kv heads, head dim)
    values: list[torch.Tensor]
    sequence_ids: torch.Tensor  # (length,) the context's sequence ids, 0..num_sequences - 1
    num_sequences: int
    next_global_position: int

    @property
    def length(self) -> int:
        return int(self.sequence_ids.numel())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class E1Shared(NamedTuple):
    """What every layer of one forward shares: the (local, global) attention plans (None where no layer needs
    it); against a cached `context`, `kv_source` maps each packed key to its row of cat(context keys, query
    keys); `collect` receives each layer's (k, v) while a context is being encoded."""

    plans: tuple[AttentionPlan | None, AttentionPlan | None]
    context: E1ContextCache | None = None
    kv_source: torch.Tensor | None = None
    collect: list | None = None


class E1Layer(AttentionLayer):
    """One pre-RMSNorm layer on packed tokens; local (own sequence) or global (block-causal), by its index.

    `forward` takes (local, global) pairs of rotary tables and the forward's `E1Shared` (so `run_encoder`
    drives the stack) and uses its kind's. Rows of `h` beyond the plan's tokens (the padding representatives)
    skip attention: their attention output is zero, as for the official padded tokens.
    """

    def __init__(self, config: E1Config, index: int) -> None:
        super().__init__()
        d, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.index, self.is_global = index, config.is_global_layer(index)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.clip_qkv = config.clip_qkv
        self.attn_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)
        self.mlp_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.w1 = nn.Linear(d, config.intermediate_size, bias=False)  # gate (silu)
        self.w3 = nn.Linear(d, config.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(config.intermediate_size, d, bias=False)  # down

    def _project(self, linear: nn.Linear, x: torch.Tensor, heads: int) -> torch.Tensor:
        y = linear(x)
        if self.clip_qkv is not None:
            y = y.clamp(-self.clip_qkv, self.clip_qkv)
        return y.reshape(x.shape[0], heads, self.head_dim)

    def attention_inputs(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Packed (tokens, heads, head_dim) q, k, v: clamped, then q and k rotated (tables in the q dtype)."""
        x = self.attn_norm(h)
        q = self._project(self.q_proj, x, self.num_heads)
        k = self._project(self.k_proj, x, self.num_kv_heads)
        v = self._project(self.v_proj, x, self.num_kv_heads)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection and residual, then the gated SiLU FFN and its residual."""
        h = h + self.o_proj(attended.reshape(h.shape[0], -1))
        x = self.mlp_norm(h)
        return h + self.w2(F.silu(self.w1(x)) * self.w3(x))

    def forward(self, h: torch.Tensor, cos, sin, shared: E1Shared, want_probs: bool = False):
        kind = int(self.is_global)
        plan = shared.plans[kind]
        n = plan.q_index.numel()
        q, k, v = self.attention_inputs(h[:n], cos[kind], sin[kind])
        if shared.collect is not None:
            shared.collect.append((k, v))
        if shared.context is not None:  # the keys of every row: the cached context, then the row's own tokens
            k = torch.cat((shared.context.keys[self.index].to(k.dtype), k)).index_select(0, shared.kv_source)
            v = torch.cat((shared.context.values[self.index].to(v.dtype), v)).index_select(0, shared.kv_source)
        result = attend(q, k, v, plan, return_probs=want_probs)
        out, probs = result if want_probs else (result, None)
        if h.shape[0] > n:
            out = torch.cat((out, out.new_zeros(h.shape[0] - n, *out.shape[1:])))
        return self.finish(h, out), probs


class E1PreTrainedModel(FastPLMPreTrainedModel):
    config_class = E1Config
    base_model_prefix = "e1"
    _no_split_modules = ["E1Layer"]
    vocabulary = E1_VOCAB
    residues = RESIDUES
    context_cache_entries = 4  # `context_cache`'s LRU size

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        sequence_ids: torch.Tensor | None = None,
        within_seq_position_ids: torch.Tensor | None = None,
        global_position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        context_cache: E1ContextCache | None = None,
        **options,
    ) -> ModelOutput | tuple:
        """`FastPLMPreTrainedModel.forward` with E1's own inputs in the signature (Trainer keeps only the
        dataset columns a forward names)."""
        return super().forward(
            input_ids,
            attention_mask,
            labels,
            sequence_ids=sequence_ids,
            within_seq_position_ids=within_seq_position_ids,
            global_position_ids=global_position_ids,
            context_cache=context_cache,
            **options,
        )

    def prepare_inputs(
        self, query: str | Sequence[str], context: Sequence[str] | Sequence[Sequence[str]] | None = None
    ) -> dict[str, torch.Tensor]:
        """`prepare_e1_inputs` with this model's limits, on its device (reachable from a loaded artifact)."""
        config = self.config
        return prepare_e1_inputs(
            query,
            context,
            max_num_sequences=config.max_num_sequences,
            max_num_positions_within_seq=config.max_num_positions_within_seq,
            device=next(self.parameters()).device,
        )

    @torch.no_grad()
    def encode_context(self, context: Sequence[str]) -> E1ContextCache:
        """Encode retrieval `context` sequences once (as one row, in order) for queries run after them."""
        if isinstance(context, str) or not list(context):
            raise ValueError("encode_context needs a non-empty list of context sequences (not one string).")
        context = list(context)
        inputs = self.prepare_inputs(context[-1], context[:-1])
        inputs.pop("attention_mask")
        collected: list = []
        self.base_model.encode(**inputs, collect_kv=collected, warn_eager=False)
        ids = inputs["sequence_ids"][0]
        return E1ContextCache(
            keys=[k for k, _ in collected],
            values=[v for _, v in collected],
            sequence_ids=ids,
            num_sequences=int(ids.max()) + 1,
            next_global_position=int(inputs["global_position_ids"].max()) + 1,
        )

    def context_cache(self, context: Sequence[str]) -> E1ContextCache:
        """`encode_context(context)`, kept: an LRU of at most `context_cache_entries` entries (class attribute,
        4 by default) keyed by the context's sequences, the backend, the autocast dtype and the weights' state.
        `clear_context_cache()` empties it."""
        if isinstance(context, str):
            raise ValueError("context_cache needs a list of context sequences, not one string.")
        device = next(self.parameters()).device
        autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        key = (tuple(context), self.attention_backend(), autocast, weights_key(self))
        caches = self.__dict__.setdefault("_fastplms_context_caches", OrderedDict())
        if key in caches:
            caches.move_to_end(key)
            return caches[key]
        cache = caches[key] = self.encode_context(context)
        while len(caches) > self.context_cache_entries:
            caches.popitem(last=False)
        return cache

    def clear_context_cache(self) -> None:
        self.__dict__.pop("_fastplms_context_caches", None)

    def embed_dataset(
        self,
        inputs,
        *,
        context=None,
        context_tokens: int | None = DEFAULT_CONTEXT_TOKENS,
        max_identity: float | None = None,
        seed: int = 0,
        missing_context: str = "raise",
        **options,
    ):
        """`FastPLMPreTrainedModel.embed_dataset`, optionally with a retrieval `context` before each record.

        `context`: one shared context (a list of sequences, or a FASTA / A3M / .txt file of them, `read_context`),
        or per-record contexts: a mapping {record id: list of sequences or such a file}, or a directory holding
        `<id>.a3m` or `<id>.fasta` per record id. A record without an entry is an error naming it, unless
        `missing_context="none"` (it then runs without context). Each record's context is reduced by
        `sample_context(sequences, query, context_tokens=, max_identity=, seed=)` (defaults: at most 8192
        context tokens, no identity filter, seed 0), then the record runs as the query after it, from a cache
        encoded once per distinct context (records sharing one reuse it; an LRU of `context_cache_entries`
        per job, under the job's dtype). Poolers and per-residue outputs cover the query's residues only; a
        resumed output must have been written with the same contexts and sampling settings.
        """
        if context is None:
            return super().embed_dataset(inputs, **options)
        if missing_context not in ("raise", "none"):
            raise ValueError(f"missing_context={missing_context!r}; use 'raise' or 'none'")
        if context_tokens is not None and (isinstance(context_tokens, bool) or int(context_tokens) < 1):
            raise ValueError(f"context_tokens={context_tokens!r} must be a positive number of tokens or None")
        if max_identity is not None and not 0.0 <= max_identity <= 1.0:
            raise ValueError(f"max_identity={max_identity!r} must lie in [0, 1] or be None")
        job = _ContextJob(
            self,
            _ContextSource(context, missing_context),
            dict(context_tokens=context_tokens, max_identity=max_identity, seed=int(seed)),
        )
        self.__dict__["_fastplms_embedding_context"] = job
        try:
            return super().embed_dataset(inputs, **options)
        finally:
            self.__dict__.pop("_fastplms_embedding_context", None)

    def embedding_groups(self):
        job = self.__dict__.get("_fastplms_embedding_context")
        return None if job is None else (job.group, job.source.digest)

    def embedding_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, key=()) -> torch.Tensor:
        job = self.__dict__.get("_fastplms_embedding_context")
        cache = job.cache(key) if job is not None and key else None
        return self.base_model(
            input_ids=input_ids, attention_mask=attention_mask, context_cache=cache
        ).last_hidden_state

    def model_fingerprint(self) -> dict[str, object]:
        fingerprint = super().model_fingerprint()
        job = self.__dict__.get("_fastplms_embedding_context")
        if job is None:
            return fingerprint
        # The per-record context digests go into the pipeline's `group_sha256`.
        return {**fingerprint, "context": {**job.sampling, "missing_context": job.source.missing}}

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, RMSNorm):
            init.ones_(module.weight)

    def residue_encoder(self) -> ResidueEncoder:
        """One sequence per row, `<bos> 1 residues 2 <eos>` as the official batch preparer writes it."""
        config = self.config
        ids = {token: i for i, token in enumerate(self.vocabulary)}
        return ResidueEncoder(
            alphabet=frozenset(self.residues),
            to_id={r: ids[r] for r in self.residues},
            prefix=(config.bos_token_id, ids[SEQUENCE_START]),
            suffix=(ids[SEQUENCE_END], config.eos_token_id),
            pad_id=config.pad_token_id,
            max_residues=config.max_num_positions_within_seq - 4,
        )


def _int_tensor(value: object, name: str, shape: tuple[int, int]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"{name} must be integers; received dtype {value.dtype}.")
    if tuple(value.shape) != shape:
        raise ValueError(
            f"{name} must have the shape of input_ids (batch, seq) = {shape}; received {tuple(value.shape)}."
        )
    return value.long()


def default_positions(sequence_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(within-sequence, global) position ids as the official batch preparer makes them, -1 on padding.

    Within: the token's index in its run of one sequence id; global: its index among the row's valid tokens.
    """
    valid = sequence_ids >= 0
    index = torch.arange(sequence_ids.shape[1], device=sequence_ids.device).expand_as(sequence_ids)
    starts = torch.ones_like(valid)
    starts[:, 1:] = sequence_ids[:, 1:] != sequence_ids[:, :-1]
    run_start = torch.where(starts, index, 0).cummax(dim=1).values
    within = torch.where(valid, index - run_start, -1)
    glob = torch.where(valid, valid.long().cumsum(dim=1) - 1, -1)
    return within, glob


_TOKEN_IDS = {token: i for i, token in enumerate(E1_VOCAB)}
_SEQUENCE_CHARS = frozenset(RESIDUES + "?")


def _check_sequence(sequence: object, where: str, limit: int) -> str:
    if not isinstance(sequence, str):
        raise TypeError(f"{where} must be a string, got {type(sequence).__name__}.")
    bad = sorted(set(sequence) - _SEQUENCE_CHARS)
    if bad:
        hint = " (lowercase: E1 takes uppercase residues)" if any(c.islower() for c in bad) else ""
        raise ValueError(f"{where} has characters outside A-Z and '?': {''.join(bad)!r}{hint}.")
    if not sequence.replace("?", ""):
        raise ValueError(f"{where} is empty{' (only ? masks)' if sequence else ''}; it needs at least one residue.")
    if len(sequence) > limit:
        raise ValueError(f"{where} has {len(sequence)} residues; E1 takes at most {limit} per sequence.")
    return sequence


def _is_file(value: object) -> bool:
    return isinstance(value, str | os.PathLike) and os.path.isfile(value)


def read_context(path: str | os.PathLike) -> list[str]:
    """Context sequences from a FASTA, A3M or .txt file (one sequence per line), in file order.

    As the official MSA reader does, every sequence is uppercased and its alignment gaps ('-', '.') removed,
    so an A3M's homologs become their full sequences (insertions included). Validation is `prepare_e1_inputs`'.
    """
    from .embedding import _read_path

    sequences = [sequence.upper().replace("-", "").replace(".", "") for _, _, sequence in _read_path(os.fspath(path))]
    if not sequences:
        raise ValueError(f"{path}: no context sequences")
    return sequences


def query_identity(query: str, homolog: str) -> float:
    """Ungapped identity of `homolog` to `query`: residues equal at the same index (over the shorter
    sequence), divided by the longer length. Sequences are compared as `read_context` returns them (gaps
    removed), without alignment; identical sequences score 1, a sequence and a prefix of half its length 0.5.
    """
    longer = max(len(query), len(homolog))
    return sum(a == b for a, b in zip(query, homolog, strict=False)) / longer if longer else 0.0


def sample_context(
    sequences: Sequence[str],
    query: str,
    *,
    context_tokens: int | None = DEFAULT_CONTEXT_TOKENS,
    max_identity: float | None = None,
    max_sequences: int = 511,
    seed: int = 0,
) -> list[str]:
    """The context sequences kept for `query`, in their given order; deterministic for a seed.

    First, with `max_identity`, every sequence whose `query_identity` to the query exceeds it is dropped (an
    A3M's first row is usually the query itself: 0.95 drops it and near-copies). If what remains fits the
    budget (at most `context_tokens` tokens, a sequence taking its residues + 4 special tokens, and at most
    `max_sequences` sequences; `context_tokens=None`: no token budget), all of it is kept. Otherwise the
    candidates are visited in an order shuffled by `random.Random` seeded with a SHA-256 of the seed and the
    candidates (never Python's salted `hash`), each taken if it still fits, until `max_sequences`; the kept
    ones are returned in their original order. The same candidates and seed give the same sample, so
    records sharing a context share its sample and its cache.
    """
    candidates = [s for s in sequences if max_identity is None or query_identity(query, s) <= max_identity]
    budget = float("inf") if context_tokens is None else context_tokens
    if len(candidates) <= max_sequences and sum(len(s) + 4 for s in candidates) <= budget:
        return candidates
    digest = hashlib.sha256(f"{seed}\0{','.join(candidates)}".encode()).digest()
    order = list(range(len(candidates)))
    random.Random(int.from_bytes(digest[:8], "little")).shuffle(order)
    kept, used = [], 0
    for index in order:
        if len(kept) >= max_sequences:
            break
        tokens = len(candidates[index]) + 4
        if used + tokens <= budget:
            kept.append(index)
            used += tokens
    return [candidates[index] for index in sorted(kept)]


def _sequences_digest(sequences: Sequence[str]) -> bytes:
    return hashlib.sha256(",".join(sequences).encode()).digest()


class _ContextSource:
    """Where each record's context comes from: one shared context, a mapping, or a directory of files.

    `sequences(id)` reads a record's context (None: none, under `missing="none"`); `digest(id)` names it
    cheaply for the fingerprint (a file by the SHA-256 of its bytes, memoized per path).
    """

    def __init__(self, context: object, missing: str) -> None:
        self.missing = missing
        self.shared: list[str] | None = None
        self.mapping: Mapping[str, object] | None = None
        self.directory: str | None = None
        self._file_digests: dict[str, bytes] = {}
        if isinstance(context, Mapping):
            self.mapping = context
        elif isinstance(context, str | os.PathLike) and os.path.isdir(context):
            self.directory = os.fspath(context)
        else:
            self.shared = self._check(context, "context")
            self._shared_digest = _sequences_digest(self.shared)

    @staticmethod
    def _check(value: object, where: str) -> list[str]:
        if _is_file(value):
            return read_context(value)  # type: ignore[arg-type]
        if isinstance(value, str) or not isinstance(value, Sequence) or not list(value):
            raise ValueError(
                f"{where} must be a non-empty list of sequences or a file of them (not one string), a mapping "
                "{record id: sequences or file}, or a directory of <id>.a3m / <id>.fasta files."
            )
        return list(value)

    def _entry(self, rid: str) -> object:
        """The record's list or file path; None when it has none (an error unless `missing="none"`)."""
        if self.mapping is not None:
            entry = self.mapping.get(rid)
        else:
            if os.path.basename(rid) != rid or rid in ("", ".", ".."):
                raise ValueError(f"record {rid!r}: its id cannot name a file in the context directory")
            found = [p for p in (os.path.join(self.directory, rid + s) for s in CONTEXT_SUFFIXES) if os.path.isfile(p)]
            if len(found) > 1:
                raise ValueError(f"record {rid!r}: both {found[0]} and {found[1]} exist; keep one")
            entry = found[0] if found else None
        if entry is None and self.missing == "raise":
            where = (
                "in the context mapping"
                if self.mapping is not None
                else f"{rid}.a3m or {rid}.fasta in {self.directory}"
            )
            raise ValueError(f"record {rid!r} has no context ({where}); pass missing_context='none' to run it alone")
        return entry

    def sequences(self, rid: str) -> list[str] | None:
        if self.shared is not None:
            return self.shared
        entry = self._entry(rid)
        return None if entry is None else self._check(entry, f"context of record {rid!r}")

    def digest(self, rid: str) -> bytes:
        if self.shared is not None:
            return self._shared_digest
        entry = self._entry(rid)
        if entry is None:
            return b""
        if _is_file(entry):
            path = os.path.abspath(os.fspath(entry))  # type: ignore[arg-type]
            if path not in self._file_digests:
                digest = hashlib.sha256()
                with open(path, "rb") as handle:
                    for block in iter(lambda: handle.read(1 << 20), b""):
                        digest.update(block)
                self._file_digests[path] = digest.digest()
            return self._file_digests[path]
        return _sequences_digest(self._check(entry, f"context of record {rid!r}"))


class _ContextJob:
    """One `embed_dataset` run with contexts: groups records by their sampled context and keeps an LRU of
    encoded contexts (`context_cache_entries`), filled lazily inside the job's forward (its dtype)."""

    def __init__(self, model: E1PreTrainedModel, source: _ContextSource, sampling: dict) -> None:
        self.model, self.source, self.sampling = model, source, sampling
        self.max_sequences = model.config.max_num_sequences - 1
        self.caches: OrderedDict = OrderedDict()

    def group(self, rid: str, query: str) -> tuple[str, ...]:
        sequences = self.source.sequences(rid)
        if not sequences:
            return ()
        return tuple(sample_context(sequences, query, max_sequences=self.max_sequences, **self.sampling))

    def cache(self, key: tuple[str, ...]) -> E1ContextCache:
        if key in self.caches:
            self.caches.move_to_end(key)
            return self.caches[key]
        cache = self.caches[key] = self.model.encode_context(key)
        while len(self.caches) > self.model.context_cache_entries:
            self.caches.popitem(last=False)
        return cache


def prepare_e1_inputs(
    query: str | Sequence[str],
    context: Sequence[str] | Sequence[Sequence[str]] | None = None,
    *,
    max_num_sequences: int = 512,
    max_num_positions_within_seq: int = 8192,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Model inputs for E1 in the official layout, from raw sequences: `model(**prepare_e1_inputs(...))`.

    `query` is one sequence or a batch of them; `context` the homologs placed before it in its row: for one
    query a list of sequences, for a batch one list per query (a shared context: repeat it). Each sequence
    becomes `<bos> 1 residues 2 <eos>` (`?` is the mask token); sequence ids count 0..k along a row (the query
    last), within-sequence positions restart at 0 per sequence, global positions run along the row. Rows are
    right-padded: ids with `<pad>` (0), sequence ids and positions with -1, `attention_mask` 0.

    Strict: a sequence must hold at least one residue (not only `?`) and only A-Z and `?` (no lowercase,
    separators or spaces), at most `max_num_positions_within_seq - 4` residues (so its four special tokens
    fit the position limit), and a row at most `max_num_sequences` sequences.
    """
    limit = max_num_positions_within_seq - 4
    if isinstance(query, str):
        queries = [query]
        contexts = [[] if context is None else context]
    else:
        queries = list(query)
        if not queries:
            raise ValueError("prepare_e1_inputs needs at least one query.")
        if context is None:
            contexts = [[] for _ in queries]
        else:
            contexts = list(context)
            if len(contexts) != len(queries) or any(isinstance(c, str) for c in contexts):
                raise ValueError(
                    f"with a batch of {len(queries)} queries, context must be one list of sequences per query "
                    f"(got {len(contexts)} entries); for a shared context repeat it per query."
                )
    rows = []
    for b, (q, ctx) in enumerate(zip(queries, contexts, strict=True)):
        if isinstance(ctx, str):
            raise ValueError("context must be a list of sequences, not one string.")
        sequences = [*ctx, q]
        if len(sequences) > max_num_sequences:
            raise ValueError(f"row {b} has {len(sequences)} sequences; E1 takes at most {max_num_sequences}.")
        names = [f"row {b} context sequence {i}" for i in range(len(ctx))] + [f"row {b} query"]
        rows.append([_check_sequence(s, name, limit) for s, name in zip(sequences, names, strict=True)])
    width = max(sum(len(s) + 4 for s in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, _TOKEN_IDS["<pad>"], dtype=torch.long)
    sequence_ids = torch.full(shape, -1, dtype=torch.long)
    within = torch.full(shape, -1, dtype=torch.long)
    glob = torch.full(shape, -1, dtype=torch.long)
    start_ids = [_TOKEN_IDS["<bos>"], _TOKEN_IDS[SEQUENCE_START]]
    end_ids = [_TOKEN_IDS[SEQUENCE_END], _TOKEN_IDS["<eos>"]]
    for b, row in enumerate(rows):
        offset = 0
        for index, sequence in enumerate(row):
            tokens = torch.tensor(start_ids + [_TOKEN_IDS[c] for c in sequence] + end_ids)
            n = tokens.numel()
            input_ids[b, offset : offset + n] = tokens
            sequence_ids[b, offset : offset + n] = index
            within[b, offset : offset + n] = torch.arange(n)
            glob[b, offset : offset + n] = torch.arange(offset, offset + n)
            offset += n
    inputs = {
        "input_ids": input_ids,
        "attention_mask": (sequence_ids >= 0).long(),
        "sequence_ids": sequence_ids,
        "within_seq_position_ids": within,
        "global_position_ids": glob,
    }
    return {key: value.to(device) for key, value in inputs.items()} if device is not None else inputs


class E1Model(E1PreTrainedModel):
    # Artifacts hold the masked-LM checkpoint; the bare encoder simply does not use its LM head.
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config: E1Config) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d, padding_idx=config.pad_token_id)
        self.embed_seq_id = nn.Embedding(config.max_num_sequences, d)
        self.layers = nn.ModuleList(E1Layer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.post_init()
        # Once per model construction: every E1 class builds exactly one E1Model.
        print(ATTRIBUTION, file=sys.stderr)

    def _inputs(self, input_ids, attention_mask, sequence_ids, within, glob, context=None):
        """(sequence ids, within positions, global positions), checked, missing ones derived; after a cached
        `context`, sequence ids and global positions shifted to follow it."""
        shape, device = tuple(input_ids.shape), input_ids.device
        config = self.config
        if sequence_ids is None:
            if attention_mask is None:
                valid = input_ids != config.pad_token_id
            else:
                valid = mask_state(attention_mask, shape=shape, device=device).valid
            sequence_ids = torch.where(valid, 0, -1)
        else:
            sequence_ids = _int_tensor(sequence_ids, "sequence_ids", shape)
            if bool((sequence_ids < -1).any()):
                raise ValueError("sequence_ids must be >= 0 for tokens and -1 for padding.")
            if attention_mask is not None:
                given = mask_state(attention_mask, shape=shape, device=device).valid
                if not torch.equal(given, sequence_ids >= 0):
                    raise ValueError(
                        "attention_mask and sequence_ids disagree on which tokens are padding (-1 in sequence_ids); "
                        "pass a matching attention_mask or none."
                    )
        valid = sequence_ids >= 0
        if context is not None:
            sequence_ids = torch.where(valid, sequence_ids + context.num_sequences, -1)
        if sequence_ids.numel() and int(sequence_ids.max()) >= config.max_num_sequences:
            raise ValueError(
                f"sequence_ids reach {int(sequence_ids.max())}; E1 takes at most {config.max_num_sequences} "
                f"sequences per row (ids 0..{config.max_num_sequences - 1})."
            )
        derived = default_positions(sequence_ids) if within is None or glob is None else (None, None)
        within = derived[0] if within is None else _int_tensor(within, "within_seq_position_ids", shape)
        glob = derived[1] if glob is None else _int_tensor(glob, "global_position_ids", shape)
        limit = config.max_num_positions_within_seq
        if bool(((within < 0) & valid).any()) or bool(((within >= limit) & valid).any()):
            raise ValueError(f"within_seq_position_ids must lie in [0, {limit}) at every token (not padding).")
        if bool(((glob < 0) & valid).any()):
            raise ValueError("global_position_ids must be >= 0 at every token (not padding).")
        if context is not None:
            glob = torch.where(valid, glob + context.next_global_position, -1)
        return sequence_ids, within, glob

    def encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        sequence_ids: torch.Tensor | None = None,
        within_seq_position_ids: torch.Tensor | None = None,
        global_position_ids: torch.Tensor | None = None,
        context_cache: E1ContextCache | None = None,
        *,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        warn_eager: bool = True,
        collect_kv: list | None = None,
    ) -> E1Encoded:
        """The encoder, packed; `forward` (plm_base) pads it and applies the head of the model class.

        With `context_cache`, the inputs are queries as `prepare_e1_inputs` makes them without context
        (sequence ids and global positions from 0); every row runs after the cached context, its sequence ids
        and global positions shifted to follow it. `collect_kv` receives every layer's packed (k, v).
        """
        backend = self.checked_backend(input_ids, output_attentions, warn_eager)
        batch, seq = input_ids.shape
        ids, within, glob = self._inputs(
            input_ids, attention_mask, sequence_ids, within_seq_position_ids, global_position_ids, context_cache
        )
        kinds = {layer.is_global for layer in self.layers}
        kv = {}
        if context_cache is not None:
            context_ids = context_cache.sequence_ids.to(ids.device).expand(batch, -1)
            kv = {"kv_sequence_ids": torch.cat((context_ids, ids), dim=1)}
        plans = tuple(
            self.attention_plan(backend, mask_state(sequence_ids=ids, semantics=semantics, **kv))
            if wanted in kinds
            else None
            for wanted, semantics in ((False, "sequence"), (True, "block_causal"))
        )
        plan = next(p for p in plans if p is not None)
        index = plan.q_index
        kv_source = None if context_cache is None else self._kv_source(plan, context_cache.length, batch, seq)
        shared = E1Shared(plans, context_cache, kv_source, collect_kv)
        h, pad_index, pad_rows = self._embed(input_ids, ids, index)
        config = self.config
        head_dim = config.hidden_size // config.num_attention_heads
        # (local, global) rotary tables at the valid tokens; each layer takes its kind's.
        cos, sin = [None, None], [None, None]
        for kind, (positions, theta) in enumerate(
            ((within, config.rope_theta_within_seq), (glob, config.rope_theta_global))
        ):
            if plans[kind] is not None:
                inv_freq = inverse_frequencies(head_dim, theta, negative_power=True)
                cos[kind], sin[kind] = rotary_tables(positions.flatten().index_select(0, index), inv_freq)
        h, hidden, attentions = run_encoder(
            self.layers, self.final_norm, h, cos, sin, shared, output_hidden_states, output_attentions
        )
        return E1Encoded(h, index, batch, seq, hidden, attentions, pad_index, pad_rows)

    @staticmethod
    def _kv_source(plan: AttentionPlan, context: int, batch: int, seq: int) -> torch.Tensor:
        """Per packed key (rows of `context` cached tokens, then the row's `seq` columns): its row in
        cat(context keys, packed query keys)."""
        row, column = plan.kv_index // (context + seq), plan.kv_index % (context + seq)
        packed = torch.full((batch * seq,), -1, dtype=torch.long, device=plan.kv_index.device)
        packed[plan.q_index] = torch.arange(plan.q_index.numel(), device=packed.device)
        own = packed[row * seq + (column - context).clamp(min=0)] + context
        return torch.where(column < context, column, own)

    def _embed(self, input_ids: torch.Tensor, sequence_ids: torch.Tensor, index: torch.Tensor):
        """Embeddings of the valid tokens, then one row per distinct padding token id (sequence id 0)."""
        flat_ids = input_ids.flatten()
        h = self.embed_tokens(flat_ids.index_select(0, index))
        h = h + self.embed_seq_id(sequence_ids.flatten().index_select(0, index))
        pad_index = pad_rows = None
        if index.numel() < flat_ids.numel():
            pad_index = (sequence_ids.flatten() < 0).nonzero().flatten()
            pad_tokens, pad_rows = torch.unique(flat_ids.index_select(0, pad_index), return_inverse=True)
            padding = self.embed_tokens(pad_tokens) + self.embed_seq_id(torch.zeros_like(pad_tokens))
            h = torch.cat((h, padding))
        device = input_ids.device.type
        if torch.is_autocast_enabled(device):
            h = h.to(torch.get_autocast_dtype(device))
        return h, pad_index, pad_rows


class E1ForMaskedLM(MaskedLMModel, E1PreTrainedModel):
    float_logits = True  # the official head returns float32 logits

    def __init__(self, config: E1Config) -> None:
        super().__init__(config, E1Model(config), decoder_bias=True)


class E1ForSequenceClassification(SequenceClassificationModel, E1PreTrainedModel):
    def __init__(self, config: E1Config) -> None:
        super().__init__(config, E1Model(config))


class E1ForTokenClassification(TokenClassificationModel, E1PreTrainedModel):
    def __init__(self, config: E1Config) -> None:
        super().__init__(config, E1Model(config))


__all__ = [
    "ATTRIBUTION",
    "E1_VOCAB",
    "E1ContextCache",
    "E1Encoded",
    "E1ForMaskedLM",
    "E1ForSequenceClassification",
    "E1ForTokenClassification",
    "E1Model",
    "E1PreTrainedModel",
    "default_positions",
    "prepare_e1_inputs",
    "query_identity",
    "read_context",
    "sample_context",
]
