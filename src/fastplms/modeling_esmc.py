"""ESMC (ESM Cambrian; published here as ESM++), exact to EvolutionaryScale's `esm` package.

Official semantics (esm 3.2.1: esm/models/esmc.py, esm/layers/{blocks,attention,rotary,
transformer_stack,regression_head}.py):

- a 64-row token embedding; pre-LayerNorm blocks whose residual branches are divided by sqrt(L / 36);
- attention: LayerNorm and a bias-free fused QKV projection (chunks q, k, v in that order), LayerNorms
  without bias on q and k over the full width, rotary (rotate-half, base 10,000) per head, softmax scale
  1/sqrt(head_dim), a bias-free output projection;
- MLP: LayerNorm, a bias-free projection to 2h whose first half is gated (silu(a) * b), a bias-free
  projection back; h = 8/3 d rounded up to a multiple of 256;
- a final LayerNorm without bias, and the sequence head Linear-GELU-LayerNorm-Linear to 64 logits.

Masking follows the official contract: `sequence_id` (bool, or integers with -1 for padding) is
authoritative; token i attends to j iff they share an id. Without it, `attention_mask` is read as a boolean
sequence id, and without either, every non-<pad> token is one sequence (the official default). Rotary
positions are a token's index in its row, as in the official non-flash path.

Outputs: `last_hidden_state` is the final-norm output (the official `embeddings`); `hidden_states` holds
L + 1 tensors, the embeddings followed by every block's output before the final norm, so that
`hidden_states[1:]` are exactly the official `hidden_states`. Padding positions are zeros everywhere.

Padding-free: the mask is normalized once per forward; LayerNorms, projections, MLPs and heads run on the
packed valid tokens only, and just the attention call sees the (batch, seq) layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from .attention import FLASH_BACKENDS, MaskState, attention, mask_state, pad, unpad
from .compiled import run_layers_packed
from .configuration_esmc import ESMCConfig
from .embedding import ResidueEncoder
from .plm_base import FastPLMPreTrainedModel, classification_loss
from .tokenization_esm import ESMC_VOCAB

RESIDUES = "LAGVSERTIDPKQNFYMHWCXBUZO"


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding on packed (tokens, heads, head_dim) inputs."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class ESMCLayer(nn.Module):
    def __init__(self, config: ESMCConfig) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        # Divided, not multiplied by the reciprocal, so the floats match the official blocks.
        self.residual_scale = math.sqrt(config.num_hidden_layers / 36)
        self.attn_norm = nn.LayerNorm(d, eps=eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.q_norm = nn.LayerNorm(d, eps=eps, bias=False)
        self.k_norm = nn.LayerNorm(d, eps=eps, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.LayerNorm(d, eps=eps)
        self.fc1 = nn.Linear(d, 2 * config.intermediate_size, bias=False)
        self.fc2 = nn.Linear(config.intermediate_size, d, bias=False)

    def forward(self, h, cos, sin, state: MaskState, indices, backend: str, want_probs: bool, lockfile=None):
        batch, seq = state.valid.shape
        q, k, v = (pad(t, indices, batch, seq).transpose(1, 2) for t in self.attention_inputs(h, cos, sin))
        result = attention(
            q,
            k,
            v,
            backend=backend,
            state=state,
            scale=q.shape[-1] ** -0.5,
            return_probs=want_probs,
            flash_lockfile=lockfile,
        )
        out, probs = result if want_probs else (result, None)
        return self.finish(h, unpad(out, indices)), probs

    def attention_inputs(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Packed (tokens, heads, head_dim) q, k, v with the q/k norms and rotary applied."""
        tokens, d = h.shape
        q, k, v = self.qkv(self.attn_norm(h)).chunk(3, dim=-1)
        # The norms run in float32 under autocast; back to the projection dtype, as the official code does.
        q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        q, k, v = (t.reshape(tokens, self.num_heads, d // self.num_heads) for t in (q, k, v))
        # Rotary tables in the q/k dtype (bf16 under autocast), as the official cache is built.
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection of packed attention outputs (tokens, heads, head_dim), scaled residuals, MLP."""
        h = h + self.out_proj(attended.reshape(h.shape)) / self.residual_scale
        gate, value = self.fc1(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.fc2(F.silu(gate) * value) / self.residual_scale


class ESMCPreTrainedModel(FastPLMPreTrainedModel):
    config_class = ESMCConfig
    base_model_prefix = "esmc"
    _no_split_modules = ["ESMCLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, 0.02)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, 0.02)
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            if module.bias is not None:
                module.bias.zero_()

    def residue_encoder(self) -> ResidueEncoder:
        ids = {token: i for i, token in enumerate(ESMC_VOCAB)}
        return ResidueEncoder(
            alphabet=frozenset(RESIDUES),
            to_id={r: ids[r] for r in RESIDUES},
            prefix=(self.config.cls_token_id,),
            suffix=(self.config.eos_token_id,),
            pad_id=self.config.pad_token_id,
            max_residues=self.config.max_position_embeddings - 2,
        )


class _Encoded:
    """Packed result of the encoder, before padding back to (batch, seq)."""

    def __init__(self, h, indices, batch, seq, hidden, attentions) -> None:
        self.h, self.indices, self.batch, self.seq = h, indices, batch, seq
        self.hidden, self.attentions = hidden, attentions

    def padded(self, packed: torch.Tensor) -> torch.Tensor:
        return pad(packed, self.indices, self.batch, self.seq)

    def hidden_states(self) -> tuple[torch.Tensor, ...] | None:
        return None if self.hidden is None else tuple(self.padded(x) for x in self.hidden)


class ESMCModel(ESMCPreTrainedModel):
    # Artifacts hold the masked-LM checkpoint; the bare encoder simply does not use its LM head.
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config: ESMCConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(ESMCLayer(config) for _ in range(config.num_hidden_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def _check_inputs(self, input_ids: torch.Tensor) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be a tensor of shape (batch, seq); received {shape}.")
        if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids; received dtype {input_ids.dtype}.")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}).")

    def _mask_state(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        sequence_id: torch.Tensor | None,
        backend: str,
    ) -> MaskState:
        """The official masking contract, normalized once for every layer."""
        shape, device = tuple(input_ids.shape), input_ids.device
        if sequence_id is None:
            if attention_mask is None:
                # Official default: every non-<pad> token belongs to the one sequence.
                attention_mask = input_ids != self.config.pad_token_id
            return mask_state(attention_mask, shape=shape, device=device)
        if not isinstance(sequence_id, torch.Tensor):
            raise TypeError(f"sequence_id must be a torch.Tensor, got {type(sequence_id).__name__}.")
        if tuple(sequence_id.shape) != shape:
            raise ValueError(
                f"sequence_id must have the shape of input_ids (batch, seq) = {shape}; "
                f"received {tuple(sequence_id.shape)}."
            )
        if sequence_id.is_floating_point() or sequence_id.is_complex():
            raise ValueError(
                "sequence_id must be bool (True = token) or integers (-1 = padding); "
                f"received dtype {sequence_id.dtype}."
            )
        if sequence_id.dtype == torch.bool:
            state = mask_state(sequence_id, shape=shape, device=device)
        else:
            if backend in FLASH_BACKENDS:
                raise ValueError(
                    f"integer sequence_id (several sequences per row) is not supported by {backend}, whose kernel "
                    "path takes padding masks only; pass a bool sequence_id or use eager, sdpa or flex_attention."
                )
            state = mask_state(sequence_ids=sequence_id, semantics="sequence", shape=shape, device=device)
        if attention_mask is not None:
            given = mask_state(attention_mask, shape=shape, device=device).valid
            if not torch.equal(given, state.valid):
                raise ValueError(
                    "attention_mask and sequence_id disagree on which tokens are padding; sequence_id decides, "
                    "so pass a matching attention_mask or none."
                )
        return state

    def _encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        sequence_id: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        warn_eager: bool = True,
    ) -> _Encoded:
        self._check_inputs(input_ids)
        self.check_dtypes(input_ids.device.type)
        batch, seq = input_ids.shape
        backend = self.attention_backend(output_attentions, warn=warn_eager)
        state = self._mask_state(input_ids, attention_mask, sequence_id, backend)
        indices = state.valid.flatten().nonzero().flatten()
        h, cos, sin = self._packed_inputs(input_ids, indices)
        lockfile = self.flash_lockfile() if backend.startswith("flash") else None
        hidden = [h] if output_hidden_states else None
        attentions = [] if output_attentions else None
        for layer in self.layers:
            h, probs = layer(h, cos, sin, state, indices, backend, output_attentions, lockfile)
            if output_hidden_states:
                hidden.append(h)
            if output_attentions:
                attentions.append(probs)
        return _Encoded(self.final_norm(h), indices, batch, seq, hidden, attentions)

    def _packed_inputs(self, input_ids: torch.Tensor, indices: torch.Tensor):
        """Embeddings of the valid tokens and their rotary tables (float32; positions = index in the row)."""
        seq = input_ids.shape[1]
        h = self.embed_tokens(input_ids.flatten().index_select(0, indices))
        # Computed per call rather than kept as a buffer: Transformers leaves non-persistent buffers
        # uninitialized after from_pretrained, and the formula costs nothing.
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=indices.device) / head_dim
        inv_freq = 1 / self.config.rope_theta**exponent
        freqs = (indices % seq).float()[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return h, angles.cos(), angles.sin()

    def embedding_core(self, input_ids: torch.Tensor, valid: torch.Tensor, compile) -> torch.Tensor:
        """Last hidden states (b, s, d) for `embed_dataset`'s compiled path (`compiled.py`), sdpa semantics.

        `valid` is an already-checked boolean (b, s) mask with a valid token in every row: one sequence per
        row, as `embed_dataset` batches them. The two halves of a layer around attention are compiled once
        (dynamic token counts) and run for every layer on packed tokens; attention runs per sequence on its
        own tokens. Same function as `forward` with that mask (sdpa backend).
        """
        self._check_inputs(input_ids)
        self.check_dtypes(input_ids.device.type)
        batch, seq = input_ids.shape
        indices = valid.flatten().nonzero().flatten()
        scale = (self.config.hidden_size // self.config.num_attention_heads) ** -0.5
        h = run_layers_packed(self.layers, valid, *self._packed_inputs(input_ids, indices), compile, scale)
        return pad(self.final_norm(h), indices, batch, seq)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        sequence_id: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput:
        enc = self._encode(input_ids, attention_mask, sequence_id, bool(output_hidden_states), bool(output_attentions))
        return BaseModelOutput(
            last_hidden_state=enc.padded(enc.h),
            hidden_states=enc.hidden_states(),
            attentions=None if enc.attentions is None else tuple(enc.attentions),
        )


class ESMCLMHead(nn.Module):
    """The official sequence head: Linear(d, d), GELU, LayerNorm(d), Linear(d, 64)."""

    def __init__(self, config: ESMCConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(x))))


class ESMCForMaskedLM(ESMCPreTrainedModel):
    def __init__(self, config: ESMCConfig) -> None:
        super().__init__(config)
        self.esmc = ESMCModel(config)
        self.lm_head = ESMCLMHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        sequence_id: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        enc = self.esmc._encode(
            input_ids, attention_mask, sequence_id, bool(output_hidden_states), bool(output_attentions)
        )
        logits = enc.padded(self.lm_head(enc.h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1), ignore_index=-100)
        return MaskedLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=enc.hidden_states(),
            attentions=None if enc.attentions is None else tuple(enc.attentions),
        )


class ESMCForSequenceClassification(ESMCPreTrainedModel):
    """Classification head on the <cls> state: dense, tanh, projection (the Transformers ESM layout)."""

    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config: ESMCConfig) -> None:
        super().__init__(config)
        self.esmc = ESMCModel(config)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        sequence_id: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        return_dict: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        out = self.esmc(input_ids, attention_mask, sequence_id, output_hidden_states, output_attentions)
        x = torch.tanh(self.dense(self.dropout(out.last_hidden_state[:, 0])))
        logits = self.out_proj(self.dropout(x))
        loss = None if labels is None else classification_loss(self.config, logits, labels)
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )


class ESMCForTokenClassification(ESMCPreTrainedModel):
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config: ESMCConfig) -> None:
        super().__init__(config)
        self.esmc = ESMCModel(config)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        sequence_id: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        return_dict: bool | None = None,
        **kwargs,
    ) -> TokenClassifierOutput:
        enc = self.esmc._encode(
            input_ids, attention_mask, sequence_id, bool(output_hidden_states), bool(output_attentions)
        )
        logits = enc.padded(self.classifier(self.dropout(enc.h)))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, self.config.num_labels).float(), labels.view(-1))
        return TokenClassifierOutput(
            loss=loss,
            logits=logits,
            hidden_states=enc.hidden_states(),
            attentions=None if enc.attentions is None else tuple(enc.attentions),
        )
