"""DPLM2 (Wang et al. 2025): one model that reads and writes amino acids and structure tokens, exact to the
official forward, on DPLM's classes.

DPLM2 is DPLM's network with an 8,229-token vocabulary (`tokenization_dplm2`: the amino-acid track below
id 33, 8,192 structure codes and the structure specials above) and an untied decoder. A row is one track,
or both packed: `[<cls_struct> structure <eos_struct> pad | <cls_aa> residues <eos_aa> pad]`. Where the
official forward differs from DPLM's, this one does the same:

- **Double embedding.** The official wrapper embeds the ids and its network embeds that result again, so
  token dropout's rescaling (x * 0.88 / (1 - the row's `<mask_aa>` ratio)) and the padding multiply apply
  twice; `<mask_struct>` rows are not zeroed. `hidden_states[0]` is that twice-embedded input.
- **Split rotary positions.** In a packed row each half counts its positions from 0 (the first half has
  ceil(L/2) positions, the second floor(L/2)). The official code decides the split for the whole batch
  (if any row has an amino acid and any row a structure token, every row is split); here it is decided
  per row (a row is split when it holds both tracks), so a row's output never depends on the other rows
  of its batch. The two agree on every batch whose rows are all packed or all single-track, which is
  what the official tasks (co-generation, folding, inverse folding) and the tokenizer produce.
- Padding as in DPLM: padded queries attend the valid keys (the official key-padding bias).
- The contact head is trained (DPLM2 keeps ESM2's): `predict_contacts` on amino-acid rows.

Backends: SDPA only (the manifest); every other is refused, because its measured BF16 error exceeds the
family's 0.01 engineering target. Precision: float32 parameters; BF16 only as autocast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .configuration_dplm2 import DPLM2Config
from .diffusion import annealing_temperatures, run_multimodal, unmasking_noise_scale
from .modeling_dplm import DPLMForMaskedLM, DPLMForSequenceClassification, DPLMForTokenClassification, DPLMModel
from .modeling_esm2 import ESM2Model
from .tokenization_dplm2 import (
    AA_CLS_ID,
    AA_EOS_ID,
    AA_MASK_ID,
    AA_TRACK_SIZE,
    AA_UNK_ID,
    DPLM2_VOCAB,
    PAD_ID,
    STRUCT_CLS_ID,
    STRUCT_EOS_ID,
    STRUCT_MASK_ID,
    STRUCT_UNK_ID,
    VOCAB_SIZE,
    structure_ids,
)

# Never sampled (the official list): every track's specials and masks, <pad>, both <unk>, and X B U Z O.
SUPPRESSED = (
    AA_CLS_ID,
    AA_EOS_ID,
    AA_MASK_ID,
    STRUCT_CLS_ID,
    STRUCT_EOS_ID,
    STRUCT_MASK_ID,
    PAD_ID,
    AA_UNK_ID,
    STRUCT_UNK_ID,
    *(DPLM2_VOCAB.index(letter) for letter in "XBUZO"),
)
SPECIALS = (PAD_ID, AA_CLS_ID, AA_EOS_ID, STRUCT_CLS_ID, STRUCT_EOS_ID)
SAMPLING = ("argmax", "gumbel_argmax", "vanilla", "annealing@<max>:<min>")


def tracks_of(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amino-acid, structure) positions by the official rule: ids below 33 but <pad>, and the others."""
    aa = (input_ids < AA_TRACK_SIZE) & (input_ids != PAD_ID)
    return aa, input_ids >= AA_TRACK_SIZE


class DPLM2Model(DPLMModel):
    config_class = DPLM2Config
    vocabulary = DPLM2_VOCAB

    def max_tokens(self) -> int:
        # A packed row holds two tracks of at most 1,024 residues (or structure tokens) plus their specials.
        return 2 * self.config.max_position_embeddings

    def _embed(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        # The official wrapper embeds, then its network embeds the result again: the rescaling runs twice.
        return self._rescale(super()._embed(input_ids, valid), input_ids, valid)

    def positions(self, input_ids: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Index in the row, counted from 0 again in the second half of a packed row (split per row)."""
        seq = input_ids.shape[1]
        aa, struct = tracks_of(input_ids)
        packed = (aa.any(-1) & struct.any(-1)).flatten()
        column, row = indices % seq, torch.div(indices, seq, rounding_mode="floor")
        first = (seq + 1) // 2
        return torch.where(packed.index_select(0, row) & (column >= first), column - first, column)

    def encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        type_ids: torch.Tensor | None = None,
        **options,
    ):
        """DPLM's encoder; `type_ids` (the tokenizer's `pack` gives them) are optional and must be the
        official ones (1 amino acid, 0 structure, 2 padding): the ids decide them."""
        if type_ids is not None:
            aa, struct = tracks_of(input_ids)
            official = torch.where(aa, 1, torch.where(struct, 0, 2))
            if not isinstance(type_ids, torch.Tensor) or type_ids.shape != input_ids.shape:
                raise ValueError(f"type_ids must be a tensor shaped like input_ids {tuple(input_ids.shape)}.")
            if not torch.equal(type_ids.to(official.device, official.dtype), official):
                raise ValueError(
                    "type_ids disagree with input_ids: 1 for ids < 33 but <pad>, 0 for structure ids, 2 for <pad>."
                )
        return super().encode(input_ids, attention_mask, **options)

    def predict_contacts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Contact probabilities (batch, L, L) of amino-acid rows `<cls_aa> residues <eos_aa>`, by the
        trained contact head over the attention maps (eager attention), as ESM2's."""
        if bool(tracks_of(input_ids)[1].any()):
            raise ValueError(
                "contacts are defined on amino-acid rows (<cls_aa> residues <eos_aa>); drop the structure track."
            )
        return ESM2Model.predict_contacts(self, input_ids, attention_mask)


class DPLM2ForMaskedLM(DPLMForMaskedLM):
    config_class = DPLM2Config
    encoder_class = DPLM2Model

    def generate_inputs(
        self,
        lengths: Sequence[int] | None = None,
        *,
        sequences: Sequence[str] | None = None,
        structures: Sequence[str | Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, partial_masks) of packed rows for `generate`, by task:

        - co-generation: `lengths`, both tracks generated;
        - folding (structure from sequence): `sequences`, the structure track generated;
        - inverse folding (sequence from structure): `structures` (4-digit codes "0012,8191,...", or ids of
          codes), the amino-acid track generated.
        """
        given = [
            name
            for name, value in (("lengths", lengths), ("sequences", sequences), ("structures", structures))
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(f"give exactly one of lengths, sequences or structures; received {given or 'none'}.")
        residue = {token: i for i, token in enumerate(DPLM2_VOCAB[:AA_TRACK_SIZE]) if len(token) == 1}
        if lengths is not None:
            rows = [(None, None, n) for n in lengths]
        elif sequences is not None:
            rows = []
            for row, sequence in enumerate(sequences):
                bad = next((i for i, c in enumerate(sequence) if c not in residue or not c.isalpha()), None)
                if bad is not None:
                    raise ValueError(f"row {row}: {sequence[bad]!r} at position {bad} is not a residue letter.")
                rows.append(([residue[c] for c in sequence], None, len(sequence)))
        else:
            rows = []
            for row, structure in enumerate(structures):
                try:
                    codes = structure_ids(structure)
                except ValueError as error:
                    raise ValueError(f"row {row} (structure track): {error}") from None
                rows.append((None, codes, len(codes)))
        limit = self.config.max_position_embeddings - 2
        for row, (_, _, n) in enumerate(rows):
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit:
                raise ValueError(f"row {row}: length {n!r} must be an integer in [1, {limit}].")
        half = max(n for _, _, n in rows) + 2
        input_ids = torch.full((len(rows), 2 * half), PAD_ID, dtype=torch.long)
        for row, (aa, codes, n) in enumerate(rows):
            input_ids[row, 0], input_ids[row, n + 1] = STRUCT_CLS_ID, STRUCT_EOS_ID
            input_ids[row, 1 : n + 1] = STRUCT_MASK_ID if codes is None else torch.tensor(codes)
            input_ids[row, half], input_ids[row, half + n + 1] = AA_CLS_ID, AA_EOS_ID
            input_ids[row, half + 1 : half + n + 1] = AA_MASK_ID if aa is None else torch.tensor(aa)
        aa_track, struct_track = tracks_of(input_ids)
        partial_masks = aa_track if sequences is not None else struct_track if structures is not None else None
        if partial_masks is None:
            partial_masks = torch.zeros_like(input_ids, dtype=torch.bool)
        return input_ids, partial_masks

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_iter: int,
        sampling_strategy: str = "annealing@2.2:1.0",
        unmasking_strategy: str = "stochastic1.0",
        temperature: float = 1.0,
        partial_masks: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor:
        """Generate by iterative unmasking, as the official `MultimodalDiffusionProteinLanguageModel.generate`
        (its defaults: `annealing@2.2:1.0` sampling, `stochastic1.0` unmasking).

        `input_ids` (B, L) from `generate_inputs`: every position that is not a special token and not True
        in `partial_masks` is generated within its own track (amino acids or structure codes).
        `sampling_strategy`: `argmax`, `gumbel_argmax` (noise scaled by `temperature`), `vanilla`
        (categorical at `temperature`) or `annealing@max:min` (categorical at a temperature falling from
        max to min over the steps); `unmasking_strategy`: `stochastic<s>` or `deterministic`. Random numbers
        come from `generator`, else the device's default (`torch.manual_seed(s)` before the call reproduces
        an official run seeded alike on the same device). Returns the ids (B, L).
        """
        partial_masks = self.checked_generation_inputs(input_ids, max_iter, partial_masks, (AA_MASK_ID, STRUCT_MASK_ID))
        if sampling_strategy not in SAMPLING[:3] and annealing_temperatures(sampling_strategy) is None:
            raise ValueError(f"sampling_strategy {sampling_strategy!r} is not one of {', '.join(SAMPLING)}.")
        unmasking_noise_scale(unmasking_strategy)
        if not isinstance(temperature, int | float) or isinstance(temperature, bool) or temperature < 0:
            raise ValueError(f"temperature must be a number >= 0; received {temperature!r}.")
        aa, struct = tracks_of(input_ids)
        was_training = self.training
        self.eval()
        try:
            return run_multimodal(
                lambda tokens: self(input_ids=tokens).logits,
                input_ids,
                partial_masks,
                max_iter,
                strategy=sampling_strategy,
                temperature=float(temperature),
                unmasking=unmasking_strategy,
                tracks=((aa, AA_MASK_ID, (0, AA_TRACK_SIZE)), (struct, STRUCT_MASK_ID, (AA_TRACK_SIZE, VOCAB_SIZE))),
                specials=SPECIALS,
                suppressed=SUPPRESSED,
                generator=generator,
                progress=progress,
            )
        finally:
            self.train(was_training)


class DPLM2ForSequenceClassification(DPLMForSequenceClassification):
    config_class = DPLM2Config
    encoder_class = DPLM2Model


class DPLM2ForTokenClassification(DPLMForTokenClassification):
    config_class = DPLM2Config
    encoder_class = DPLM2Model
