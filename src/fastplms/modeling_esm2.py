"""ESM2 (Lin et al. 2023), exact to the official model, through fastplms' attention layer.

Official semantics: pre-LayerNorm blocks; rotary position embedding (rotate-half) applied after Q is
scaled by 1/sqrt(head_dim), so every backend runs with scale 1; token dropout rescaling of the
embeddings at inference; a final LayerNorm; an untied LM decoder with its own bias; the contact
head is a logistic regression over symmetrized, APC-corrected attention maps of every layer.

Padding-free: the mask is normalized once per forward; LayerNorms, projections, MLPs and heads run on
the packed valid tokens only, and just the attention call sees the (batch, seq) layout.

Shared pieces come from sibling runtime modules: rotary tables (`rotary.py`), the task heads and their
classes' construction (`heads.py`), input checks, weight init and the forward contract (`plm_base.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import mask_state, pad, unpad
from .compiled import run_layers_packed
from .configuration_esm2 import ESM2Config
from .heads import MaskedLMModel, SequenceClassificationModel, TokenClassificationModel
from .plm_base import AttentionLayer, Encoded, FastPLMPreTrainedModel, run_encoder
from .rotary import apply_rotary, inverse_frequencies, rotary_tables
from .tokenization_esm import ESM2_VOCAB

# Masked-token fraction seen in training (15% selected, 80% of those masked); official constant.
TRAIN_MASK_RATIO = 0.15 * 0.8
RESIDUES = "LAGVSERTIDPKQNFYMHWCXBUZO"


class ESM2Layer(AttentionLayer):
    attention_scale = 1.0  # q is pre-scaled before rotary, as in the official model

    def __init__(self, config: ESM2Config) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.attn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.qkv = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)
        self.mlp_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(d, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, d)

    def attention_inputs(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Packed (tokens, heads, head_dim) q (pre-scaled), k, v with rotary applied."""
        tokens, d = h.shape
        head_dim = d // self.num_heads
        q, k, v = self.qkv(self.attn_norm(h)).view(tokens, 3, self.num_heads, head_dim).unbind(1)
        # Back to the projection dtype (bf16 under autocast), as the official models do: float32 cos/sin
        # would otherwise promote q and k but not v, and flash kernels need one dtype for q, k, v.
        q, k = apply_rotary(q * head_dim**-0.5, cos, sin).to(v.dtype), apply_rotary(k, cos, sin).to(v.dtype)
        return q, k, v

    def finish(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection of packed attention outputs (tokens, heads, head_dim), residuals and MLP."""
        h = h + self.out_proj(attended.reshape(h.shape))
        return h + self.fc2(F.gelu(self.fc1(self.mlp_norm(h))))


class ESM2PreTrainedModel(FastPLMPreTrainedModel):
    config_class = ESM2Config
    base_model_prefix = "esm"
    _no_split_modules = ["ESM2Layer"]
    vocabulary = ESM2_VOCAB
    residues = RESIDUES

    def max_tokens(self) -> int:
        # ESM2 was trained on at most 1,024 residues plus <cls> and <eos>: longer inputs are refused.
        return self.config.max_position_embeddings


class ESM2Model(ESM2PreTrainedModel):
    # Artifacts hold the masked-LM checkpoint; the bare encoder simply does not use its LM head.
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]
    layer_class = ESM2Layer  # a family built on ESM2 (DPLM) subclasses the layer and names it here

    def __init__(self, config: ESM2Config) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(self.layer_class(config) for _ in range(config.num_hidden_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.contact_head = nn.Linear(config.num_hidden_layers * config.num_attention_heads, 1)
        self.post_init()

    def _embed(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self._rescale(self.embed_tokens(input_ids), input_ids, valid)

    def _rescale(self, x: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Token dropout at inference (`<mask>` rows zeroed, x * 0.88 / (1 - the row's observed mask ratio),
        in the official order of operations), then padding zeroed."""
        if self.config.token_dropout:
            masked = input_ids == self.config.mask_token_id
            x = x.masked_fill(masked[..., None], 0.0)
            observed = masked.sum(-1).to(x.dtype) / valid.sum(-1).to(x.dtype)
            x = x * (1 - TRAIN_MASK_RATIO) / (1 - observed)[:, None, None]
        return x * valid[..., None].to(x.dtype)

    def encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        warn_eager: bool = True,
    ) -> Encoded:
        """The encoder, packed; `forward` (plm_base) pads it and applies the head of the model class."""
        backend = self.checked_backend(input_ids, output_attentions, warn_eager)
        batch, seq = input_ids.shape
        state, valid = self.attention_state(input_ids, attention_mask)
        plan = self.attention_plan(backend, state)
        h, cos, sin = self._packed_inputs(input_ids, valid, plan.q_index)
        h, hidden, attentions = run_encoder(
            self.layers, self.final_norm, h, cos, sin, plan, output_hidden_states, output_attentions
        )
        return Encoded(h, plan.q_index, batch, seq, hidden, attentions)

    def attention_state(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        """(the forward's mask state, the valid tokens): the caller's mask; queries and keys alike."""
        state = mask_state(attention_mask, shape=tuple(input_ids.shape), device=input_ids.device)
        return state, state.valid

    def positions(self, input_ids: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Rotary position of each packed token (`indices` into (batch * seq)): its index in the row."""
        return indices % input_ids.shape[1]

    def _packed_inputs(self, input_ids, valid, indices):
        """Embeddings of the packed tokens and their rotary tables."""
        inv_freq = inverse_frequencies(
            self.config.hidden_size // self.config.num_attention_heads, self.config.rope_theta
        )
        cos, sin = rotary_tables(self.positions(input_ids, indices), inv_freq)
        h = unpad(self._embed(input_ids, valid), indices)
        return h, cos.to(h.dtype), sin.to(h.dtype)

    def embedding_core(self, input_ids: torch.Tensor, valid: torch.Tensor, compile) -> torch.Tensor:
        """Last hidden states (b, s, d) for `embed_dataset`'s compiled path (`compiled.py`), sdpa semantics.

        `valid` is an already-checked boolean (b, s) mask with a valid token in every row. `compile(fn)`
        returns `fn` compiled with dynamic shapes: here the two halves of a layer around attention, each
        compiled once and run for every layer on packed tokens around the attention facade. Same function
        as `forward` (sdpa backend).
        """
        self.check_input_ids(input_ids)
        self.check_dtypes(input_ids.device.type)
        plan = self.attention_plan("sdpa", mask_state(valid))
        h = run_layers_packed(self.layers, plan, *self._packed_inputs(input_ids, valid, plan.q_index), compile)
        return pad(self.final_norm(h), plan.q_index, *input_ids.shape)

    def predict_contacts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Contact probabilities (batch, L, L) over residues (specials removed), as the official head.

        Contacts are defined on attention maps, so this always runs eager attention.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        encoded = self.encode(input_ids, attention_mask, output_attentions=True, warn_eager=False)
        maps = torch.stack(encoded.attentions, dim=1)  # (b, layers, heads, s, s)
        keep = attention_mask.bool() & (input_ids != self.config.eos_token_id)
        pair = (keep[:, :, None] & keep[:, None, :]).to(maps.dtype)
        maps = (maps * pair[:, None, None])[..., 1:-1, 1:-1]
        b, layers, heads, s, _ = maps.shape
        maps = maps.reshape(b, layers * heads, s, s)
        maps = maps + maps.transpose(-1, -2)
        row, col, total = maps.sum(-1, keepdim=True), maps.sum(-2, keepdim=True), maps.sum((-1, -2), keepdim=True)
        maps = maps - row * col / total
        weight = self.contact_head.weight.to(maps.dtype)
        return torch.sigmoid(torch.einsum("bcij,c->bij", maps, weight[0]) + self.contact_head.bias.to(maps.dtype))


class ESM2ForMaskedLM(MaskedLMModel, ESM2PreTrainedModel):
    encoder_class = ESM2Model  # the task classes of a family built on ESM2 name their own base model

    def __init__(self, config: ESM2Config) -> None:
        # fair-esm's layout: a bias-free decoder and a separate `lm_head.bias`.
        super().__init__(config, self.encoder_class(config), decoder_bias=False)

    def predict_contacts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.esm.predict_contacts(input_ids, attention_mask)


class ESM2ForSequenceClassification(SequenceClassificationModel, ESM2PreTrainedModel):
    encoder_class = ESM2Model

    def __init__(self, config: ESM2Config) -> None:
        super().__init__(config, self.encoder_class(config))


class ESM2ForTokenClassification(TokenClassificationModel, ESM2PreTrainedModel):
    encoder_class = ESM2Model

    def __init__(self, config: ESM2Config) -> None:
        super().__init__(config, self.encoder_class(config))
