"""ESM2 parity against Transformers' `EsmForMaskedLM` and fair-esm's `ESM2`, on seeded weights at real dims.

Weights are the seeded official-layout tensors of `oracles.esm2` at a checkpoint's dims, taken from its
manifest. Ours is converted from each oracle's own files (`from_transformers` / `from_fair_esm`), never
from the other layout, so a passing record proves that conversion as well as the forward. Logits and
hidden states are compared over non-padding tokens (`<cls>` and `<eos>` included, which only makes the
check stricter), contacts over pairs of real residues.
"""

from __future__ import annotations

import gc
import math
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers.initialization import no_init_weights

from ..configuration_esm2 import ESM2Config
from ..convert.common import load_weights
from ..convert.esm2 import from_fair_esm, from_transformers
from ..manifest import MANIFEST_DIR, Checkpoint, Family, load_manifest
from ..modeling_esm2 import RESIDUES, ESM2ForMaskedLM
from ..oracles.esm2 import (
    Outputs,
    fair_esm2_key,
    hf_esm2_spec,
    rotary_inv_freq,
    run_fair_esm,
    run_transformers,
    write_fair_esm_pt,
    write_hf_snapshot,
)
from ..parity.driver import (
    ParityRun,
    check_backends,
    conversion_shapes_record,
    cpu_autocast,
    cpu_backends,
    dims_record,
    dtype_names,
    hidden_states_record,
    logits_record,
    meta_state_shapes,
    package_versions,
)
from ..parity.metrics import max_abs, relative_l2
from ..tokenization_esm import ESM2_VOCAB

__all__ = [
    "ESM2_ORACLES",
    "FORWARD_PARAMETER_LIMIT",
    "PANEL_LENGTHS",
    "check_esm2_conversion_shapes",
    "esm2_checkpoint",
    "esm2_panel",
    "esm2_parameter_count",
    "forward_feasible",
    "measure_esm2",
    "measure_report",
    "versions",
]

PANEL_LENGTHS = (1, 12, 37, 120, 250)
SHORT_PANEL = (1, 12, 37, 120)  # the one short forward of a checkpoint too big for the full run
ESM2_ORACLES = ("transformers", "fair-esm")
# Largest checkpoint whose full parity run (two oracles, three backends, FP32 + BF16) fits a 2-core,
# 24 GB CPU machine in minutes: ESM2-150M. Bigger ones get the conversion shape check instead.
FORWARD_PARAMETER_LIMIT = 200_000_000
_PACKAGES = ("torch", "transformers", "fair-esm", "numpy")

_IDS = {token: i for i, token in enumerate(ESM2_VOCAB)}
CLS_ID, PAD_ID, EOS_ID, MASK_ID = _IDS["<cls>"], _IDS["<pad>"], _IDS["<eos>"], _IDS["<mask>"]
_RESIDUE_IDS = torch.tensor([_IDS[r] for r in RESIDUES])


def esm2_checkpoint(checkpoint_id: str, manifests_dir: str | Path = MANIFEST_DIR) -> tuple[Family, Checkpoint]:
    family = load_manifest(Path(manifests_dir) / "esm2.toml", resolve=False)
    return family, family.checkpoint(checkpoint_id)


def esm2_parameter_count(checkpoint: Checkpoint) -> int:
    """Parameters of the official layout at the checkpoint's dims (rotary buffers excluded)."""
    spec = hf_esm2_spec(*checkpoint.dims)
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
) -> Outputs:
    model.set_attn_implementation(backend)
    with cpu_autocast(dtype):
        out = model(input_ids, attention_mask, output_hidden_states=True)
        if contacts is None:
            contacts = model.predict_contacts(input_ids, attention_mask)
    return Outputs(out.logits, tuple(out.hidden_states), contacts)


def _compare(ours: Outputs, ref: Outputs, attention_mask: torch.Tensor) -> dict[str, object]:
    valid = attention_mask.bool()
    if len(ours.hidden_states) != len(ref.hidden_states):
        raise ValueError(f"ours has {len(ours.hidden_states)} hidden states, the oracle {len(ref.hidden_states)}")
    pairs = [(a[valid], b[valid]) for a, b in zip(ours.hidden_states, ref.hidden_states, strict=True)]
    contact_pairs = _contact_pairs(attention_mask)
    ours_contacts, ref_contacts = ours.contacts[contact_pairs][None], ref.contacts[contact_pairs][None]
    return {
        "logits": logits_record(ours.logits, ref.logits, valid),
        "hidden_states": {"count": len(pairs), **hidden_states_record(pairs, range(len(pairs)))},
        "contacts": {
            "max_abs": max_abs(ours_contacts, ref_contacts),
            "relative_l2": relative_l2(ours_contacts, ref_contacts),
        },
    }


def measure_esm2(
    checkpoint_id: str,
    *,
    backends: Sequence[str] | None = None,
    dtype: str | Sequence[str] = "float32",
    oracles: Sequence[str] = ESM2_ORACLES,
    seed: int = 0,
    lengths: Sequence[int] = PANEL_LENGTHS,
    manifests_dir: str | Path = MANIFEST_DIR,
) -> list[dict[str, object]]:
    """One record per (oracle, backend, dtype): ours vs the FP32 oracle on `esm2_panel(seed, lengths)`.

    `backends` defaults to every declared CPU backend. `dtype` is one name or several. `bfloat16` runs
    ours with FP32 parameters under CPU BF16 autocast (the family's declared policy) and compares it with
    the same FP32 oracle outputs. Contacts always run eager attention (they are built from attention
    maps), in ours and in both oracles, so they are the same for every backend of one (oracle, dtype).
    """
    family, checkpoint = esm2_checkpoint(checkpoint_id, manifests_dir)
    for oracle in oracles:
        if oracle not in ESM2_ORACLES:
            raise ValueError(f"unknown oracle {oracle!r}; valid: {', '.join(ESM2_ORACLES)}")
    backends = cpu_backends(family) if backends is None else tuple(backends)
    check_backends(backends, family.backends, family.name)
    dtypes = dtype_names(dtype)
    input_ids, attention_mask = esm2_panel(seed, lengths)
    panel = {"seed": seed, "lengths": list(lengths), "masked": int((input_ids == MASK_ID).sum())}
    records: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="fastplms-parity-") as tmp:
        for oracle in oracles:
            if oracle == "transformers":
                snapshot = write_hf_snapshot(Path(tmp) / "hf", *checkpoint.dims, seed=seed)
                ref = run_transformers(snapshot, input_ids, attention_mask)
                # The very bytes the oracle loaded, converted by our Transformers-layout transform.
                state = load_weights(snapshot / "model.safetensors")
                converted = from_transformers(state, checkpoint.num_heads)
                oracle_backend = "eager"
            else:
                checkpoint_pt = write_fair_esm_pt(Path(tmp) / "fair", *checkpoint.dims, seed=seed)
                # fair-esm derives padding from the <pad> id itself; the panel is right-padded with it.
                ref = run_fair_esm(checkpoint_pt, input_ids, checkpoint.num_layers)
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
                            "dims": dims_record(checkpoint),
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
    layers, hidden, heads = checkpoint.dims
    inv_freq = rotary_inv_freq(hidden // heads)
    hf_state = {
        key: inv_freq.clone() if key.endswith("inv_freq") else torch.empty(shape, device="meta")
        for key, shape in hf_esm2_spec(layers, hidden, heads).items()
    }
    fair_state = {fair_esm2_key(key): value for key, value in hf_state.items()}
    contact = {key: fair_state.pop(key) for key in list(fair_state) if key.startswith("contact_head.")}
    config = ESM2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads)
    converted_by = {
        "transformers": from_transformers(hf_state, heads),
        "fair-esm": from_fair_esm(fair_state, heads, contact=contact),
    }
    return conversion_shapes_record(checkpoint, meta_state_shapes(ESM2ForMaskedLM, config), converted_by)


# --------------------------------------------------------------------------- the report


def versions() -> dict[str, str]:
    return package_versions(_PACKAGES)


def measure_report(run: ParityRun) -> None:
    """The ESM2 report: per chosen checkpoint (default: every one whose forward fits this machine) FP32 on
    every CPU backend against both oracles and BF16 autocast on SDPA against Transformers; `large_forward`
    adds one short FP32 SDPA run against Transformers; every other checkpoint gets the conversion check."""
    family = load_manifest(MANIFEST_DIR / "esm2.toml", resolve=False)
    known = [c.id for c in family.checkpoints]
    chosen = list(run.checkpoints) or [c.id for c in family.checkpoints if forward_feasible(c)]
    large = list(run.large_forward)
    for checkpoint in chosen + large:
        if checkpoint not in known:
            raise SystemExit(f"unknown ESM2 checkpoint {checkpoint!r}; known: {', '.join(known)}")
    backends = list(cpu_backends(family))

    for checkpoint in chosen:
        run.log(f"{checkpoint}: FP32, backends {backends}, oracles {list(ESM2_ORACLES)}")
        run.records += measure_esm2(checkpoint, backends=backends, dtype="float32", seed=run.seed)
        run.save()
        run.log(f"{checkpoint}: BF16 autocast, sdpa, transformers")
        run.records += measure_esm2(
            checkpoint, backends=("sdpa",), dtype="bfloat16", oracles=("transformers",), seed=run.seed
        )
        run.save()

    for checkpoint in family.checkpoints:
        if checkpoint.id in chosen:
            continue
        run.log(f"{checkpoint.id}: conversion shape check")
        run.records.append(check_esm2_conversion_shapes(checkpoint.id))
        run.save()

    for checkpoint in large:
        run.log(f"{checkpoint}: short FP32 forward, sdpa, transformers, lengths {list(SHORT_PANEL)}")
        run.records += measure_esm2(
            checkpoint, backends=("sdpa",), oracles=("transformers",), lengths=SHORT_PANEL, seed=run.seed
        )
        run.notes.append(
            f"{checkpoint}: one short real-dim forward only (FP32, sdpa, Transformers oracle, "
            f"residue lengths {list(SHORT_PANEL)}), plus the conversion shape check."
        )
        run.save()

    for checkpoint in family.checkpoints:
        if checkpoint.id not in chosen and checkpoint.id not in large:
            gb = esm2_parameter_count(checkpoint) * 4 / 1e9
            run.notes.append(
                f"{checkpoint.id}: forward not run ({gb:.1f} GB of FP32 weights per copy; the oracle, its "
                "weights and ours do not fit this machine's memory and time); conversion shape check only."
            )
    run.notes.append(
        "Contacts are built from attention maps, so every implementation computes them with eager "
        "attention; contact numbers are therefore the same for every backend of one oracle and dtype."
    )
    run.notes.append(
        "Logits and hidden-state metrics cover all non-padding tokens (<cls> and <eos> included); "
        "contacts cover pairs of real residues. BF16 rows: ours under CPU BF16 autocast with FP32 "
        "parameters vs the FP32 oracle."
    )
    run.notes.append(
        "top1_agreement counts only positions where the oracle puts p >= 0.5 on its top token "
        "(confident_positions says how many); seeded weights give few or none, so top1_agreement_all "
        "(argmax agreement over every valid position) is reported beside it."
    )
