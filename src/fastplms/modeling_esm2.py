"""ESM2 (Lin et al. 2023), exact to the official model, through fastplms' attention layer.

Official semantics: pre-LayerNorm blocks; rotary position embedding (rotate-half) applied after Q is
scaled by 1/sqrt(head_dim), so every backend runs with scale 1; token dropout rescaling of the
embeddings at inference; a final LayerNorm; an untied LM decoder with its own bias; the contact
head is a logistic regression over symmetrized, APC-corrected attention maps of every layer.

Padding-free: the mask is normalized once per forward; LayerNorms, projections and MLPs run on the
packed valid tokens only, and just the attention call sees the (batch, seq) layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from .attention import MaskState, attention, mask_state, pad, unpad
from .compiled import run_layers_packed
from .configuration_esm2 import ESM2Config
from .embedding import ResidueEncoder
from .plm_base import FastPLMPreTrainedModel, classification_loss
from .tokenization_esm import ESM2_VOCAB

# Masked-token fraction seen in training (15% selected, 80% of those masked); official constant.
TRAIN_MASK_RATIO = 0.15 * 0.8
RESIDUES = "LAGVSERTIDPKQNFYMHWCXBUZO"


def rotary_inv_freq(config: ESM2Config) -> torch.Tensor:
    head_dim = config.hidden_size // config.num_attention_heads
    return 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding on packed (tokens, heads, head_dim) inputs."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class ESM2Layer(nn.Module):
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

    def forward(self, h, cos, sin, state: MaskState, indices, backend: str, want_probs: bool, lockfile=None):
        batch, seq = state.valid.shape
        q, k, v = (pad(t, indices, batch, seq).transpose(1, 2) for t in self.attention_inputs(h, cos, sin))
        result = attention(
            q, k, v, backend=backend, state=state, scale=1.0, return_probs=want_probs, flash_lockfile=lockfile
        )
        out, probs = result if want_probs else (result, None)
        return self.finish(h, unpad(out, indices)), probs

    def attention_inputs(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Packed (tokens, heads, head_dim) q (pre-scaled), k, v with rotary applied."""
        tokens, d = h.shape
        head_dim = d // self.num_heads
        q, k, v = self.qkv(self.attn_norm(h)).view(tokens, 3, self.num_heads, head_dim).unbind(1)
        # Back to the projection dtype (bf16 under autocast), as the official models do: float32 cos/sin
        # would otherwise promote q and k but not v, and flash kernels need one dtype for q, k, v.
        q, k = rotate(q * head_dim**-0.5, cos, sin).to(v.dtype), rotate(k, cos, sin).to(v.dtype)
        return q, k, v

    def finish(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection of packed attention outputs (tokens, heads, head_dim), residuals and MLP."""
        h = h + self.out_proj(attended.reshape(h.shape))
        return h + self.fc2(F.gelu(self.fc1(self.mlp_norm(h))))


class ESM2PreTrainedModel(FastPLMPreTrainedModel):
    config_class = ESM2Config
    base_model_prefix = "esm"
    _no_split_modules = ["ESM2Layer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # transformers.initialization leaves tensors loaded from a checkpoint alone; plain in-place ops would
        # overwrite e.g. a loaded Linear weight whose bias is missing from the checkpoint.
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, 0.0, 0.02)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, 0.0, 0.02)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, ESM2LMHead):
            init.zeros_(module.bias)
        elif isinstance(module, ESM2Model):
            # Non-persistent, so in no checkpoint: from_pretrained materializes it uninitialized.
            init.copy_(module.inv_freq, rotary_inv_freq(module.config))

    def residue_encoder(self) -> ResidueEncoder:
        ids = {token: i for i, token in enumerate(ESM2_VOCAB)}
        return ResidueEncoder(
            alphabet=frozenset(RESIDUES),
            to_id={r: ids[r] for r in RESIDUES},
            prefix=(self.config.cls_token_id,),
            suffix=(self.config.eos_token_id,),
            pad_id=self.config.pad_token_id,
            max_residues=self.config.max_position_embeddings - 2,
        )


class ESM2Model(ESM2PreTrainedModel):
    # Artifacts hold the masked-LM checkpoint; the bare encoder simply does not use its LM head.
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config: ESM2Config) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(ESM2Layer(config) for _ in range(config.num_hidden_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.contact_head = nn.Linear(config.num_hidden_layers * config.num_attention_heads, 1)
        self.register_buffer("inv_freq", rotary_inv_freq(config), persistent=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def _check_inputs(self, input_ids: torch.Tensor) -> None:
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must have shape (batch, seq); received {tuple(input_ids.shape)}.")
        limit = self.config.max_position_embeddings
        if input_ids.shape[1] > limit:
            raise ValueError(
                f"input has {input_ids.shape[1]} tokens; {self.config.family} supports at most {limit} "
                f"({limit - 2} residues plus <cls> and <eos>). Truncate with tokenizer(..., truncation=True)."
            )
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}).")

    def _embed(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.config.token_dropout:
            masked = input_ids == self.config.mask_token_id
            x = x.masked_fill(masked[..., None], 0.0)
            observed = masked.sum(-1).to(x.dtype) / valid.sum(-1).to(x.dtype)
            x = x * ((1 - TRAIN_MASK_RATIO) / (1 - observed))[:, None, None]
        return x * valid[..., None].to(x.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        return_dict: bool | None = None,
        _warn_eager: bool = True,
        **kwargs,
    ) -> BaseModelOutput:
        self._check_inputs(input_ids)
        self.check_dtypes(input_ids.device.type)
        batch, seq = input_ids.shape
        backend = self.attention_backend(output_attentions, warn=_warn_eager)
        state = mask_state(attention_mask, shape=(batch, seq), device=input_ids.device)
        indices = state.valid.flatten().nonzero().flatten()
        lockfile = self.flash_lockfile() if backend.startswith("flash") else None
        h, hidden, attentions = self._encode(
            input_ids, state, indices, backend, output_attentions, output_hidden_states, lockfile
        )
        return BaseModelOutput(
            last_hidden_state=pad(h, indices, batch, seq),
            hidden_states=tuple(pad(x, indices, batch, seq) for x in hidden) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )

    def _encode(self, input_ids, state: MaskState, indices, backend, want_probs, want_hidden, lockfile=None):
        """The encoder on already-validated inputs: packed final states (tokens, d), per-layer states, maps."""
        h, cos, sin = self._packed_inputs(input_ids, state.valid, indices)
        hidden, attentions = [], []
        for layer in self.layers:
            if want_hidden:
                hidden.append(h)
            h, probs = layer(h, cos, sin, state, indices, backend, want_probs, lockfile)
            if want_probs:
                attentions.append(probs)
        h = self.final_norm(h)
        if want_hidden:
            hidden.append(h)
        return h, hidden, attentions

    def _packed_inputs(self, input_ids, valid, indices):
        seq = input_ids.shape[1]
        freqs = (indices % seq).float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        h = unpad(self._embed(input_ids, valid), indices)
        return h, angles.cos().to(h.dtype), angles.sin().to(h.dtype)

    def embedding_core(self, input_ids: torch.Tensor, valid: torch.Tensor, compile) -> torch.Tensor:
        """Last hidden states (b, s, d) for `embed_dataset`'s compiled path (`compiled.py`), sdpa semantics.

        `valid` is an already-checked boolean (b, s) mask with a valid token in every row. `compile(fn)`
        returns `fn` compiled with dynamic shapes: here the two halves of a layer around attention, each
        compiled once and run for every layer on packed tokens. Attention runs per sequence on its own
        valid tokens (no padding, no mask), which is what the padded masked SDPA computes. Same function
        as `forward` (sdpa backend).
        """
        self._check_inputs(input_ids)
        self.check_dtypes(input_ids.device.type)
        batch, seq = input_ids.shape
        indices = valid.flatten().nonzero().flatten()
        h = run_layers_packed(self.layers, valid, *self._packed_inputs(input_ids, valid, indices), compile)
        return pad(self.final_norm(h), indices, batch, seq)

    def predict_contacts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Contact probabilities (batch, L, L) over residues (specials removed), as the official head.

        Contacts are defined on attention maps, so this always runs eager attention.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        out = self(input_ids, attention_mask, output_attentions=True, _warn_eager=False)
        maps = torch.stack(out.attentions, dim=1)  # (b, layers, heads, s, s)
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


class ESM2LMHead(nn.Module):
    def __init__(self, config: ESM2Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(x)))) + self.bias


class ESM2ForMaskedLM(ESM2PreTrainedModel):
    def __init__(self, config: ESM2Config) -> None:
        super().__init__(config)
        self.esm = ESM2Model(config)
        self.lm_head = ESM2LMHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        out = self.esm(input_ids, attention_mask, output_hidden_states, output_attentions)
        logits = self.lm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)

    def predict_contacts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.esm.predict_contacts(input_ids, attention_mask)


class ESM2ForSequenceClassification(ESM2PreTrainedModel):
    """Classification head on the <cls> state: dense, tanh, projection (the Transformers ESM layout)."""

    def __init__(self, config: ESM2Config) -> None:
        super().__init__(config)
        self.esm = ESM2Model(config)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        return_dict: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        out = self.esm(input_ids, attention_mask, output_hidden_states, output_attentions)
        x = torch.tanh(self.dense(self.dropout(out.last_hidden_state[:, 0])))
        logits = self.out_proj(self.dropout(x))
        loss = None if labels is None else classification_loss(self.config, logits, labels)
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )


class ESM2ForTokenClassification(ESM2PreTrainedModel):
    def __init__(self, config: ESM2Config) -> None:
        super().__init__(config)
        self.esm = ESM2Model(config)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        return_dict: bool | None = None,
        **kwargs,
    ) -> TokenClassifierOutput:
        out = self.esm(input_ids, attention_mask, output_hidden_states, output_attentions)
        logits = self.classifier(self.dropout(out.last_hidden_state))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, self.config.num_labels).float(), labels.view(-1))
        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
