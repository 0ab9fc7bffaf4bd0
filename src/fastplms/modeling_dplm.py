"""DPLM (Wang et al. 2024), exact to the official model, on ESM2's classes.

DPLM's network is ESM2's (ByProt's `EsmForDPLM` subclasses Transformers' `EsmForMaskedLM` and changes
only the attention call): biased q/k/v, q scaled by 1/sqrt(head_dim) before rotary, token dropout,
pre-LayerNorm, a final LayerNorm and an LM head whose decoder is tied to the word embeddings (converted
checkpoints hold it materialised). So the classes here subclass ESM2's by import, and differ where the
official model does:

- The mask is always `input_ids != <pad>`; the official forward ignores a caller's mask, so here one that
  disagrees with it is an error rather than silently ignored.
- Padded positions are queries too: as officially, each attends to the valid keys of its row (it is
  masked as a key only), so every output, hidden states and logits at padding included, is the official
  one. Valid positions do not see padding, so `embed_dataset`'s compiled path skips it.
- No trained contact head (the official model builds one and never trains it): `predict_contacts` raises.
- `DPLMForMaskedLM.generate`: the official iterative-unmasking sampler (`diffusion.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .attention import attend, mask_state
from .configuration_dplm import DPLMConfig
from .diffusion import STRATEGIES, DiffusionSampler
from .modeling_esm2 import (
    ESM2ForMaskedLM,
    ESM2ForSequenceClassification,
    ESM2ForTokenClassification,
    ESM2Layer,
    ESM2Model,
)

TEMPLATE_FREE = "_"  # a template position to generate (ESM3's prompt convention)


class DPLMLayer(ESM2Layer):
    """ESM2's layer, where every packed row queries and only the plan's key rows are keys."""

    def forward(self, h: torch.Tensor, cos, sin, plan, want_probs: bool = False):
        q, k, v = self.attention_inputs(h, cos, sin)
        if plan.state.kv_valid is not None:  # `DPLMModel.encode`: h holds every position, keys are the valid ones
            k, v = k.index_select(0, plan.kv_index), v.index_select(0, plan.kv_index)
        result = attend(q, k, v, plan, scale=self.attention_scale, return_probs=want_probs)
        out, probs = result if want_probs else (result, None)
        return self.finish(h, out), probs


class DPLMModel(ESM2Model):
    config_class = DPLMConfig
    layer_class = DPLMLayer

    def official_mask(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """`input_ids != <pad>`, the only mask DPLM has; a caller's mask must say the same."""
        valid = input_ids != self.config.pad_token_id
        if attention_mask is not None:
            given = mask_state(attention_mask, shape=tuple(input_ids.shape), device=input_ids.device).valid
            if not torch.equal(given, valid):
                row = int((given != valid).any(-1).nonzero()[0])
                raise ValueError(
                    f"attention_mask disagrees with input_ids != <pad> in row {row}: DPLM masks exactly the "
                    "<pad> tokens (the official model ignores any other mask); pad with <pad> instead."
                )
        return valid

    def attention_state(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        """Every position queries, the valid ones are keys: the official key-padding mask."""
        valid = self.official_mask(input_ids, attention_mask)
        shape = tuple(input_ids.shape)
        return mask_state(torch.ones_like(valid), kv_attention_mask=valid, shape=shape, kv_shape=shape), valid

    def predict_contacts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError(
            "DPLM has no trained contact head (the official model builds one and never trains it); "
            "use ESM2 or DPLM2 for contact maps."
        )


class DPLMForMaskedLM(ESM2ForMaskedLM):
    config_class = DPLMConfig
    encoder_class = DPLMModel

    def predict_contacts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.esm.predict_contacts(input_ids, attention_mask)

    def generate_inputs(
        self, lengths: Sequence[int] | None = None, template: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, partial_masks) for `generate`: see `dplm_generation_inputs`."""
        return dplm_generation_inputs(self.config, lengths, template, self.vocabulary)

    def checked_generation_inputs(
        self, input_ids: torch.Tensor, max_iter: object, partial_masks: object, mask_ids: tuple[int, ...]
    ) -> torch.Tensor | None:
        """What every `generate` checks first: the ids, the step count, `partial_masks` (bool, input-shaped,
        keeping no mask token; returned on the ids' device) and a non-padding token in every row."""
        self.esm.check_input_ids(input_ids)
        if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
            raise ValueError(f"max_iter must be a positive number of denoising steps; received {max_iter!r}.")
        if partial_masks is not None:
            if not isinstance(partial_masks, torch.Tensor) or partial_masks.dtype != torch.bool:
                raise ValueError("partial_masks must be a bool tensor (B, L): True where a token is kept.")
            if partial_masks.shape != input_ids.shape:
                raise ValueError(
                    f"partial_masks has shape {tuple(partial_masks.shape)}; input_ids has {tuple(input_ids.shape)}."
                )
            partial_masks = partial_masks.to(input_ids.device)
            if bool(torch.isin(input_ids[partial_masks], torch.tensor(mask_ids, device=input_ids.device)).any()):
                raise ValueError("partial_masks keeps a mask token; a kept position needs a residue (or code).")
        if not bool((input_ids != self.config.pad_token_id).any(-1).all()):
            raise ValueError("every input row needs at least one token that is not <pad>.")
        return partial_masks

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_iter: int,
        sampling_strategy: str = "gumbel_argmax",
        temperature: float | None = None,
        partial_masks: torch.Tensor | None = None,
        disable_resample: bool = False,
        resample_ratio: float = 0.25,
        generator: torch.Generator | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor:
        """Generate by iterative unmasking, as the official `DiffusionProteinLanguageModel.generate`.

        `input_ids` (B, L): `<cls> ... <eos>` rows right-padded with `<pad>` (`generate_inputs` makes them);
        every position that is not a special token and not True in `partial_masks` (B, L) is generated,
        the others are kept. `max_iter` denoising steps; `sampling_strategy` "gumbel_argmax"
        (default; repeats resampled unless `disable_resample`), "argmax" or "vanilla" (categorical at
        `temperature`, greedy when None). Random numbers come from `generator`, else the default one of
        the device: `torch.manual_seed(s)` before the call reproduces an official run seeded alike.
        Returns the generated ids (B, L).
        """
        config = self.config
        partial_masks = self.checked_generation_inputs(input_ids, max_iter, partial_masks, (config.mask_token_id,))
        if sampling_strategy not in STRATEGIES:
            raise ValueError(f"sampling_strategy {sampling_strategy!r} is not one of {', '.join(STRATEGIES)}.")
        if temperature is not None and sampling_strategy != "vanilla":
            raise ValueError(f"temperature is only used by sampling_strategy 'vanilla', not {sampling_strategy!r}.")
        if temperature is not None and not temperature >= 0:
            raise ValueError(f"temperature must be >= 0; received {temperature!r}.")
        if not 0 < resample_ratio <= 1:
            raise ValueError(f"resample_ratio must lie in (0, 1]; received {resample_ratio!r}.")
        resample = sampling_strategy == "gumbel_argmax" and not disable_resample
        sampler = DiffusionSampler(
            lambda tokens: self(input_ids=tokens).logits,
            mask_id=config.mask_token_id,
            pad_id=config.pad_token_id,
            cls_id=config.cls_token_id,
            eos_id=config.eos_token_id,
            suppressed=(
                config.mask_token_id,
                config.x_token_id,
                config.pad_token_id,
                config.cls_token_id,
                config.eos_token_id,
            ),
            generator=generator,
        )
        was_training = self.training
        self.eval()
        try:
            return sampler.run(
                input_ids,
                partial_masks,
                max_iter,
                sampling_strategy,
                temperature,
                resample_ratio if resample else None,
                progress,
            )
        finally:
            self.train(was_training)


class DPLMForSequenceClassification(ESM2ForSequenceClassification):
    config_class = DPLMConfig
    encoder_class = DPLMModel


class DPLMForTokenClassification(ESM2ForTokenClassification):
    config_class = DPLMConfig
    encoder_class = DPLMModel


def dplm_generation_inputs(
    config: DPLMConfig,
    lengths: Sequence[int] | None = None,
    template: str | None = None,
    vocabulary: Sequence[str] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, partial_masks) for `generate`: one `<cls> <mask>*L <eos>` row per length, right-padded.

    `template`: residues to keep and `_` for positions to generate, from the first residue on; a
    template shorter than a length leaves the rest free. Without lengths, one row of the template's length.
    """
    ids = {token: i for i, token in enumerate(vocabulary or DPLMModel.vocabulary)}
    fixed: list[int | None] = []
    for position, char in enumerate(template or ""):
        if char == TEMPLATE_FREE:
            fixed.append(None)
        elif len(char) == 1 and char in ids and char.isalpha():
            fixed.append(ids[char])
        else:
            raise ValueError(
                f"template position {position}: {char!r} is not a residue letter or {TEMPLATE_FREE!r} "
                "(a position to generate)."
            )
    if lengths is None:
        if template is None:
            raise ValueError("give lengths, a template, or both.")
        lengths = [len(fixed)]
    lengths = list(lengths)
    if not lengths:
        raise ValueError("lengths is empty: give at least one sequence length.")
    limit = config.max_position_embeddings - 2
    for length in lengths:
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= limit:
            raise ValueError(f"length {length!r} must be an integer in [1, {limit}].")
        if len(fixed) > length:
            raise ValueError(f"the template has {len(fixed)} positions, longer than the requested length {length}.")
    width = max(lengths) + 2
    input_ids = torch.full((len(lengths), width), config.pad_token_id, dtype=torch.long)
    partial_masks = torch.zeros((len(lengths), width), dtype=torch.bool)
    for row, length in enumerate(lengths):
        input_ids[row, 0] = config.cls_token_id
        input_ids[row, 1 : length + 1] = config.mask_token_id
        input_ids[row, length + 1] = config.eos_token_id
        for position, token in enumerate(fixed):
            if token is not None:
                input_ids[row, position + 1] = token
                partial_masks[row, position + 1] = True
    return input_ids, partial_masks
