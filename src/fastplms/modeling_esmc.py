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
L + 1 tensors in the convention every family keeps: the input to each block (the embeddings, then each
block's output before the final norm), followed by the final-norm output, so `hidden_states[-1]` equals
`last_hidden_state`. Against the official outputs: `hidden_states[1:-1]` are the official `hidden_states`
but the last, and `hidden_states[-1]` is the official `embeddings`. Padding positions are zeros everywhere.

Padding-free: the mask is normalized once per forward; LayerNorms, projections, MLPs and heads run on the
packed valid tokens only, and just the attention call sees the (batch, seq) layout. Rotary tables, task
heads, input checks, weight init and the forward contract are the shared runtime modules' (`rotary.py`,
`heads.py`, `plm_base.py`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from .attention import FLASH_BACKENDS, MaskState, mask_state, pad
from .compiled import run_layers_packed
from .configuration_esmc import ESMCConfig
from .heads import MaskedLMModel, SequenceClassificationModel, TokenClassificationModel
from .plm_base import AttentionLayer, Encoded, FastPLMPreTrainedModel, run_encoder
from .rotary import apply_rotary, inverse_frequencies, rotary_tables
from .tokenization_esm import ESMC_VOCAB

RESIDUES = "LAGVSERTIDPKQNFYMHWCXBUZO"


class ESMCLayer(AttentionLayer):
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

    def attention_inputs(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Packed (tokens, heads, head_dim) q, k, v with the q/k norms and rotary applied."""
        tokens, d = h.shape
        q, k, v = self.qkv(self.attn_norm(h)).chunk(3, dim=-1)
        # The norms run in float32 under autocast; back to the projection dtype, as the official code does.
        q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        q, k, v = (t.reshape(tokens, self.num_heads, d // self.num_heads) for t in (q, k, v))
        # Rotary tables in the q/k dtype (bf16 under autocast), as the official cache is built.
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection of packed attention outputs (tokens, heads, head_dim), scaled residuals, MLP."""
        h = h + self.out_proj(attended.reshape(h.shape)) / self.residual_scale
        gate, value = self.fc1(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.fc2(F.silu(gate) * value) / self.residual_scale


class ESMCPreTrainedModel(FastPLMPreTrainedModel):
    config_class = ESMCConfig
    base_model_prefix = "esmc"
    _no_split_modules = ["ESMCLayer"]
    vocabulary = ESMC_VOCAB
    residues = RESIDUES

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        sequence_id: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **options,
    ) -> ModelOutput | tuple:
        """`FastPLMPreTrainedModel.forward` with ESMC's `sequence_id` in the signature (Trainer keeps only
        the dataset columns a forward names)."""
        return super().forward(input_ids, attention_mask, labels, sequence_id=sequence_id, **options)


class ESMCModel(ESMCPreTrainedModel):
    # Artifacts hold the masked-LM checkpoint; the bare encoder simply does not use its LM head.
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config: ESMCConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(ESMCLayer(config) for _ in range(config.num_hidden_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=False)
        self.post_init()

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

    def encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        sequence_id: torch.Tensor | None = None,
        *,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        warn_eager: bool = True,
    ) -> Encoded:
        """The encoder, packed; `forward` (plm_base) pads it and applies the head of the model class."""
        backend = self.checked_backend(input_ids, output_attentions, warn_eager)
        batch, seq = input_ids.shape
        plan = self.attention_plan(backend, self._mask_state(input_ids, attention_mask, sequence_id, backend))
        h, cos, sin = self._packed_inputs(input_ids, plan.q_index)
        h, hidden, attentions = run_encoder(
            self.layers, self.final_norm, h, cos, sin, plan, output_hidden_states, output_attentions
        )
        return Encoded(h, plan.q_index, batch, seq, hidden, attentions)

    def _packed_inputs(self, input_ids: torch.Tensor, indices: torch.Tensor):
        """Embeddings of the valid tokens and their rotary tables (float32; positions = index in the row)."""
        h = self.embed_tokens(input_ids.flatten().index_select(0, indices))
        config = self.config
        inv_freq = inverse_frequencies(config.hidden_size // config.num_attention_heads, config.rope_theta)
        return h, *rotary_tables(indices % input_ids.shape[1], inv_freq)

    def embedding_core(self, input_ids: torch.Tensor, valid: torch.Tensor, compile) -> torch.Tensor:
        """Last hidden states (b, s, d) for `embed_dataset`'s compiled path (`compiled.py`), sdpa semantics.

        `valid` is an already-checked boolean (b, s) mask with a valid token in every row: one sequence per
        row, as `embed_dataset` batches them. The two halves of a layer around attention are compiled once
        (dynamic token counts) and run for every layer on packed tokens; attention runs per sequence on its
        own tokens. Same function as `forward` with that mask (sdpa backend).
        """
        self.check_input_ids(input_ids)
        self.check_dtypes(input_ids.device.type)
        plan = self.attention_plan("sdpa", mask_state(valid))
        h = run_layers_packed(self.layers, plan, *self._packed_inputs(input_ids, plan.q_index), compile)
        return pad(self.final_norm(h), plan.q_index, *input_ids.shape)


class ESMCForMaskedLM(MaskedLMModel, ESMCPreTrainedModel):
    def __init__(self, config: ESMCConfig) -> None:
        # The official sequence head: its decoder has a bias of its own.
        super().__init__(config, ESMCModel(config), decoder_bias=True)


class ESMCForSequenceClassification(SequenceClassificationModel, ESMCPreTrainedModel):
    def __init__(self, config: ESMCConfig) -> None:
        super().__init__(config, ESMCModel(config))


class ESMCForTokenClassification(TokenClassificationModel, ESMCPreTrainedModel):
    def __init__(self, config: ESMCConfig) -> None:
        super().__init__(config, ESMCModel(config))
