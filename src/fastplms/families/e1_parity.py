"""Profluent-E1 parity against Profluent's official code, through committed goldens.

The official code (Profluent-AI/E1, run by `tools/goldens/e1.py` in this venv from a checkout outside the
repository) computed FP32 CPU outputs on the seeded official-layout weights of `oracles.e1` at each
checkpoint's real dims, on `e1_panel()` (single-sequence and retrieval rows, padding, `?` masks); they are the
committed goldens `tests/goldens/e1_*.safetensors`. Ours is converted from the same regenerated official
tensors with `convert.e1.from_official` and compared with them: logits and the stored hidden states (the
official `hidden_states[i]` is ours, every index, the last being the final-normed output), over valid tokens,
and separately at the padding positions, whose official outputs are defined (see `modeling_e1`).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from ..attention import clear_flex_attention_caches
from ..configuration_e1 import E1Config
from ..convert.e1 import from_official
from ..manifest import MANIFEST_DIR, Checkpoint, Family, load_manifest
from ..modeling_e1 import E1ForMaskedLM
from ..oracles.e1 import E1_GOLDENS_DIR, E1_MANIFEST_JSON, MASK_ID, e1_goldens, e1_official_spec, e1_panel
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
from .adapter import manifest_config

__all__ = [
    "E1_ORACLE",
    "build_e1",
    "check_e1_conversion_shapes",
    "e1_checkpoint",
    "e1_config",
    "e1_golden_models",
    "measure_e1",
    "measure_e1_cache",
    "measure_report",
    "run_e1",
    "versions",
]

E1_ORACLE = "Profluent E1 (goldens)"
_PACKAGES = ("torch", "transformers", "numpy")
# Manifest field names that E1Config spells otherwise (E1Config keeps the official config.json names).
_CONFIG_NAMES = {
    "max_positions_within_seq": "max_num_positions_within_seq",
    "max_positions_global": "max_num_positions_global",
    "num_kv_heads": "num_key_value_heads",
}


def e1_checkpoint(checkpoint_id: str, manifests_dir: str | Path = MANIFEST_DIR) -> tuple[Family, Checkpoint]:
    family = load_manifest(Path(manifests_dir) / "e1.toml", resolve=False)
    return family, family.checkpoint(checkpoint_id)


def e1_config(family: Family, checkpoint: Checkpoint) -> E1Config:
    """E1Config of a checkpoint as the manifest says: its dims, the family's backends, dtypes and BF16 policy,
    and the config fields (the family's `[config]` and the checkpoint's own)."""
    fields = {_CONFIG_NAMES.get(key, key): value for key, value in family.checkpoint_config(checkpoint.id).items()}
    return manifest_config(E1Config, family, checkpoint, **fields)


def e1_golden_models(goldens_dir: str | Path = E1_GOLDENS_DIR) -> tuple[str, ...]:
    """Checkpoint ids that have committed oracle goldens (the others get the conversion shape check)."""
    return tuple(json.loads((Path(goldens_dir) / E1_MANIFEST_JSON).read_text(encoding="utf-8"))["models"])


def build_e1(checkpoint_id: str, seed: int = 0, manifests_dir: str | Path = MANIFEST_DIR) -> E1ForMaskedLM:
    """Ours on the seeded official weights of `checkpoint_id`, converted with `from_official`, in eval mode."""
    from ..oracles.e1 import e1_dims, e1_official_state_dict

    family, checkpoint = e1_checkpoint(checkpoint_id, manifests_dir)
    dims = e1_dims(checkpoint_id, Path(manifests_dir) / "e1.toml")
    converted = from_official(e1_official_state_dict(dims, seed=seed), checkpoint.num_heads)
    with torch.device("meta"):
        model = E1ForMaskedLM(e1_config(family, checkpoint))
    # Assigned, not copied: the converted tensors become the parameters (one copy of the weights in memory).
    model.load_state_dict(converted, strict=True, assign=True)
    return model.eval()


@torch.inference_mode()
def run_e1(model: E1ForMaskedLM, backend: str, dtype: str = "float32"):
    """(logits, hidden states) of ours on `e1_panel()` with `backend`, under the dtype's CPU policy."""
    model.set_attn_implementation(backend)
    with cpu_autocast(dtype):
        out = model(**e1_panel().model_inputs(), output_hidden_states=True)
    return out.logits, tuple(out.hidden_states)


def compare_e1(logits, hidden, gold: dict[str, torch.Tensor]) -> dict[str, object]:
    """Logits and the goldens' hidden states, over valid tokens; the same at padding, as maxima."""
    panel = e1_panel()
    valid = panel.valid
    layers = [int(i) for i in gold["hidden_state_layers"]]
    pairs = [(hidden[i][valid].float(), gold["hidden_states"][j][valid]) for j, i in enumerate(layers)]
    pad_pairs = [(hidden[i][~valid].float(), gold["hidden_states"][j][~valid]) for j, i in enumerate(layers)]
    return {
        "logits": logits_record(logits.float(), gold["logits"], valid),
        "hidden_states": {"count": len(hidden), "compared": layers, **hidden_states_record(pairs, layers)},
        "embeddings": {
            "relative_l2": relative_l2(hidden[-1][valid].float(), gold["hidden_states"][-1][valid]),
            "max_abs": max_abs(hidden[-1][valid].float(), gold["hidden_states"][-1][valid]),
        },
        "padding": {
            "positions": int((~valid).sum()),
            "logits_max_abs": max_abs(logits[~valid].float(), gold["logits"][~valid]),
            "hidden_states_max_abs": max(max_abs(a, b) for a, b in pad_pairs),
        },
    }


def measure_e1(
    checkpoint_id: str,
    *,
    backends: Sequence[str] | None = None,
    dtype: str | Sequence[str] = ("float32", "bfloat16"),
    manifests_dir: str | Path = MANIFEST_DIR,
) -> list[dict[str, object]]:
    """One record per (backend, dtype): ours vs the official E1's FP32 goldens on `e1_panel()`.

    `bfloat16` runs ours with FP32 parameters under CPU BF16 autocast against the same FP32 goldens.
    `backends` defaults to every declared CPU backend. Flex runs compiled, as in use.
    """
    family, checkpoint = e1_checkpoint(checkpoint_id, manifests_dir)
    backends = cpu_backends(family) if backends is None else tuple(backends)
    check_backends(backends, family.backends, family.name)
    dtypes = dtype_names(dtype)
    recipe, _entry, gold = e1_goldens(checkpoint_id)
    panel = e1_panel()
    panel_record = {
        "seed": int(recipe["seed"]),
        "instances": len(panel.instances),
        "lengths": [len(s.replace(",", "")) for s in panel.instances],
        "chains": [len(s.split(",")) for s in panel.instances],
        "tokens": [int(n) for n in panel.valid.sum(-1)],
        "masked": int((panel.input_ids == MASK_ID).sum()),
    }
    records: list[dict[str, object]] = []
    model = build_e1(checkpoint_id, int(recipe["seed"]), manifests_dir)
    try:
        for name in dtypes:
            for backend in backends:
                logits, hidden = run_e1(model, backend, name)
                records.append(
                    {
                        "kind": "forward",
                        "checkpoint": checkpoint.id,
                        "dims": dims_record(checkpoint),
                        "oracle": E1_ORACLE,
                        "oracle_backend": "native",
                        "backend": backend,
                        "dtype": name,
                        "panel": panel_record,
                        **compare_e1(logits, hidden, gold),
                    }
                )
                del logits, hidden
    finally:
        clear_flex_attention_caches()
        del model
        gc.collect()
    return records


@torch.inference_mode()
def measure_e1_cache(
    checkpoint_id: str, *, backends: Sequence[str] | None = None, manifests_dir: str | Path = MANIFEST_DIR
) -> list[dict[str, object]]:
    """One record per backend (FP32): ours against a cached context vs the goldens' cache cases.

    Row CACHE_ROW of the panel alone: its query against the cached two-sequence context vs the official cached
    result (`cache_logits`, equal on CPU to its full forward), and its last two sequences as a "query" against
    the cached first one vs the official full forward (the official cached path deviates there).
    """
    from ..modeling_e1 import prepare_e1_inputs
    from ..oracles.e1 import CACHE_ROW

    family, checkpoint = e1_checkpoint(checkpoint_id, manifests_dir)
    backends = cpu_backends(family) if backends is None else tuple(backends)
    recipe, entry, gold = e1_goldens(checkpoint_id)
    *context, query = e1_panel().instances[CACHE_ROW].split(",")
    model = build_e1(checkpoint_id, int(recipe["seed"]), manifests_dir)
    records: list[dict[str, object]] = []
    try:
        for backend in backends:
            model.set_attn_implementation(backend)
            cache = model.encode_context(context)
            single = model(**prepare_e1_inputs(query), context_cache=cache).logits
            first = model.encode_context(context[:1])
            multi = model(**prepare_e1_inputs(query, context[1:]), context_cache=first).logits
            want_multi = gold["cache_full_logits"][:, first.length :]
            records.append(
                {
                    "kind": "context_cache",
                    "checkpoint": checkpoint.id,
                    "backend": backend,
                    "dtype": "float32",
                    "single_sequence_query": {
                        "context_tokens": cache.length,
                        "relative_l2": relative_l2(single, gold["cache_logits"]),
                        "max_abs": max_abs(single, gold["cache_logits"]),
                    },
                    "two_sequence_query": {
                        "context_tokens": first.length,
                        "relative_l2": relative_l2(multi, want_multi),
                        "max_abs": max_abs(multi, want_multi),
                        "official_cached_max_abs": entry["cache_two_sequence_query"][
                            "second_query_sequence_max_abs_logits"
                        ],
                    },
                }
            )
    finally:
        clear_flex_attention_caches()
        del model
        gc.collect()
    return records


def check_e1_conversion_shapes(checkpoint_id: str, manifests_dir: str | Path = MANIFEST_DIR) -> dict[str, object]:
    """Convert the official layout at real dims on the meta device; compare with ours (no weights)."""
    from ..oracles.e1 import e1_dims

    family, checkpoint = e1_checkpoint(checkpoint_id, manifests_dir)
    spec = e1_official_spec(e1_dims(checkpoint_id, Path(manifests_dir) / "e1.toml"))
    official = {key: torch.empty(shape, device="meta") for key, shape in spec.items()}
    converted = {"profluent": from_official(official, checkpoint.num_heads)}
    return conversion_shapes_record(
        checkpoint, meta_state_shapes(E1ForMaskedLM, e1_config(family, checkpoint)), converted
    )


def versions() -> dict[str, str]:
    """The official code ran in this venv when the goldens were made: its commit and their versions."""
    recipe = json.loads((E1_GOLDENS_DIR / E1_MANIFEST_JSON).read_text(encoding="utf-8"))
    found = {
        "Profluent E1 (goldens)": recipe["upstream"]["commit"][:12],
        "torch (goldens)": recipe["versions"]["torch"],
    }
    return found | package_versions(_PACKAGES)


def measure_report(run: ParityRun) -> None:
    """The E1 report: per chosen checkpoint (default: every one with goldens) every declared dtype on every
    CPU backend against the goldens; every checkpoint also gets the conversion shape check."""
    family = load_manifest(MANIFEST_DIR / "e1.toml", resolve=False)
    known = [c.id for c in family.checkpoints]
    chosen = golden_checkpoints(run, family, e1_golden_models())
    backends = list(cpu_backends(family))
    dtypes = [d for d in ("float32", "bfloat16") if d in family.dtypes]
    for checkpoint in chosen:
        run.log(f"{checkpoint}: {dtypes}, backends {backends}, vs the official E1 goldens")
        run.records += measure_e1(checkpoint, backends=backends, dtype=dtypes)
        run.save()
    cache_records = []
    for checkpoint in chosen:
        run.log(f"{checkpoint}: context cache vs the goldens' cache cases")
        records = measure_e1_cache(checkpoint, backends=backends)
        cache_records += records
        run.records += records
        run.save()
    for checkpoint in known:
        run.log(f"{checkpoint}: conversion shape check")
        run.records.append(check_e1_conversion_shapes(checkpoint))
        run.save()
    for checkpoint in known:
        if checkpoint not in chosen:
            run.notes.append(f"{checkpoint}: forward not run (no oracle goldens); conversion shape check only.")
    run.notes.append(
        "Oracle: Profluent-AI/E1 at 219c7c7 (E1ForMaskedLM, FP32 CPU, one thread, HF_HUB_OFFLINE=1 so RMSNorm is "
        "F.rms_norm), run by tools/goldens/e1.py; its outputs are the committed goldens tests/goldens/e1_*.safetensors "
        "(sha256-checked). The weights are regenerated here (fastplms.oracles.e1, seed 0) in the official layout and "
        "converted with fastplms.convert.e1.from_official."
    )
    run.notes.append(
        "Panel: 5 rows (single-sequence rows and retrieval rows of 2 and 3 sequences, '?' masks, right padding). "
        "Logits and hidden states (official indices 0, L/2 and L; L is the final-normed output = embeddings) are "
        "compared over valid tokens; 'padding' gives the maxima at the padding positions, whose official outputs "
        "are defined (zero attention output there) and reproduced."
    )
    run.notes.append(
        "BF16 rows: ours with FP32 parameters under CPU BF16 autocast (residual stream in BF16 from the embeddings "
        "on, as the official code runs under CUDA autocast) vs the FP32 goldens. flex_attention runs compiled."
    )
    if cache_records:
        worst_single = max(r["single_sequence_query"]["relative_l2"] for r in cache_records)
        worst_multi = max(r["two_sequence_query"]["relative_l2"] for r in cache_records)
        official = max(r["two_sequence_query"]["official_cached_max_abs"] for r in cache_records)
        run.notes.append(
            f"Context cache (FP32, {', '.join(backends)}; records kind context_cache): a query against the cached "
            f"context vs the official cached result, worst logits relative L2 {worst_single:.2e}; a two-sequence "
            f"query against a one-sequence cached context vs the official full forward, worst {worst_multi:.2e} "
            f"(the official cached path deviates there by up to {official:.2f} in the logits)."
        )
    run.notes.append(
        "top1_agreement counts only positions where the oracle puts p >= 0.5 on its top token "
        "(confident_positions says how many); top1_agreement_all is the argmax agreement over every valid position."
    )
