"""Iterative-unmasking generation of the masked-diffusion families (DPLM), exact to the official sampler.

Runtime module (imports torch only). The algorithm is ByteDance's (bytedance/dplm@8b3425b, the wrapper's
`generate`), written here from its description in the project's reference, step for step, so that on
the same device, with the same seed, the same network gives the same tokens:

1. Every position that is not `<pad>`, `<cls>` or `<eos>` and not fixed by `partial_masks` is mutable;
   it starts as `<mask>` with score 0.
2. Each step runs the network on the current tokens, takes float32 logits with {mask, X, pad, cls, eos}
   set to -inf, and draws a candidate and its score per position: `gumbel_argmax` (the default: argmax of
   log_softmax(logits + Gumbel noise)), `argmax` (the raw logit maximum) or `vanilla` (a categorical
   sample at `temperature`, or the greedy log-probability when it is None or 0).
3. `gumbel_argmax` then resamples repeats: in a row where some token is predicted at more than
   `resample_ratio` of all positions (padding and specials counted), every such token is masked, that
   prediction row is run again (it holds no padding then), top-p 0.95 filtered and Gumbel-sampled.
4. Candidates overwrite every mutable position. Then the deterministic linear re-masking: with
   rate = 1 - (step + 1) / steps, the positions scoring strictly below the sorted score at index
   trunc(float32(mutable count) * rate) become `<mask>` again (score -inf); the others that were masked
   take the candidate; decoded ones keep their token. At the last step the rate is 0: nothing is masked.

Random numbers are drawn as the official code draws them: one (B, L, V) uniform tensor per step for the
Gumbel noise, one (R, L, V) tensor per step where R rows resample, `torch.multinomial` for `vanilla`;
from `generator` when given, else from the device's default generator (so `torch.manual_seed(s)` before
the call reproduces an official run seeded the same way).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

STRATEGIES = ("gumbel_argmax", "argmax", "vanilla")
TOP_P = 0.95  # nucleus mass of the resampling step (official constant)


def gumbel_noise(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """-log(-log(u + 1e-8) + 1e-8) for u uniform in [0, 1), the shape, dtype and device of `like`."""
    u = torch.rand(like.shape, generator=generator, dtype=like.dtype, device=like.device)
    return -torch.log(-torch.log(u + 1e-8) + 1e-8)


def top_p_filter(logits: torch.Tensor, top_p: float = TOP_P) -> torch.Tensor:
    """Logits with -inf outside the smallest set of most likely tokens whose mass reaches `top_p` (per row;
    the most likely token always stays). The mass is summed over the sorted probabilities, as officially."""
    ordered, order = logits.sort(dim=-1, descending=True)
    mass = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = mass > top_p
    drop[..., 1:] = drop[..., :-1].clone()  # keep the token that crosses the threshold
    drop[..., 0] = False
    ordered = ordered.masked_fill(drop, -math.inf)
    return ordered.gather(-1, order.argsort(dim=-1))


def categorical(logits: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, log-probabilities) of one categorical draw per row, as torch.distributions.Categorical
    computes them (normalized logits, their softmax, one multinomial draw with replacement)."""
    normalized = logits - logits.logsumexp(dim=-1, keepdim=True)
    probs = normalized.softmax(dim=-1).reshape(-1, logits.shape[-1])
    tokens = torch.multinomial(probs, 1, True, generator=generator).reshape(logits.shape[:-1])
    return tokens, normalized.gather(-1, tokens[..., None]).squeeze(-1)


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, log-probabilities) of the most likely token."""
    scores, tokens = logits.log_softmax(dim=-1).max(dim=-1)
    return tokens, scores


def remask_cutoff(mutable: torch.Tensor, rate: float) -> torch.Tensor:
    """(B, 1) number of positions to re-mask: trunc(float32(mutable count) * rate), the official rounding
    (it differs from exact integer arithmetic for some counts and rates)."""
    return (mutable.sum(dim=1, keepdim=True).to(torch.float32) * rate).long()


def lowest_scores(
    scores: torch.Tensor, mutable: torch.Tensor, cutoff: torch.Tensor, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """Mutable positions scoring strictly below the `cutoff`-th lowest score (ties re-mask fewer); with
    `noise` (stochastic unmasking) the scores are perturbed by it first."""
    ranked = scores.masked_fill(~mutable, 1000.0)
    if noise is not None:
        ranked = ranked + noise
    threshold = ranked.sort(dim=-1).values.gather(-1, cutoff)
    return ranked < threshold


class DiffusionSampler:
    """One DPLM generation run: `network(tokens) -> float logits (B, L, V)` and the special ids."""

    def __init__(
        self,
        network: Callable[[torch.Tensor], torch.Tensor],
        *,
        mask_id: int,
        pad_id: int,
        cls_id: int,
        eos_id: int,
        suppressed: tuple[int, ...],
        generator: torch.Generator | None,
    ) -> None:
        self.network = network
        self.mask_id, self.pad_id, self.cls_id, self.eos_id = mask_id, pad_id, cls_id, eos_id
        self.suppressed = list(suppressed)
        self.generator = generator

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.network(tokens).float()
        logits[..., self.suppressed] = -math.inf
        return logits

    def candidates(
        self, tokens: torch.Tensor, strategy: str, temperature: float | None, resample_ratio: float | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(tokens)
        if strategy == "argmax":
            scores, predicted = logits.max(dim=-1)
            return predicted, scores
        if strategy == "vanilla":
            return categorical(logits / temperature, self.generator) if temperature else greedy(logits)
        predicted, scores = greedy(logits + gumbel_noise(logits, self.generator))
        if resample_ratio is not None:
            self.resample_repeats(predicted, scores, resample_ratio)
        return predicted, scores

    def resample_repeats(self, predicted: torch.Tensor, scores: torch.Tensor, ratio: float) -> None:
        """In place: rows where a token is predicted more than `ratio` * L times get those tokens redrawn."""
        length = predicted.shape[1]
        counts = torch.zeros(predicted.shape[0], int(predicted.max()) + 1, dtype=torch.long, device=predicted.device)
        counts.scatter_add_(1, predicted, torch.ones_like(predicted))
        # (B, tokens); in float64, as Python compares an int count with the float L * ratio.
        frequent = counts.double() > length * ratio
        rows = frequent.any(dim=1).nonzero().flatten()
        if rows.numel() == 0:
            return
        repeated = frequent[rows].gather(1, predicted[rows])
        redo = predicted[rows].masked_fill(repeated, self.mask_id)
        redo_scores = scores[rows]
        logits = top_p_filter(self.logits(redo))
        tokens, new_scores = greedy(logits + gumbel_noise(logits, self.generator))
        predicted[rows] = redo.masked_scatter(repeated, tokens[repeated])
        scores[rows] = redo_scores.masked_scatter(repeated, new_scores[repeated])

    def run(
        self,
        input_ids: torch.Tensor,
        partial_masks: torch.Tensor | None,
        steps: int,
        strategy: str,
        temperature: float | None,
        resample_ratio: float | None,
        progress: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor:
        mutable = (input_ids != self.pad_id) & (input_ids != self.cls_id) & (input_ids != self.eos_id)
        if partial_masks is not None:
            mutable &= ~partial_masks
        tokens = input_ids.masked_fill(mutable, self.mask_id)
        scores = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        masked = mutable.clone()  # positions still <mask>
        for step in range(steps):
            predicted, predicted_scores = self.candidates(tokens, strategy, temperature, resample_ratio)
            current = torch.where(mutable, predicted, tokens)
            current_scores = torch.where(mutable, predicted_scores, scores)
            remask = lowest_scores(current_scores, mutable, remask_cutoff(mutable, 1 - (step + 1) / steps))
            take = masked & ~remask
            tokens = torch.where(take, current, tokens.masked_fill(remask, self.mask_id))
            scores = torch.where(take, current_scores, scores.masked_fill(remask, -math.inf))
            masked = remask
            if progress is not None:
                progress(step + 1, steps)
        return tokens


def annealing_temperatures(strategy: str) -> tuple[float, float] | None:
    """(max, min) of an `annealing@max:min` strategy, None for another name; a malformed one is an error."""
    if not strategy.startswith("annealing"):
        return None
    try:
        prefix, bounds = strategy.split("@")
        high, low = (float(x) for x in bounds.split(":"))
    except ValueError:
        raise ValueError(
            f"sampling_strategy {strategy!r}: write annealing@<max>:<min>, e.g. annealing@2.2:1.0"
        ) from None
    if prefix != "annealing" or not high >= low >= 0:
        raise ValueError(f"sampling_strategy {strategy!r}: needs max >= min >= 0")
    return high, low


def unmasking_noise_scale(unmasking: str) -> float | None:
    """The Gumbel scale of `stochastic<s>` unmasking, None for `deterministic`."""
    if unmasking == "deterministic":
        return None
    if unmasking.startswith("stochastic"):
        try:
            return float(unmasking.removeprefix("stochastic"))
        except ValueError:
            pass
    raise ValueError(
        f"unmasking_strategy {unmasking!r}: use 'deterministic' or 'stochastic<scale>', e.g. stochastic1.0"
    )


def run_multimodal(
    network: Callable[[torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    partial_masks: torch.Tensor | None,
    steps: int,
    *,
    strategy: str,
    temperature: float,
    unmasking: str,
    tracks: tuple[tuple[torch.Tensor, int, tuple[int, int]], ...],
    specials: tuple[int, ...],
    suppressed: tuple[int, ...],
    generator: torch.Generator | None,
    progress: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """DPLM2's sampler (the official `MultimodalDiffusionProteinLanguageModel.generate`), step for step.

    `tracks`: per modality, in the official order (amino acids, then structure), its positions (B, L),
    its mask id and the id range [start, stop) its positions may take. Per step: log-softmax of the
    network's logits in float32, other tracks' ids and `suppressed` set to -inf, top-p 0.95 on every row,
    then a candidate by `strategy` (`argmax`; `gumbel_argmax` with noise scaled by `temperature`;
    `annealing@max:min`, a categorical draw at min + (max - min) * (1 - step / steps); `vanilla`, a
    categorical draw at `temperature`); candidates overwrite every mutable position; then per track the
    linear re-masking (perturbed by `s * rate` Gumbel noise for `stochastic<s>` unmasking).
    """
    annealing = annealing_temperatures(strategy)
    noise_scale = unmasking_noise_scale(unmasking)
    mutable = torch.ones_like(input_ids, dtype=torch.bool)
    for special in specials:
        mutable &= input_ids != special
    if partial_masks is not None:
        mutable &= ~partial_masks
    tokens, masked = input_ids.clone(), mutable.clone()
    allowed = []
    for positions, mask_id, (start, stop) in tracks:
        tokens = tokens.masked_fill(positions & mutable, mask_id)
        allowed.append((positions & mutable, start, stop))
    scores = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    for step in range(steps):
        logits = network(tokens).log_softmax(dim=-1).float()
        for positions, start, stop in allowed:
            rows, cols = torch.where(positions)
            logits[rows, cols, :start] = -math.inf
            logits[rows, cols, stop:] = -math.inf
        logits[..., list(suppressed)] = -math.inf
        logits = top_p_filter(logits)
        if strategy == "argmax":
            predicted_scores, predicted = logits.max(dim=-1)
        elif strategy == "gumbel_argmax":
            predicted, predicted_scores = greedy(logits + temperature * gumbel_noise(logits, generator))
        else:
            heat = temperature
            if annealing is not None:  # from max at the first step towards min
                heat = annealing[1] + (annealing[0] - annealing[1]) * (1 - step / steps)
            predicted, predicted_scores = categorical(logits / heat, generator) if heat else greedy(logits)
        current = torch.where(mutable, predicted, tokens)
        current_scores = torch.where(mutable, predicted_scores, scores)
        rate = 1 - (step + 1) / steps
        still_masked = torch.zeros_like(masked)
        for (_, mask_id, _), (track, _, _) in zip(tracks, allowed, strict=True):
            if not bool(track.any()):
                continue
            noise = None
            if noise_scale is not None:
                noise = noise_scale * rate * gumbel_noise(current_scores, generator)
            remask = lowest_scores(current_scores, track, remask_cutoff(track, rate), noise)
            take = masked & track & ~remask
            tokens = torch.where(take, current, tokens.masked_fill(remask, mask_id))
            scores = torch.where(take, current_scores, scores.masked_fill(remask, -math.inf))
            still_masked |= remask
        masked = still_masked
        if progress is not None:
            progress(step + 1, steps)
    return tokens
