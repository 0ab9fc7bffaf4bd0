"""Task heads and their losses, shared by every encoder family.

Runtime module (ships inside artifacts; imports torch and transformers only). A family's task model is
`<Family>For<Task>(<Task>Model, <Family>PreTrainedModel)`: the mixin here builds the head, names its
parameters (the state-dict keys every converted checkpoint and artifact uses) and turns the base model's
packed encoding into the task output in `head_output`; `FastPLMPreTrainedModel.forward` does the rest.
Heads run on the packed tokens of the encoding: the valid ones, so padding positions of every output are
zeros, except in families whose official padded positions are outputs too (DPLM, DPLM2).

State-dict keys: `lm_head.{dense,norm,decoder}` (plus `lm_head.bias` where the decoder has none of its own),
`dense` / `out_proj` for sequence classification and `classifier` for token classification, at the top level
of the model as in Transformers' ESM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import MaskedLMOutput, SequenceClassifierOutput, TokenClassifierOutput

if TYPE_CHECKING:
    from .plm_base import Encoded


def classification_loss(config, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sequence-classification loss chosen as Transformers does (`problem_type`, else from labels)."""
    problem = config.problem_type
    if problem is None:
        if config.num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        if config.num_labels == 1:
            return F.mse_loss(logits.squeeze(-1).float(), labels.float().view(-1))
        # Several regression targets: one per label, compared elementwise.
        return F.mse_loss(logits.float(), labels.float().view_as(logits))
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(-1, config.num_labels).float(), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


def task_output(output_class: type, encoded: Encoded, logits: torch.Tensor, loss: torch.Tensor | None):
    """A head's ModelOutput: its loss and logits, and the encoder's hidden states and attention maps."""
    return output_class(
        loss=loss, logits=logits, hidden_states=encoded.hidden_states(), attentions=encoded.attention_maps()
    )


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy (the masked-LM and token-classification loss); label -100 is ignored."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)


class MaskedLMHead(nn.Module):
    """Linear(d, d), GELU, LayerNorm(d), Linear(d, vocab).

    `decoder_bias=False` is fair-esm's ESM2 layout: a bias-free decoder plus a separate `bias` parameter,
    added after the projection (so the floats match the official model); ESMC's decoder has its own bias.
    """

    def __init__(self, config, *, decoder_bias: bool) -> None:
        super().__init__()
        d = config.hidden_size
        self.dense = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(d, config.vocab_size, bias=decoder_bias)
        self.register_parameter("bias", None if decoder_bias else nn.Parameter(torch.zeros(config.vocab_size)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.decoder(self.norm(F.gelu(self.dense(x))))
        return logits if self.bias is None else logits + self.bias


class MaskedLMModel:
    """Mixin: the encoder under the family's `base_model_prefix`, and `lm_head`.

    `float_logits`: the logits are cast to float32 (a family whose official head returns float32 logits
    under autocast, e.g. E1); otherwise they keep the head's dtype.
    """

    float_logits = False

    def __init__(self, config, encoder: nn.Module, *, decoder_bias: bool) -> None:
        super().__init__(config)
        setattr(self, self.base_model_prefix, encoder)
        self.lm_head = MaskedLMHead(config, decoder_bias=decoder_bias)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def head_output(self, encoded: Encoded, labels: torch.Tensor | None) -> MaskedLMOutput:
        logits = self.lm_head(encoded.h)
        logits = encoded.padded(logits.float() if self.float_logits else logits)
        return task_output(MaskedLMOutput, encoded, logits, None if labels is None else token_loss(logits, labels))


class SequenceClassificationModel:
    """Mixin: dense, tanh and projection on the <cls> state, with dropout (the Transformers ESM head)."""

    # Artifacts hold the masked-LM checkpoint; a classifier simply does not use its LM head.
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config, encoder: nn.Module) -> None:
        super().__init__(config)
        setattr(self, self.base_model_prefix, encoder)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def head_output(self, encoded: Encoded, labels: torch.Tensor | None) -> SequenceClassifierOutput:
        cls = encoded.padded(encoded.h)[:, 0]
        logits = self.out_proj(self.dropout(torch.tanh(self.dense(self.dropout(cls)))))
        loss = None if labels is None else classification_loss(self.config, logits, labels)
        return task_output(SequenceClassifierOutput, encoded, logits, loss)


class TokenClassificationModel:
    """Mixin: a linear classifier on every token's state, with dropout."""

    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config, encoder: nn.Module) -> None:
        super().__init__(config)
        setattr(self, self.base_model_prefix, encoder)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def head_output(self, encoded: Encoded, labels: torch.Tensor | None) -> TokenClassifierOutput:
        logits = encoded.padded(self.classifier(self.dropout(encoded.h)))
        loss = None if labels is None else token_loss(logits, labels)
        return task_output(TokenClassifierOutput, encoded, logits, loss)
