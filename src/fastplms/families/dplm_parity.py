"""DPLM parity: the network against Transformers' `EsmForMaskedLM` (SDPA), the sampler against official goldens.

The reference measured Transformers 5.13's `EsmForMaskedLM` with SDPA, fed `input_ids != <pad>` as its mask,
bit-identical (0.0) to ByProt's official DPLM network on CPU FP32 (every hidden state, logits, padding), so
it is the network oracle here, on seeded weights of the official `EsmForDPLM` layout at real dims
(`oracles.dplm`); ours is converted from those very tensors by `convert.dplm`. Unlike ESM2, padding
positions are compared too: the official model defines them (padded queries attend the valid keys).
The sampler is compared token for token with `tests/goldens/dplm_sampler.json`, made by the official
`DiffusionProteinLanguageModel.generate` (tools/goldens/dplm.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
from transformers.initialization import no_init_weights

from ..convert.dplm import from_byprot
from ..manifest import MANIFEST_DIR, REPO_ROOT, Checkpoint, load_manifest
from ..modeling_dplm import DPLMForMaskedLM
from ..oracles.dplm import dplm_official_state_dict, dplm_transformers_network, official_spec, run_dplm_network
from ..oracles.esm2 import rotary_inv_freq
from ..parity.driver import (
    ParityRun,
    check_backends,
    conversion_shapes_record,
    cpu_autocast,
    cpu_backends,
    dims_record,
    generation_record,
    hidden_states_record,
    logits_record,
    meta_state_shapes,
    package_versions,
)
from ..tokenization_esm import ESM2_VOCAB
from .esm2_parity import MASK_ID, esm2_panel

SAMPLER_GOLDENS = REPO_ROOT / "tests" / "goldens" / "dplm_sampler.json"
FORWARD_CHECKPOINTS = ("dplm_150m",)  # the largest whose oracle, weights and ours fit this machine in minutes
_PACKAGES = ("torch", "transformers", "numpy")


def dplm_family():
    return load_manifest(MANIFEST_DIR / "dplm.toml", resolve=False)


def build_dplm(
    converted: dict[str, torch.Tensor], checkpoint: Checkpoint, model_class: type = DPLMForMaskedLM
) -> DPLMForMaskedLM:
    """`model_class` (DPLM's masked LM, or DPLM2's) at the checkpoint's dims, loaded strictly with `converted`."""
    config = model_class.config_class(
        hidden_size=checkpoint.hidden_size,
        num_hidden_layers=checkpoint.num_layers,
        num_attention_heads=checkpoint.num_heads,
    )
    with no_init_weights():  # every parameter is overwritten by the strict load
        model = model_class(config)
    model.load_state_dict(converted, strict=True)
    return model.eval()


def _compare(ours, ref_logits, ref_hidden, everywhere: torch.Tensor) -> dict[str, object]:
    pairs = [(a[everywhere], b[everywhere]) for a, b in zip(ours.hidden_states, ref_hidden, strict=True)]
    return {
        "logits": logits_record(ours.logits, ref_logits, everywhere),
        "hidden_states": {"count": len(pairs), **hidden_states_record(pairs, range(len(pairs)))},
    }


@torch.inference_mode()
def measure_dplm(
    checkpoint_id: str,
    *,
    backends: Sequence[str] | None = None,
    dtypes: Sequence[str] = ("float32",),
    seed: int = 0,
) -> list[dict[str, object]]:
    """One record per (backend, dtype): ours vs the FP32 Transformers oracle on `esm2_panel(seed)`, every
    position compared (padding included)."""
    family = dplm_family()
    checkpoint = family.checkpoint(checkpoint_id)
    backends = cpu_backends(family) if backends is None else tuple(backends)
    check_backends(backends, family.backends, family.name)
    input_ids, _ = esm2_panel(seed)
    official = dplm_official_state_dict(*checkpoint.dims, seed=seed)
    oracle = dplm_transformers_network(official)
    ref_logits, ref_hidden = run_dplm_network(oracle, input_ids)
    del oracle
    ours_model = build_dplm(from_byprot(official, checkpoint.num_heads), checkpoint)
    del official
    everywhere = torch.ones_like(input_ids, dtype=torch.bool)
    lengths = (input_ids != 1).sum(-1).sub(2).tolist()
    panel = {
        "description": f"residue lengths {lengths}, seed {seed}, {int((input_ids == MASK_ID).sum())} `<mask>` "
        f"tokens, {int((input_ids == 1).sum())} padding positions (compared too)"
    }
    records = []
    for dtype in dtypes:
        for backend in backends:
            ours_model.set_attn_implementation(backend)
            with cpu_autocast(dtype):
                ours = ours_model(input_ids, output_hidden_states=True)
            records.append(
                {
                    "kind": "forward",
                    "checkpoint": checkpoint.id,
                    "dims": dims_record(checkpoint),
                    "oracle": "transformers",
                    "oracle_backend": "sdpa",
                    "backend": backend,
                    "dtype": dtype,
                    "panel": panel,
                    "positions": "all (padding included)",
                    **_compare(ours, ref_logits, ref_hidden, everywhere),
                }
            )
    return records


def sampler_goldens() -> dict:
    return json.loads(SAMPLER_GOLDENS.read_text(encoding="utf-8"))


def golden_model(goldens: dict, case: dict) -> DPLMForMaskedLM:
    """Ours on the weights a golden case names (dims, seed and any head bias shift of its recipe)."""
    weights = case["weights"]
    layers, hidden, heads = weights["num_layers"], weights["hidden"], weights["heads"]
    shift = {int(token): value for token, value in (weights.get("lm_head_bias_shift") or {}).items()}
    official = dplm_official_state_dict(layers, hidden, heads, seed=weights["seed"], lm_head_bias_shift=shift or None)
    checkpoint = dplm_family().checkpoint(goldens.get("checkpoint", "dplm_150m"))
    return build_dplm(from_byprot(official, heads), checkpoint)


def run_golden_case(model: DPLMForMaskedLM, case: dict) -> torch.Tensor:
    """Our `generate` on a golden case's inputs, seeded as the official run was."""
    partial = case.get("partial_masks")
    torch.manual_seed(case["seed"])
    return model.generate(
        torch.tensor(case["input_ids"]),
        max_iter=case["max_iter"],
        sampling_strategy=case["sampling_strategy"],
        temperature=case.get("temperature"),
        partial_masks=None if partial is None else torch.tensor(partial, dtype=torch.bool),
        disable_resample=case.get("disable_resample", False),
        resample_ratio=case.get("resample_ratio", 0.25),
    )


def measure_sampler() -> list[dict[str, object]]:
    """One record per golden case: positions where our tokens equal the official sampler's."""
    goldens = sampler_goldens()
    records, models = [], {}
    for case in goldens["cases"]:
        key = json.dumps(case["weights"], sort_keys=True)
        if key not in models:
            models[key] = golden_model(goldens, case)
        model = models[key]
        model.set_attn_implementation("sdpa")
        ours = run_golden_case(model, case)
        official = torch.tensor(case["output_tokens"])
        records.append(
            generation_record("dplm_150m", case["name"], case["sampling_strategy"], case["max_iter"], ours, official)
        )
    return records


def check_byprot_conversion_shapes(checkpoint: Checkpoint, model_class: type, *, vocab: int, tied: bool) -> dict:
    """A ByProt checkpoint's official layout (`oracles.dplm.official_spec`) at real dims as meta tensors (rotary
    buffers real), converted by `from_byprot`, against `model_class`'s state-dict layout."""
    layers, hidden, heads = checkpoint.dims
    inv_freq = rotary_inv_freq(hidden // heads)
    spec = official_spec(layers, hidden, heads, vocab=vocab, tied=tied)
    state = {k: inv_freq.clone() if k.endswith("inv_freq") else torch.empty(s, device="meta") for k, s in spec.items()}
    config = model_class.config_class(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads)
    return conversion_shapes_record(
        checkpoint, meta_state_shapes(model_class, config), {"byprot": from_byprot(state, heads, tied=tied)}
    )


def check_dplm_conversion_shapes(checkpoint_id: str) -> dict[str, object]:
    return check_byprot_conversion_shapes(
        dplm_family().checkpoint(checkpoint_id), DPLMForMaskedLM, vocab=len(ESM2_VOCAB), tied=True
    )


def versions() -> dict[str, str]:
    return package_versions(_PACKAGES)


def measure_report(run: ParityRun) -> None:
    """FP32 on every CPU backend and BF16 autocast on SDPA for dplm_150m, the sampler goldens, and the
    conversion shape check for every checkpoint."""
    family = dplm_family()
    known = [c.id for c in family.checkpoints]
    chosen = list(run.checkpoints) or list(FORWARD_CHECKPOINTS)
    for checkpoint in chosen:
        if checkpoint not in known:
            raise SystemExit(f"unknown DPLM checkpoint {checkpoint!r}; known: {', '.join(known)}")
    for checkpoint in chosen:
        run.log(f"{checkpoint}: FP32 every CPU backend, BF16 autocast sdpa, vs Transformers EsmForMaskedLM")
        run.records += measure_dplm(checkpoint, seed=run.seed)
        run.records += measure_dplm(checkpoint, backends=("sdpa",), dtypes=("bfloat16",), seed=run.seed)
        run.save()
    run.log("sampler: official goldens")
    run.records += measure_sampler()
    run.save()
    for checkpoint in family.checkpoints:
        run.records.append(check_dplm_conversion_shapes(checkpoint.id))
    run.save()
    run.notes.append(
        "Network oracle: Transformers' EsmForMaskedLM (SDPA, mask = input_ids != <pad>), which the reference "
        "measured bit-identical to ByProt's official DPLM network on CPU FP32. Metrics cover every position, "
        "padding included (the official model defines padded outputs: padded queries attend the valid keys)."
    )
    run.notes.append(
        "Generation rows: our generate() against tokens of the official DiffusionProteinLanguageModel.generate "
        "(tests/goldens/dplm_sampler.json, CPU, seeded with torch.manual_seed), token for token."
    )
    run.notes.append("flash_attention_3 is declared (BF16 CUDA only) and not measured here: no GPU on this machine.")
