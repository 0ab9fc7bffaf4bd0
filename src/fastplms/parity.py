"""Parity of our models against the official implementations (not a runtime module).

The one place that measures parity; tests, `tools/measure_parity.py` and the generated docs all read
what it returns. For ESM2 the oracles are Transformers' `EsmForMaskedLM` (fed the `facebook/esm2_*`
layout) and fair-esm's `ESM2` (fed the original `.pt` layout). Weights are the seeded official-layout
tensors of `esm2_reference` at a checkpoint's real dims, taken from its manifest. Ours is converted
from each oracle's own files (`from_transformers` / `from_fair_esm`), never from the other layout, so a
passing record proves that conversion as well as the forward.

For ESMC (ESM++) the oracle is EvolutionaryScale's `esm` ESMC, which cannot share this venv: its FP32
outputs on the seeded official-layout weights of `esmc_reference` (at real dims) are committed goldens
(`tests/goldens/esmc_*.safetensors`, made by `tools/goldens/esmc.py`). Ours is converted from the same
regenerated official `esm`-layout tensors with `convert_esmc.from_esm` and compared with them.

Every metric is taken over valid positions only: non-padding tokens for logits and hidden states
(`<cls>` and `<eos>` included, which only makes the check stricter), pairs of real residues for contacts.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.initialization import no_init_weights

from .attention import clear_flex_attention_caches
from .configuration_esm2 import ESM2Config
from .configuration_esmc import ESMCConfig
from .conversion import load_weights
from .convert_esm2 import from_fair_esm, from_transformers
from .convert_esmc import from_biohub, from_esm
from .esm2_reference import (
    fair_esm2_key,
    hf_esm2_spec,
    load_fair_esm_local,
    rotary_inv_freq,
    write_fair_esm_pt,
    write_hf_snapshot,
)
from .esmc_reference import MASK_ID as ESMC_MASK_ID
from .esmc_reference import esmc_official_spec, esmc_official_state_dict, esmc_panel
from .manifest import MANIFEST_DIR, REPO_ROOT, Checkpoint, Family, load_manifest
from .modeling_esm2 import RESIDUES, ESM2ForMaskedLM
from .modeling_esmc import ESMCForMaskedLM
from .tokenization_esm import ESM2_VOCAB
from .validation import max_abs, parity_report, relative_l2, top1_agreement

__all__ = [
    "ESM2_BACKENDS",
    "ESM2_ORACLES",
    "ESMC_BACKENDS",
    "ESMC_GOLDENS",
    "ESMC_MASKS",
    "ESMC_ORACLE",
    "FORWARD_PARAMETER_LIMIT",
    "PANEL_LENGTHS",
    "check_esm2_conversion_shapes",
    "check_esmc_conversion_shapes",
    "esm2_checkpoint",
    "esm2_panel",
    "esm2_parameter_count",
    "esmc_checkpoint",
    "esmc_golden_models",
    "forward_feasible",
    "measure_esm2",
    "measure_esmc",
]

PANEL_LENGTHS = (1, 12, 37, 120, 250)
ESM2_BACKENDS = ("eager", "sdpa", "flex_attention")
ESM2_ORACLES = ("transformers", "fair-esm")
# Largest checkpoint whose full parity run (two oracles, three backends, FP32 + BF16) fits a 2-core,
# 24 GB CPU machine in minutes: ESM2-150M. Bigger ones get the conversion shape check instead.
FORWARD_PARAMETER_LIMIT = 200_000_000

_IDS = {token: i for i, token in enumerate(ESM2_VOCAB)}
CLS_ID, PAD_ID, EOS_ID, MASK_ID = _IDS["<cls>"], _IDS["<pad>"], _IDS["<eos>"], _IDS["<mask>"]
_RESIDUE_IDS = torch.tensor([_IDS[r] for r in RESIDUES])
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# --------------------------------------------------------------------------- manifest


def esm2_checkpoint(checkpoint_id: str, manifests_dir: str | Path = MANIFEST_DIR) -> tuple[Family, Checkpoint]:
    family = load_manifest(Path(manifests_dir) / "esm2.toml", resolve=False)
    return family, family.checkpoint(checkpoint_id)


def esm2_parameter_count(checkpoint: Checkpoint) -> int:
    """Parameters of the official layout at the checkpoint's dims (rotary buffers excluded)."""
    spec = hf_esm2_spec(checkpoint.num_layers, checkpoint.hidden_size, checkpoint.num_heads)
    return sum(math.prod(shape) for key, shape in spec.items() if not key.endswith("inv_freq"))


def forward_feasible(checkpoint: Checkpoint) -> bool:
    """Whether a full forward parity run of this checkpoint fits the CPU machines here."""
    return esm2_parameter_count(checkpoint) <= FORWARD_PARAMETER_LIMIT


# --------------------------------------------------------------------------- panel


def esm2_panel(
    seed: int = 0, lengths: Sequence[int] = PANEL_LENGTHS, mask_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch of ESM2 inputs: `<cls>` residues `<eos>`, right-padded with `<pad>`.

    The longest sequence holds every one of the 25 residue letters; `<mask>` tokens replace about
    `mask_fraction` of the residues of every sequence longer than one residue (at least one each), which
    exercises the token-dropout rescaling per row. The single-residue sequence stays unmasked.
    """
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"panel lengths must be positive, got {lengths}")
    if max(lengths) < len(RESIDUES):
        raise ValueError(f"the longest panel sequence must hold all {len(RESIDUES)} residues, got {max(lengths)}")
    generator = torch.Generator().manual_seed(seed)
    seq = max(lengths) + 2
    input_ids = torch.full((len(lengths), seq), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), seq), dtype=torch.long)
    covering_row = lengths.index(max(lengths))
    for row, n in enumerate(lengths):
        letters = torch.randint(len(RESIDUES), (n,), generator=generator)
        protected = torch.zeros(n, dtype=torch.bool)
        if row == covering_row:
            where = torch.randperm(n, generator=generator)[: len(RESIDUES)]
            letters[where] = torch.arange(len(RESIDUES))
            protected[where] = True
        ids = _RESIDUE_IDS[letters]
        if n > 1:
            candidates = (~protected).nonzero().flatten()
            count = min(len(candidates), max(1, round(n * mask_fraction)))
            ids[candidates[torch.randperm(len(candidates), generator=generator)[:count]]] = MASK_ID
        input_ids[row, 0] = CLS_ID
        input_ids[row, 1 : n + 1] = ids
        input_ids[row, n + 1] = EOS_ID
        attention_mask[row, : n + 2] = 1
    return input_ids, attention_mask


def _contact_pairs(attention_mask: torch.Tensor) -> torch.Tensor:
    """(batch, seq-2, seq-2) bool: both positions are real residues (specials and padding dropped)."""
    residues = attention_mask.sum(-1) - 2
    valid = torch.arange(attention_mask.shape[1] - 2)[None, :] < residues[:, None]
    return valid[:, :, None] & valid[:, None, :]


# --------------------------------------------------------------------------- runs


@dataclass
class _Outputs:
    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]
    contacts: torch.Tensor


@torch.inference_mode()
def _run_transformers(snapshot: Path, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> _Outputs:
    from transformers import EsmForMaskedLM

    # Eager: the definition, and the only Transformers backend that returns attention maps for contacts.
    model = EsmForMaskedLM.from_pretrained(snapshot, attn_implementation="eager", dtype=torch.float32).eval()
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    contacts = model.predict_contacts(input_ids, attention_mask)
    return _Outputs(out.logits, tuple(out.hidden_states), contacts)


@torch.inference_mode()
def _run_fair_esm(checkpoint_pt: Path, input_ids: torch.Tensor, num_layers: int) -> _Outputs:
    model, _alphabet = load_fair_esm_local(checkpoint_pt)
    model.eval()
    # fair-esm derives padding from the <pad> id itself; the panel is right-padded with it.
    out = model(input_ids, repr_layers=list(range(num_layers + 1)), return_contacts=True)
    hidden = tuple(out["representations"][i] for i in range(num_layers + 1))
    return _Outputs(out["logits"], hidden, out["contacts"])


def _build_ours(converted: dict[str, torch.Tensor], checkpoint: Checkpoint) -> ESM2ForMaskedLM:
    config = ESM2Config(
        hidden_size=checkpoint.hidden_size,
        num_hidden_layers=checkpoint.num_layers,
        num_attention_heads=checkpoint.num_heads,
    )
    # Every parameter is overwritten by the strict load below; a random init first only costs time.
    with no_init_weights():
        model = ESM2ForMaskedLM(config)
    model.load_state_dict(converted, strict=True)
    return model.eval()


@torch.inference_mode()
def _run_ours(
    model: ESM2ForMaskedLM,
    backend: str,
    dtype: str,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    contacts: torch.Tensor | None,
) -> _Outputs:
    model.set_attn_implementation(backend)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()
    with autocast:
        out = model(input_ids, attention_mask, output_hidden_states=True)
        if contacts is None:
            contacts = model.predict_contacts(input_ids, attention_mask)
    return _Outputs(out.logits, tuple(out.hidden_states), contacts)


def _compare(ours: _Outputs, ref: _Outputs, attention_mask: torch.Tensor) -> dict[str, object]:
    valid = attention_mask.bool()
    if len(ours.hidden_states) != len(ref.hidden_states):
        raise ValueError(f"ours has {len(ours.hidden_states)} hidden states, the oracle {len(ref.hidden_states)}")
    states = list(zip(ours.hidden_states, ref.hidden_states, strict=True))
    per_state = [relative_l2(a, b, valid) for a, b in states]
    # NaN ranks worst, so a broken state is the one reported.
    worst = max(range(len(per_state)), key=lambda i: (math.isnan(per_state[i]), per_state[i]))
    pairs = _contact_pairs(attention_mask)
    ours_contacts, ref_contacts = ours.contacts[pairs][None], ref.contacts[pairs][None]
    logits = parity_report(ours.logits, ref.logits, valid, logits=True)
    # top1_agreement only counts positions where the oracle is confident (p >= 0.5); seeded weights give
    # few or none, which makes it vacuously 1.0, so the count and the all-position agreement go with it.
    logits["confident_positions"] = int((ref.logits[valid].double().softmax(-1).amax(-1) >= 0.5).sum())
    logits["top1_agreement_all"] = top1_agreement(ours.logits, ref.logits, valid, confidence=0.0)
    return {
        "logits": logits,
        "hidden_states": {
            "count": len(per_state),
            "worst_relative_l2": per_state[worst],
            "worst_index": worst,
            "worst_max_abs": max(max_abs(a, b, valid) for a, b in states),
        },
        "contacts": {
            "max_abs": max_abs(ours_contacts, ref_contacts),
            "relative_l2": relative_l2(ours_contacts, ref_contacts),
        },
    }


def _dtypes(dtype: str | Iterable[str]) -> tuple[str, ...]:
    dtypes = (dtype,) if isinstance(dtype, str) else tuple(dtype)
    for name in dtypes:
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; measured dtypes: {', '.join(_DTYPES)}")
    return dtypes


def measure_esm2(
    checkpoint_id: str,
    *,
    backends: Sequence[str] = ESM2_BACKENDS,
    dtype: str | Sequence[str] = "float32",
    oracles: Sequence[str] = ESM2_ORACLES,
    seed: int = 0,
    lengths: Sequence[int] = PANEL_LENGTHS,
    manifests_dir: str | Path = MANIFEST_DIR,
) -> list[dict[str, object]]:
    """One record per (oracle, backend, dtype): ours vs the FP32 oracle on `esm2_panel(seed, lengths)`.

    `dtype` is one name or several. `bfloat16` runs ours with FP32 parameters under CPU BF16 autocast
    (the family's declared policy) and compares it with the same FP32 oracle outputs.
    Contacts always run eager attention (they are built from attention maps), in ours and in both
    oracles, so they are the same for every backend of one (oracle, dtype).
    """
    family, checkpoint = esm2_checkpoint(checkpoint_id, manifests_dir)
    for oracle in oracles:
        if oracle not in ESM2_ORACLES:
            raise ValueError(f"unknown oracle {oracle!r}; valid: {', '.join(ESM2_ORACLES)}")
    for backend in backends:
        if backend not in family.backends:
            raise ValueError(f"backend {backend!r} is not declared for ESM2; declared: {', '.join(family.backends)}")
    dtypes = _dtypes(dtype)
    dims = (checkpoint.num_layers, checkpoint.hidden_size, checkpoint.num_heads)
    input_ids, attention_mask = esm2_panel(seed, lengths)
    panel = {"seed": seed, "lengths": list(lengths), "masked": int((input_ids == MASK_ID).sum())}
    records: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="fastplms-parity-") as tmp:
        for oracle in oracles:
            if oracle == "transformers":
                snapshot = write_hf_snapshot(Path(tmp) / "hf", *dims, seed=seed)
                ref = _run_transformers(snapshot, input_ids, attention_mask)
                # The very bytes the oracle loaded, converted by our Transformers-layout transform.
                state = load_weights(snapshot / "model.safetensors")
                converted = from_transformers(state, checkpoint.num_heads)
                oracle_backend = "eager"
            else:
                checkpoint_pt = write_fair_esm_pt(Path(tmp) / "fair", *dims, seed=seed)
                ref = _run_fair_esm(checkpoint_pt, input_ids, checkpoint.num_layers)
                regression = checkpoint_pt.with_name(f"{checkpoint_pt.stem}-contact-regression.pt")
                state = load_weights(checkpoint_pt)
                converted = from_fair_esm(state, checkpoint.num_heads, contact=load_weights(regression))
                oracle_backend = "native"
            ours_model = _build_ours(converted, checkpoint)
            del state, converted
            gc.collect()
            for name in dtypes:
                contacts = None  # backend-independent (always eager): computed once per dtype
                for backend in backends:
                    ours = _run_ours(ours_model, backend, name, input_ids, attention_mask, contacts)
                    contacts = ours.contacts
                    records.append(
                        {
                            "kind": "forward",
                            "checkpoint": checkpoint.id,
                            "dims": dict(zip(("layers", "hidden", "heads"), dims, strict=True)),
                            "oracle": oracle,
                            "oracle_backend": oracle_backend,
                            "backend": backend,
                            "dtype": name,
                            "panel": panel,
                            **_compare(ours, ref, attention_mask),
                        }
                    )
                    del ours
            del ours_model, ref
            gc.collect()
            for path in Path(tmp).iterdir():  # big checkpoints: never keep both layouts on disk at once
                shutil.rmtree(path)
    return records


# --------------------------------------------------------------------------- conversion only


def check_esm2_conversion_shapes(checkpoint_id: str, manifests_dir: str | Path = MANIFEST_DIR) -> dict[str, object]:
    """Convert the official key/shape layout at real dims without allocating weights; compare with ours.

    Both official layouts are built from meta tensors (only the rotary `inv_freq` buffers are real,
    since the transform checks their values) and converted; each result must have exactly the keys and
    shapes of `ESM2ForMaskedLM(config).state_dict()` built on the meta device.
    """
    _family, checkpoint = esm2_checkpoint(checkpoint_id, manifests_dir)
    layers, hidden, heads = checkpoint.num_layers, checkpoint.hidden_size, checkpoint.num_heads
    spec = hf_esm2_spec(layers, hidden, heads)
    inv_freq = rotary_inv_freq(hidden // heads)
    hf_state = {
        key: inv_freq.clone() if key.endswith("inv_freq") else torch.empty(shape, device="meta")
        for key, shape in spec.items()
    }
    fair_state = {fair_esm2_key(key): value for key, value in hf_state.items()}
    contact = {key: fair_state.pop(key) for key in list(fair_state) if key.startswith("contact_head.")}
    config = ESM2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads)
    with torch.device("meta"):
        expected = {key: tuple(value.shape) for key, value in ESM2ForMaskedLM(config).state_dict().items()}
    problems: list[str] = []
    converted_by = {
        "transformers": from_transformers(hf_state, heads),
        "fair-esm": from_fair_esm(fair_state, heads, contact=contact),
    }
    for layout, converted in converted_by.items():
        got = {key: tuple(value.shape) for key, value in converted.items()}
        problems += [f"{layout}: missing {key}" for key in sorted(expected.keys() - got.keys())]
        problems += [f"{layout}: unexpected {key}" for key in sorted(got.keys() - expected.keys())]
        problems += [
            f"{layout}: {key} has shape {got[key]}, ours {expected[key]}"
            for key in sorted(expected.keys() & got.keys())
            if got[key] != expected[key]
        ]
        problems += [f"{layout}: {key} was materialized" for key, value in converted.items() if not value.is_meta]
    return {
        "kind": "conversion_shapes",
        "checkpoint": checkpoint.id,
        "dims": {"layers": layers, "hidden": hidden, "heads": heads},
        "layouts": sorted(converted_by),
        "keys": len(expected),
        "parameters": sum(math.prod(shape) for shape in expected.values()),
        "ok": not problems,
        "problems": problems,
    }


# =========================================================================== ESMC (ESM++)

ESMC_BACKENDS = ("eager", "sdpa", "flex_attention")
ESMC_ORACLE = "esm (goldens)"
ESMC_GOLDENS = REPO_ROOT / "tests" / "goldens"
# "default": the oracle ran with sequence_id=None (padding derived from <pad>), ours gets the tokenizer's
# attention_mask; "sequence_id": both get the panel's integer chain ids (two chains in one row).
ESMC_MASKS = ("default", "sequence_id")
_ESMC_GOLDEN_PREFIX = {"default": "", "sequence_id": "seqid_"}


def esmc_checkpoint(checkpoint_id: str, manifests_dir: str | Path = MANIFEST_DIR) -> tuple[Family, Checkpoint]:
    family = load_manifest(Path(manifests_dir) / "esmc.toml", resolve=False)
    return family, family.checkpoint(checkpoint_id)


def _esmc_recipe(goldens_dir: str | Path) -> dict:
    return json.loads((Path(goldens_dir) / "esmc_manifest.json").read_text(encoding="utf-8"))


def esmc_golden_models(goldens_dir: str | Path = ESMC_GOLDENS) -> tuple[str, ...]:
    """Checkpoint ids that have committed oracle goldens (the others get the conversion shape check)."""
    return tuple(_esmc_recipe(goldens_dir)["models"])


def _esmc_goldens(checkpoint: Checkpoint, goldens_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(recipe, tensors) of one checkpoint's goldens, after checking their hash, dims and panel."""
    from safetensors.torch import load_file

    recipe = _esmc_recipe(goldens_dir)
    entry = recipe["models"].get(checkpoint.id)
    if entry is None:
        raise ValueError(
            f"no ESMC goldens for {checkpoint.id!r} (have: {', '.join(recipe['models'])}); "
            "use check_esmc_conversion_shapes for it"
        )
    dims = (entry["n_layers"], entry["d_model"], entry["n_heads"])
    if dims != (checkpoint.num_layers, checkpoint.hidden_size, checkpoint.num_heads):
        raise ValueError(f"{checkpoint.id}: goldens were made at dims {dims}, the manifest says otherwise")
    path = Path(goldens_dir) / entry["file"]
    if hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
        raise ValueError(f"{path}: sha256 differs from esmc_manifest.json")
    gold = load_file(str(path))
    panel = esmc_panel()
    if not (torch.equal(gold["input_ids"], panel.input_ids) and torch.equal(gold["sequence_id"], panel.sequence_id)):
        raise ValueError(f"{path}: its panel differs from esmc_panel()")
    return recipe, gold


def _build_esmc(checkpoint: Checkpoint, seed: int) -> ESMCForMaskedLM:
    layers, hidden, heads = checkpoint.num_layers, checkpoint.hidden_size, checkpoint.num_heads
    converted = from_esm(esmc_official_state_dict(layers, hidden, heads, seed=seed))
    config = ESMCConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads)
    with torch.device("meta"):
        model = ESMCForMaskedLM(config)
    # Assigned, not copied: the converted tensors become the parameters (one copy of the weights in memory).
    model.load_state_dict(converted, strict=True, assign=True)
    return model.eval()


@torch.inference_mode()
def _run_esmc(
    model: ESMCForMaskedLM, backend: str, dtype: str, mask: str, panel
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """(logits, hidden states, official-style embeddings) of ours on the panel."""
    model.set_attn_implementation(backend)
    kwargs = {"attention_mask": panel.attention_mask} if mask == "default" else {"sequence_id": panel.sequence_id}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()
    with autocast:
        out = model(panel.input_ids, output_hidden_states=True, **kwargs)
        # The official `embeddings`: the final norm of the last block's output (no second forward).
        embeddings = model.esmc.final_norm(out.hidden_states[-1])
    return out.logits, tuple(out.hidden_states), embeddings


def measure_esmc(
    checkpoint_id: str,
    *,
    backends: Sequence[str] = ESMC_BACKENDS,
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
    hidden-state metrics. `bfloat16` runs ours with FP32 parameters under CPU BF16 autocast against the
    same FP32 goldens. The weights (seed taken from the goldens' recipe) are regenerated here, in the
    official `esm` layout, and converted with `from_esm`.
    """
    family, checkpoint = esmc_checkpoint(checkpoint_id, manifests_dir)
    for backend in backends:
        if backend not in family.backends:
            raise ValueError(f"backend {backend!r} is not declared for ESMC; declared: {', '.join(family.backends)}")
    for mask in masks:
        if mask not in ESMC_MASKS:
            raise ValueError(f"unknown mask {mask!r}; valid: {', '.join(ESMC_MASKS)}")
    dtypes = _dtypes(dtype)
    recipe, gold = _esmc_goldens(checkpoint, goldens_dir)
    seed = int(recipe["seed"])
    panel = esmc_panel()
    valid = panel.attention_mask.bool()
    # Golden entry j is the official block output hidden_state_layers[j]; ours leads with the embeddings.
    compared = [int(i) + 1 for i in gold["hidden_state_layers"]]
    dims = (checkpoint.num_layers, checkpoint.hidden_size, checkpoint.num_heads)
    panel_record = {
        "seed": seed,
        "lengths": [int(n) - 2 for n in panel.attention_mask.sum(-1)],
        "masked": int((panel.input_ids == ESMC_MASK_ID).sum()),
        "chains": [int(row.max()) + 1 for row in panel.sequence_id],
    }
    records: list[dict[str, object]] = []
    model = _build_esmc(checkpoint, seed)
    try:
        for name in dtypes:
            for backend in backends:
                for mask in masks:
                    logits, hidden, embeddings = _run_esmc(model, backend, name, mask, panel)
                    prefix = _ESMC_GOLDEN_PREFIX[mask]
                    ref_logits = gold[prefix + "logits"]
                    report = parity_report(logits, ref_logits, valid, logits=True)
                    # As for ESM2: the confident-position count and the all-position top-1 go with top-1.
                    confident = ref_logits[valid].double().softmax(-1).amax(-1) >= 0.5
                    report["confident_positions"] = int(confident.sum())
                    report["top1_agreement_all"] = top1_agreement(logits, ref_logits, valid, confidence=0.0)
                    ref_embeddings = gold[prefix + "embeddings"]
                    record: dict[str, object] = {
                        "kind": "forward",
                        "checkpoint": checkpoint.id,
                        "dims": dict(zip(("layers", "hidden", "heads"), dims, strict=True)),
                        "oracle": ESMC_ORACLE,
                        "oracle_backend": "native",
                        "backend": backend,
                        "dtype": name,
                        "mask": mask,
                        "panel": panel_record,
                        "logits": report,
                        "embeddings": {
                            "relative_l2": relative_l2(embeddings[valid], ref_embeddings),
                            "max_abs": max_abs(embeddings[valid], ref_embeddings),
                        },
                    }
                    if mask == "default":
                        pairs = [(hidden[i][valid], gold["hidden_states"][j]) for j, i in enumerate(compared)]
                        per_state = [relative_l2(a, b) for a, b in pairs]
                        worst = max(range(len(per_state)), key=lambda k: (math.isnan(per_state[k]), per_state[k]))
                        record["hidden_states"] = {
                            "count": len(hidden),
                            "compared": compared,
                            "worst_relative_l2": per_state[worst],
                            "worst_index": compared[worst],
                            "worst_max_abs": max(max_abs(a, b) for a, b in pairs),
                        }
                    records.append(record)
                    del logits, hidden, embeddings
    finally:
        clear_flex_attention_caches()
        del model
        gc.collect()
    return records


def _biohub_key(key: str) -> str:
    """Official `esm` key -> the Biohub re-release's name for the same tensor (Transformer-Engine modules)."""
    suffixes = {
        "attn.layernorm_qkv.0.weight": "attn.layernorm_qkv.layer_norm_weight",
        "attn.layernorm_qkv.0.bias": "attn.layernorm_qkv.layer_norm_bias",
        "attn.layernorm_qkv.1.weight": "attn.layernorm_qkv.weight",
        "ffn.0.weight": "ffn.layer_norm_weight",
        "ffn.0.bias": "ffn.layer_norm_bias",
        "ffn.1.weight": "ffn.fc1_weight",
        "ffn.3.weight": "ffn.fc2_weight",
    }
    if key.startswith("sequence_head."):
        return "lm_head." + key.removeprefix("sequence_head.")
    if key.startswith("transformer.blocks."):
        _transformer, blocks, layer, rest = key.split(".", 3)
        return f"esmc.transformer.{blocks}.{layer}.{suffixes.get(rest, rest)}"
    return "esmc." + key


def check_esmc_conversion_shapes(checkpoint_id: str, manifests_dir: str | Path = MANIFEST_DIR) -> dict[str, object]:
    """Convert both official ESMC layouts at real dims on the meta device; compare with ours (no weights).

    The `esm` layout is `esmc_official_spec` (the official `ESMC(...).state_dict()`); the Biohub layout is
    the same tensors under Transformer-Engine names, with the weightless `_extra_state` entries it carries.
    Each conversion must give exactly the keys and shapes of `ESMCForMaskedLM(config).state_dict()` built
    on the meta device, without materializing anything.
    """
    _family, checkpoint = esmc_checkpoint(checkpoint_id, manifests_dir)
    layers, hidden, heads = checkpoint.num_layers, checkpoint.hidden_size, checkpoint.num_heads
    esm_state = {
        key: torch.empty(shape, device="meta") for key, shape in esmc_official_spec(layers, hidden, heads).items()
    }
    biohub_state = {_biohub_key(key): value for key, value in esm_state.items()}
    for i in range(layers):
        for module in ("attn.layernorm_qkv", "ffn"):
            biohub_state[f"esmc.transformer.blocks.{i}.{module}._extra_state"] = torch.empty(
                0, dtype=torch.uint8, device="meta"
            )
    config = ESMCConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads)
    with torch.device("meta"):
        expected = {key: tuple(value.shape) for key, value in ESMCForMaskedLM(config).state_dict().items()}
    problems: list[str] = []
    converted_by = {"esm": from_esm(esm_state), "biohub": from_biohub(biohub_state)}
    for layout, converted in converted_by.items():
        got = {key: tuple(value.shape) for key, value in converted.items()}
        problems += [f"{layout}: missing {key}" for key in sorted(expected.keys() - got.keys())]
        problems += [f"{layout}: unexpected {key}" for key in sorted(got.keys() - expected.keys())]
        problems += [
            f"{layout}: {key} has shape {got[key]}, ours {expected[key]}"
            for key in sorted(expected.keys() & got.keys())
            if got[key] != expected[key]
        ]
        problems += [f"{layout}: {key} was materialized" for key, value in converted.items() if not value.is_meta]
    return {
        "kind": "conversion_shapes",
        "checkpoint": checkpoint.id,
        "dims": {"layers": layers, "hidden": hidden, "heads": heads},
        "layouts": sorted(converted_by),
        "keys": len(expected),
        "parameters": sum(math.prod(shape) for shape in expected.values()),
        "ok": not problems,
        "problems": problems,
    }
