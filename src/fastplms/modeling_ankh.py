"""ANKH (Elnaggar et al. 2023): T5 v1.1 protein models, exact to Transformers' T5, through fastplms' attention.

T5 v1.1 semantics, as the official checkpoints run them in Transformers' `T5EncoderModel` and
`T5ForConditionalGeneration`: pre-RMSNorm blocks (variance in float32, no bias, no mean); **unscaled**
attention scores plus a bucketed relative position bias that the first layer of each stack owns and every
layer shares (bidirectional buckets in the encoder, causal ones in the decoder; cross-attention has none);
a gated FFN, act(wi_0 x) * wi_1 x -> wo (GELU tanh for v1, SiLU for v2/v3); a final RMSNorm; an untied LM
head with no d^-0.5 rescaling. Padded positions are queries too (the official mask is on keys), so every
output at padding is the official one.

The relative bias goes to the attention facade as an additive bias, so eager and SDPA both serve the
encoder and the decoder (Transformers' T5 runs eager only). The backend is the model instance's own
(`set_attn_implementation`); nothing process-global is changed.

Classes: `ANKHModel` (AutoModel: the encoder, as `T5EncoderModel`), `ANKHForConditionalGeneration`
(AutoModelForSeq2SeqLM: encoder, decoder with an incremental cache, Transformers' `generate`), sequence and
token classification on the encoder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput, SequenceClassifierOutput

from .attention import attend, mask_state
from .configuration_ankh import ANKHConfig
from .heads import SequenceClassificationModel, TokenClassificationModel, classification_loss, task_output, token_loss
from .plm_base import Encoded, FastPLMPreTrainedModel

RESIDUES = "ACDEFGHIKLMNPQRSTVWYXBUZO"


class T5Norm(nn.Module):
    """RMSNorm as T5's: float32 variance, x * rsqrt(variance + eps), cast to a half weight's dtype, times weight."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


def relative_buckets(relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of each relative position (key - query): exact below half the buckets, then logarithmic
    up to `max_distance`; bidirectional buckets spend half of them on keys after the query."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = num_buckets // 2
    scaled = torch.log(distance.float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    large = (exact + scaled.to(torch.long)).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, large)


class RelativeBias(nn.Module):
    """The learned bias per (bucket, head): (1, heads, queries, keys) for query and key positions."""

    def __init__(self, config: ANKHConfig, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.weight = nn.Parameter(torch.zeros(self.num_buckets, config.num_attention_heads))

    def forward(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        relative = key_positions[None, :] - query_positions[:, None]
        buckets = relative_buckets(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return F.embedding(buckets, self.weight).permute(2, 0, 1)[None]


class Attention(nn.Module):
    """q, k, v, o projections without biases; heads * d_kv wide."""

    def __init__(self, config: ANKHConfig) -> None:
        super().__init__()
        d, inner = config.hidden_size, config.num_attention_heads * config.d_kv
        self.heads, self.d_kv = config.num_attention_heads, config.d_kv
        self.q, self.k, self.v = (nn.Linear(d, inner, bias=False) for _ in range(3))
        self.o = nn.Linear(inner, d, bias=False)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.heads, self.d_kv)


class FeedForward(nn.Module):
    def __init__(self, config: ANKHConfig) -> None:
        super().__init__()
        d, ff = config.hidden_size, config.intermediate_size
        self.wi_0, self.wi_1 = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.wo = nn.Linear(ff, d, bias=False)
        self.gelu = config.feed_forward_proj == "gated-gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.wi_0(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.wo(gate * self.wi_1(x))


class EncoderLayer(nn.Module):
    def __init__(self, config: ANKHConfig) -> None:
        super().__init__()
        self.attn_norm = T5Norm(config.hidden_size, config.layer_norm_eps)
        self.attention = Attention(config)
        self.mlp_norm = T5Norm(config.hidden_size, config.layer_norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, h: torch.Tensor, plan, bias: torch.Tensor, want_probs: bool = False):
        """h: every position, (batch * seq, d); the plan's keys are the valid ones (`plan.kv_index`)."""
        x = self.attn_norm(h)
        a = self.attention
        q, k, v = a.split(a.q(x)), a.split(a.k(x)), a.split(a.v(x))
        if plan.state.kv_valid is not None:  # h holds every position; the keys are the valid ones
            k, v = k.index_select(0, plan.kv_index), v.index_select(0, plan.kv_index)
        result = attend(q, k, v, plan, bias=bias, scale=1.0, return_probs=want_probs)
        out, probs = result if want_probs else (result, None)
        h = h + a.o(out.reshape(h.shape[0], -1))
        return h + self.mlp(self.mlp_norm(h)), probs


@dataclass
class ANKHEncoded(Encoded):
    """`Encoded` over every position, with the residue positions (valid tokens but `</s>`) for pooling."""

    residue_mask: torch.Tensor | None = None


class ANKHPreTrainedModel(FastPLMPreTrainedModel):
    config_class = ANKHConfig
    base_model_prefix = "encoder"
    _no_split_modules = ["EncoderLayer", "DecoderLayer"]
    residues = RESIDUES

    def residue_encoder(self):
        """Residues to ids as the model's own tokenizer (its artifact's) numbers them: `residues </s>`."""
        from .embedding import ResidueEncoder

        tokenizer = self.embedding_tokenizer()
        residues = tokenizer.residues
        return ResidueEncoder(
            alphabet=frozenset(residues),
            to_id=dict(zip(residues, tokenizer.convert_tokens_to_ids(list(residues)), strict=True)),
            prefix=(),
            suffix=(self.config.eos_token_id,),
            pad_id=self.config.pad_token_id,
            max_residues=self.config.max_position_embeddings,
        )

    def embedding_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # Embeddings read valid positions only: skip computing the padded ones (the official model does).
        encoded = self.base_model.encode(input_ids, attention_mask, padding_outputs=False)
        return encoded.padded(encoded.h)

    def embedding_tokenizer(self):
        """The tokenizer that numbers residues for `embed_dataset`: the one set by `set_embedding_tokenizer`,
        else the one beside the weights this model was loaded from (ANKH generations number residues
        differently, so there is no built-in table)."""
        tokenizer = self.__dict__.get("_fastplms_tokenizer")
        if tokenizer is None:
            source = getattr(self.config, "_name_or_path", "") or ""
            if not source:
                raise ValueError(
                    "embed_dataset needs the model's tokenizer: load the model from its artifact, or call "
                    "set_embedding_tokenizer(AutoTokenizer.from_pretrained(<artifact>, trust_remote_code=True))."
                )
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=True)
            self.__dict__["_fastplms_tokenizer"] = tokenizer
        return tokenizer

    def set_embedding_tokenizer(self, tokenizer) -> None:
        self.__dict__["_fastplms_tokenizer"] = tokenizer

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        from transformers import initialization as init

        if isinstance(module, T5Norm):
            init.ones_(module.weight)
        elif isinstance(module, RelativeBias):
            init.normal_(module.weight, 0.0, 0.02)
        else:
            super()._init_weights(module)


def official_queries_and_keys(input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """(mask state, valid keys) of T5's key-padding mask: every position queries, the unmasked ones are keys.

    Without a mask T5 attends every position (padding tokens included), as Transformers' T5 does.
    """
    shape = tuple(input_ids.shape)
    keys = mask_state(attention_mask, shape=shape, device=input_ids.device).valid
    return mask_state(torch.ones_like(keys), kv_attention_mask=keys, shape=shape, kv_shape=shape), keys


class ANKHModel(ANKHPreTrainedModel):
    """The encoder (Transformers' `T5EncoderModel`): embeddings, layers sharing layer 0's bias, final norm."""

    # Artifacts hold the sequence-to-sequence checkpoint; the encoder does not use the decoder or the LM head.
    _keys_to_ignore_on_load_unexpected = [r"^decoder\.", r"^lm_head\."]

    def __init__(self, config: ANKHConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.relative_bias = RelativeBias(config, bidirectional=True)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.final_norm = T5Norm(config.hidden_size, config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        warn_eager: bool = True,
        padding_outputs: bool = True,
    ) -> Encoded:
        """The encoder. `padding_outputs=False` (embeddings) computes the valid tokens only: they never see
        padding, so they are the same, and padded positions come back as zeros."""
        backend = self.checked_backend(input_ids, output_attentions, warn_eager)
        batch, seq = input_ids.shape
        state, keys = official_queries_and_keys(input_ids, attention_mask)
        if not padding_outputs:
            state = mask_state(keys)
        plan = self.attention_plan(backend, state)
        positions = torch.arange(seq, device=input_ids.device)
        bias = self.relative_bias(positions, positions)
        h = self.embed_tokens(input_ids).flatten(0, 1).index_select(0, plan.q_index)
        hidden = [] if output_hidden_states else None
        attentions = [] if output_attentions else None
        for layer in self.layers:
            if hidden is not None:
                hidden.append(h)
            h, probs = layer(h, plan, bias, output_attentions)
            if attentions is not None:
                attentions.append(probs)
        h = self.final_norm(h)
        if hidden is not None:
            hidden.append(h)
        residues = keys & (input_ids != self.config.eos_token_id)
        return ANKHEncoded(h, plan.q_index, batch, seq, hidden, attentions, residues)


class DecoderLayer(nn.Module):
    def __init__(self, config: ANKHConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.self_norm = T5Norm(config.hidden_size, config.layer_norm_eps)
        self.self_attention = Attention(config)
        self.cross_norm = T5Norm(config.hidden_size, config.layer_norm_eps)
        self.cross_attention = Attention(config)
        self.mlp_norm = T5Norm(config.hidden_size, config.layer_norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, h, self_plan, cross_plan, bias, memory, cache: EncoderDecoderCache | None, batch: int):
        """h (batch * tgt, d) decoder tokens; `memory` (batch * src, d) the encoder's output (keys: the plan's)."""
        a = self.self_attention
        x = self.self_norm(h)
        q, k, v = a.split(a.q(x)), a.split(a.k(x)), a.split(a.v(x))
        if cache is not None:  # keys and values of every earlier step, then this step's
            k, v = (t.view(batch, -1, *t.shape[1:]).transpose(1, 2) for t in (k, v))
            k, v = cache.self_attention_cache.update(k, v, self.index)
            k, v = (t.transpose(1, 2).flatten(0, 1) for t in (k, v))
        h = h + a.o(attend(q, k, v, self_plan, bias=bias, scale=1.0).reshape(h.shape[0], -1))
        c = self.cross_attention
        q = c.split(c.q(self.cross_norm(h)))
        if cache is not None and cache.is_updated.get(self.index):  # the encoder's keys, computed at step 0
            layer = cache.cross_attention_cache.layers[self.index]
            k, v = (t.transpose(1, 2).flatten(0, 1) for t in (layer.keys, layer.values))
        else:
            k, v = c.split(c.k(memory)), c.split(c.v(memory))
            if cache is not None:
                grid = (batch, -1, *k.shape[1:])
                cache.cross_attention_cache.update(
                    k.view(grid).transpose(1, 2), v.view(grid).transpose(1, 2), self.index
                )
                cache.is_updated[self.index] = True
        k, v = k.index_select(0, cross_plan.kv_index), v.index_select(0, cross_plan.kv_index)
        h = h + c.o(attend(q, k, v, cross_plan, scale=1.0).reshape(h.shape[0], -1))
        return h + self.mlp(self.mlp_norm(h))


class ANKHDecoder(nn.Module):
    """T5's decoder stack; the embeddings are the encoder's (T5 shares one table)."""

    def __init__(self, config: ANKHConfig) -> None:
        super().__init__()
        self.relative_bias = RelativeBias(config, bidirectional=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_decoder_layers))
        self.final_norm = T5Norm(config.hidden_size, config.layer_norm_eps)


class ANKHForConditionalGeneration(GenerationMixin, ANKHPreTrainedModel):
    """Encoder-decoder with an untied LM head, Transformers' `generate` (greedy, sampling, beams) and an
    incremental decoder cache (`EncoderDecoderCache`: self-attention keys grow per step, cross-attention
    keys are computed once)."""

    main_input_name = "input_ids"
    _supports_cache_class = True

    def __init__(self, config: ANKHConfig) -> None:
        super().__init__(config)
        self.encoder = ANKHModel(config)
        self.decoder = ANKHDecoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_encoder(self) -> ANKHModel:
        return self.encoder

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        cache_position: torch.Tensor | None = None,
        inputs_embeds: None = None,
        decoder_inputs_embeds: None = None,
    ) -> Seq2SeqLMOutput | tuple:
        """Transformers' T5 contract: `decoder_input_ids` (or `labels`, shifted right behind the decoder start
        token) on `input_ids` (or precomputed `encoder_outputs`); the loss ignores -100 labels."""
        if inputs_embeds is not None or decoder_inputs_embeds is not None:
            raise ValueError("ANKH takes token ids; inputs_embeds / decoder_inputs_embeds are not supported.")
        if decoder_attention_mask is not None and not bool(decoder_attention_mask.bool().all()):
            raise ValueError("decoder_attention_mask with padding is not supported: decoder rows are causal.")
        config = self.config
        want_hidden = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        if encoder_outputs is None:
            if input_ids is None:
                raise ValueError("give input_ids or encoder_outputs.")
            encoded = self.encoder.encode(input_ids, attention_mask, output_hidden_states=bool(want_hidden))
            encoder_outputs = BaseModelOutput(
                last_hidden_state=encoded.padded(encoded.h), hidden_states=encoded.hidden_states()
            )
        elif isinstance(encoder_outputs, tuple):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        memory = encoder_outputs.last_hidden_state
        if labels is not None and decoder_input_ids is None:
            decoder_input_ids = labels.new_full(labels.shape, config.decoder_start_token_id)
            decoder_input_ids[:, 1:] = labels[:, :-1].masked_fill(labels[:, :-1] == -100, config.pad_token_id)
        if decoder_input_ids is None:
            raise ValueError("give decoder_input_ids or labels.")
        self.encoder.check_input_ids(decoder_input_ids)
        self.check_dtypes(decoder_input_ids.device.type)
        if use_cache is None:
            use_cache = labels is None and not self.training
        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache())
        cache = past_key_values if use_cache else None
        logits, decoder_hidden = self.decode(decoder_input_ids, memory, attention_mask, cache, bool(want_hidden))
        loss = None if labels is None else token_loss(logits, labels)
        output = Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            past_key_values=cache,
            decoder_hidden_states=decoder_hidden,
            encoder_last_hidden_state=memory,
            encoder_hidden_states=encoder_outputs.hidden_states,
        )
        return output if (config.return_dict if return_dict is None else return_dict) else output.to_tuple()

    def decode(self, decoder_input_ids, memory, attention_mask, cache, want_hidden: bool):
        """Logits (batch, tgt, vocab) of the decoder on `memory` (batch, src, d) after `cache`'s steps."""
        backend = self.attention_backend()
        batch, tgt = decoder_input_ids.shape
        src = memory.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        device = decoder_input_ids.device
        total = past + tgt
        self_state = mask_state(shape=(batch, tgt), kv_shape=(batch, total), semantics="causal", device=device)
        self_plan = self.attention_plan(backend, self_state)
        keys = mask_state(attention_mask, shape=(batch, src), device=device).valid
        cross_state = mask_state(shape=(batch, tgt), kv_attention_mask=keys, kv_shape=(batch, src), device=device)
        cross_plan = self.attention_plan(backend, cross_state)
        positions = torch.arange(total, device=device)
        bias = self.decoder.relative_bias(positions[past:], positions)
        h = self.encoder.embed_tokens(decoder_input_ids).flatten(0, 1)
        flat_memory = memory.flatten(0, 1)
        hidden = [] if want_hidden else None
        for layer in self.decoder.layers:
            if hidden is not None:
                hidden.append(h.view(batch, tgt, -1))
            h = layer(h, self_plan, cross_plan, bias, flat_memory, cache, batch)
        h = self.decoder.final_norm(h)
        if hidden is not None:
            hidden.append(h.view(batch, tgt, -1))
        logits = self.lm_head(h).view(batch, tgt, -1)
        return logits, None if hidden is None else tuple(hidden)


class ANKHForSequenceClassification(SequenceClassificationModel, ANKHPreTrainedModel):
    """The shared sequence head (dense, tanh, projection) on the mean of the residue states: T5 has no
    `<cls>`, so the encoder's states are mean-pooled over residues (`</s>` and padding left out)."""

    _keys_to_ignore_on_load_unexpected = [r"^decoder\.", r"^lm_head\."]

    def __init__(self, config: ANKHConfig) -> None:
        super().__init__(config, ANKHModel(config))

    def head_output(self, encoded: ANKHEncoded, labels: torch.Tensor | None):
        states = encoded.padded(encoded.h)
        weights = encoded.residue_mask.to(states.dtype)[..., None]
        pooled = (states * weights).sum(1) / weights.sum(1).clamp(min=1)
        logits = self.out_proj(self.dropout(torch.tanh(self.dense(self.dropout(pooled)))))
        loss = None if labels is None else classification_loss(self.config, logits, labels)
        return task_output(SequenceClassifierOutput, encoded, logits, loss)


class ANKHForTokenClassification(TokenClassificationModel, ANKHPreTrainedModel):
    _keys_to_ignore_on_load_unexpected = [r"^decoder\.", r"^lm_head\."]

    def __init__(self, config: ANKHConfig) -> None:
        super().__init__(config, ANKHModel(config))
