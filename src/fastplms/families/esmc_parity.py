"""ESMC (ESM++) parity against EvolutionaryScale's `esm` ESMC, through committed goldens.

The oracle cannot share this venv: its FP32 outputs on the seeded official-layout weights of
`oracles.esmc` (at real dims) are committed goldens (`tests/goldens/esmc_*.safetensors`, made by
`tools/goldens/esmc.py`). Ours is converted from the same regenerated official `esm`-layout tensors with
`convert.esmc.from_esm` and compared with them, over non-padding tokens.
"""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from ..attention import clear_flex_attention_caches
from ..configuration_esmc import ESMCConfig
from ..convert.esmc import from_biohub, from_esm
from ..manifest import MANIFEST_DIR, REPO_ROOT, Checkpoint, Family, load_manifest
from ..modeling_esmc import ESMCForMaskedLM
from ..oracles.esmc import (
    MASK_ID,
    EsmcPanel,
    biohub_state,
    esmc_official_spec,
    esmc_official_state_dict,
    esmc_panel,
)
from ..parity.driver import (
    ParityRun,
    check_backends,
    conversion_shapes_record,
    cpu_autocast,
    cpu_backends,
    dims_record,
    dtype_names,
    golden_checkpoints,
    hidden_states_record,
    logits_record,
    meta_state_shapes,
    package_versions,
)
from ..parity.metrics import max_abs, relative_l2

__all__ = [
    "ESMC_GOLDENS",
    "ESMC_MASKS",
    "ESMC_ORACLE",
    "check_esmc_conversion_shapes",
    "esmc_checkpoint",
    "esmc_golden_models",
    "measure_esmc",
    "measure_report",
    "versions",
]

ESMC_ORACLE = "esm (goldens)"
ESMC_GOLDENS = REPO_ROOT / "tests" / "goldens"
# "default": the oracle ran with sequence_id=None (padding derived from <pad>), ours gets the tokenizer's
# attention_mask; "sequence_id": both get the panel's integer chain ids (two chains in one row).
ESMC_MASKS = ("default", "sequence_id")
_GOLDEN_PREFIX = {"default": "", "sequence_id": "seqid_"}
_PACKAGES = ("torch", "transformers", "numpy")


def esmc_checkpoint(checkpoint_id: str, manifests_dir: str | Path = MANIFEST_DIR) -> tuple[Family, Checkpoint]:
    family = load_manifest(Path(manifests_dir) / "esmc.toml", resolve=False)
    return family, family.checkpoint(checkpoint_id)


def _recipe(goldens_dir: str | Path) -> dict:
    return json.loads((Path(goldens_dir) / "esmc_manifest.json").read_text(encoding="utf-8"))


def esmc_golden_models(goldens_dir: str | Path = ESMC_GOLDENS) -> tuple[str, ...]:
    """Checkpoint ids that have committed oracle goldens (the others get the conversion shape check)."""
    return tuple(_recipe(goldens_dir)["models"])


def _goldens(checkpoint: Checkpoint, goldens_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(recipe, tensors) of one checkpoint's goldens, after checking their hash, dims and panel."""
    from safetensors.torch import load_file

    recipe = _recipe(goldens_dir)
    entry = recipe["models"].get(checkpoint.id)
    if entry is None:
        raise ValueError(
            f"no ESMC goldens for {checkpoint.id!r} (have: {', '.join(recipe['models'])}); "
            "use check_esmc_conversion_shapes for it"
        )
    dims = (entry["n_layers"], entry["d_model"], entry["n_heads"])
    if dims != checkpoint.dims:
        raise ValueError(f"{checkpoint.id}: goldens were made at dims {dims}, the manifest says otherwise")
    path = Path(goldens_dir) / entry["file"]
    if hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
        raise ValueError(f"{path}: sha256 differs from esmc_manifest.json")
    gold = load_file(str(path))
    panel = esmc_panel()
    if not (torch.equal(gold["input_ids"], panel.input_ids) and torch.equal(gold["sequence_id"], panel.sequence_id)):
        raise ValueError(f"{path}: its panel differs from esmc_panel()")
    return recipe, gold


def _config(checkpoint: Checkpoint) -> ESMCConfig:
    layers, hidden, heads = checkpoint.dims
    return ESMCConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads)


def _build_ours(checkpoint: Checkpoint, seed: int) -> ESMCForMaskedLM:
    converted = from_esm(esmc_official_state_dict(*checkpoint.dims, seed=seed))
    with torch.device("meta"):
        model = ESMCForMaskedLM(_config(checkpoint))
    # Assigned, not copied: the converted tensors become the parameters (one copy of the weights in memory).
    model.load_state_dict(converted, strict=True, assign=True)
    return model.eval()


@torch.inference_mode()
def _run_ours(
    model: ESMCForMaskedLM, backend: str, dtype: str, mask: str, panel: EsmcPanel
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """(logits, hidden states, official-style embeddings) of ours on the panel."""
    model.set_attn_implementation(backend)
    kwargs = {"attention_mask": panel.attention_mask} if mask == "default" else {"sequence_id": panel.sequence_id}
    with cpu_autocast(dtype):
        out = model(panel.input_ids, output_hidden_states=True, **kwargs)
        # The official `embeddings` (the final norm of the last block's output) is our last hidden state.
        embeddings = out.hidden_states[-1]
    return out.logits, tuple(out.hidden_states), embeddings


def measure_esmc(
    checkpoint_id: str,
    *,
    backends: Sequence[str] | None = None,
    dtype: str | Sequence[str] = ("float32", "bfloat16"),
    masks: Sequence[str] = ESMC_MASKS,
    goldens_dir: str | Path = ESMC_GOLDENS,
    manifests_dir: str | Path = MANIFEST_DIR,
) -> list[dict[str, object]]:
    """One record per (backend, dtype, mask): ours vs the official ESMC's FP32 goldens on `esmc_panel()`.

    Records have the shape of `measure_esm2`'s (oracle `"esm (goldens)"`), plus `mask` (`"default"`: the
    oracle ran with `sequence_id=None`, ours with the panel's attention mask; `"sequence_id"`: both with the
    panel's integer chain ids) and `embeddings` (the final-normed output). The goldens hold hidden states
    of the default run only, at three blocks (first, middle, last), so `sequence_id` records carry no
    hidden-state metrics; the last block's output is ours only after the final norm (our last hidden state,
    measured as `embeddings`), so the hidden-state metrics compare the first two. `bfloat16` runs ours with
    FP32 parameters under CPU BF16 autocast against the same FP32 goldens. `backends` defaults to every
    declared CPU backend. The weights (seed taken from the goldens' recipe) are regenerated here, in the
    official `esm` layout, and converted with `from_esm`.
    """
    family, checkpoint = esmc_checkpoint(checkpoint_id, manifests_dir)
    backends = cpu_backends(family) if backends is None else tuple(backends)
    check_backends(backends, family.backends, family.name)
    for mask in masks:
        if mask not in ESMC_MASKS:
            raise ValueError(f"unknown mask {mask!r}; valid: {', '.join(ESMC_MASKS)}")
    dtypes = dtype_names(dtype)
    recipe, gold = _goldens(checkpoint, goldens_dir)
    seed = int(recipe["seed"])
    panel = esmc_panel()
    valid = panel.attention_mask.bool()
    # Golden entry j is the official block output hidden_state_layers[j], our entry that + 1 (ours leads with
    # the embeddings) except the last block's: our last entry is already final-normed.
    official = [int(i) for i in gold["hidden_state_layers"]]
    golden = [(j, i + 1) for j, i in enumerate(official) if i + 1 < checkpoint.num_layers]
    compared = [i for _, i in golden]
    panel_record = {
        "seed": seed,
        "lengths": [int(n) - 2 for n in panel.attention_mask.sum(-1)],
        "masked": int((panel.input_ids == MASK_ID).sum()),
        "chains": [int(row.max()) + 1 for row in panel.sequence_id],
    }
    records: list[dict[str, object]] = []
    model = _build_ours(checkpoint, seed)
    try:
        for name in dtypes:
            for backend in backends:
                for mask in masks:
                    logits, hidden, embeddings = _run_ours(model, backend, name, mask, panel)
                    prefix = _GOLDEN_PREFIX[mask]
                    ref_embeddings = gold[prefix + "embeddings"]
                    record: dict[str, object] = {
                        "kind": "forward",
                        "checkpoint": checkpoint.id,
                        "dims": dims_record(checkpoint),
                        "oracle": ESMC_ORACLE,
                        "oracle_backend": "native",
                        "backend": backend,
                        "dtype": name,
                        "mask": mask,
                        "panel": panel_record,
                        "logits": logits_record(logits, gold[prefix + "logits"], valid),
                        "embeddings": {
                            "relative_l2": relative_l2(embeddings[valid], ref_embeddings),
                            "max_abs": max_abs(embeddings[valid], ref_embeddings),
                        },
                    }
                    if mask == "default":
                        pairs = [(hidden[i][valid], gold["hidden_states"][j]) for j, i in golden]
                        record["hidden_states"] = {
                            "count": len(hidden),
                            "compared": compared,
                            **hidden_states_record(pairs, compared),
                        }
                    records.append(record)
                    del logits, hidden, embeddings
    finally:
        clear_flex_attention_caches()
        del model
        gc.collect()
    return records


def check_esmc_conversion_shapes(checkpoint_id: str, manifests_dir: str | Path = MANIFEST_DIR) -> dict[str, object]:
    """Convert both official ESMC layouts at real dims on the meta device; compare with ours (no weights).

    The `esm` layout is `esmc_official_spec` (the official `ESMC(...).state_dict()`); the Biohub layout is
    the same tensors under Transformer-Engine names, with the weightless `_extra_state` entries it carries.
    Each conversion must give exactly the keys and shapes of `ESMCForMaskedLM(config).state_dict()` built
    on the meta device, without materializing anything.
    """
    _family, checkpoint = esmc_checkpoint(checkpoint_id, manifests_dir)
    esm_state = {key: torch.empty(shape, device="meta") for key, shape in esmc_official_spec(*checkpoint.dims).items()}
    converted_by = {"esm": from_esm(esm_state), "biohub": from_biohub(biohub_state(esm_state))}
    return conversion_shapes_record(checkpoint, meta_state_shapes(ESMCForMaskedLM, _config(checkpoint)), converted_by)


# --------------------------------------------------------------------------- the report


def versions() -> dict[str, str]:
    """The oracle ran in its own venv, so its version is the goldens'; the rest are this venv's."""
    found = {"esm (goldens)": _recipe(ESMC_GOLDENS)["versions"]["esm"]}
    return found | package_versions(_PACKAGES)


def measure_report(run: ParityRun) -> None:
    """The ESMC report: per chosen checkpoint (default: every one with committed oracle goldens) every
    declared dtype on every CPU backend, with both masks, against the goldens; every checkpoint also gets
    the conversion shape check (both official layouts)."""
    family = load_manifest(MANIFEST_DIR / "esmc.toml", resolve=False)
    known = [c.id for c in family.checkpoints]
    chosen = golden_checkpoints(run, family, esmc_golden_models())
    backends = list(cpu_backends(family))
    dtypes = [d for d in ("float32", "bfloat16") if d in family.dtypes]

    for checkpoint in chosen:
        run.log(f"{checkpoint}: {dtypes}, backends {backends}, default mask and sequence_id, vs the esm goldens")
        run.records += measure_esmc(checkpoint, backends=backends, dtype=dtypes)
        run.save()
    parameters: dict[str, int] = {}
    for checkpoint in known:
        run.log(f"{checkpoint}: conversion shape check (esm and biohub layouts)")
        record = check_esmc_conversion_shapes(checkpoint)
        parameters[checkpoint] = int(record["parameters"])
        run.records.append(record)
        run.save()

    for checkpoint in known:
        if checkpoint not in chosen:
            gb = parameters[checkpoint] * 4 / 1e9
            run.notes.append(
                f"{checkpoint}: forward not run (no oracle goldens: {gb:.1f} GB of FP32 weights per copy, so the "
                "official forward does not fit the machines the goldens and this report are made on); conversion "
                "shape check only."
            )
    run.notes.append(
        "Oracle: EvolutionaryScale esm ESMC (esm==3.2.1.post1, FP32 CPU, use_flash_attn=False), run once by "
        "tools/goldens/esmc.py in its own venv; its outputs are the committed goldens tests/goldens/esmc_*.safetensors "
        "(sha256-checked). The weights are regenerated here (fastplms.oracles.esmc, seed 0) in the official esm layout "
        "and converted with fastplms.convert.esmc.from_esm."
    )
    run.notes.append(
        "mask default: the oracle ran with sequence_id=None (padding derived from <pad>), ours with the tokenizer's "
        "attention_mask; mask sequence_id: both with the panel's integer chain ids, the third row holding two chains "
        "joined by '|' (its residue length, 33, counts the '|')."
    )
    run.notes.append(
        "The goldens keep hidden states of the default-mask run only, at the first, middle and last blocks "
        "(ours: hidden_states[i + 1] is the official block i); the worst of those is reported, and sequence_id "
        "rows have none. Embeddings are the final-normed output (the official embeddings), compared in every row."
    )
    run.notes.append(
        "Logits, hidden-state and embedding metrics cover all non-padding tokens (<cls> and <eos> included). "
        "BF16 rows: ours under CPU BF16 autocast with FP32 parameters vs the FP32 goldens."
    )
    run.notes.append(
        "top1_agreement counts only positions where the oracle puts p >= 0.5 on its top token "
        "(confident_positions says how many); top1_agreement_all (argmax agreement over every valid position) "
        "is reported beside it."
    )
