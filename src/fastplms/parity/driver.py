"""The family-neutral half of parity measurement: the run a family fills, and the records it is made of.

Each family measures itself (`families/<architecture>_parity.py`, reached through its adapter) against
its own oracles; every record it writes is assembled here, so that `tools/measure_parity.py`, the tests
and the generated docs read one shape. Metrics come from `parity.metrics`, always over valid positions.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..attention import FLASH_BACKENDS
from ..manifest import Checkpoint, Family
from .metrics import max_abs, parity_report, relative_l2, top1_agreement

DTYPES = ("float32", "bfloat16")
# Probability the oracle must put on its top token for `top1_agreement` to count the position.
CONFIDENT = 0.5


@dataclass
class ParityRun:
    """One `python -m tools.measure_parity <family>` run: what was asked, and the report it fills."""

    checkpoints: tuple[str, ...]  # empty: the family's default choice
    large_forward: tuple[str, ...]  # checkpoints for one short forward beyond the default set
    seed: int
    save: Callable[[], None]  # writes the report so far (a long run keeps its progress)
    log: Callable[[str], None]
    records: list[dict[str, object]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def dtype_names(dtype: str | Iterable[str]) -> tuple[str, ...]:
    """One dtype name or several, each checked."""
    dtypes = (dtype,) if isinstance(dtype, str) else tuple(dtype)
    for name in dtypes:
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; measured dtypes: {', '.join(DTYPES)}")
    return dtypes


def cpu_autocast(dtype: str) -> contextlib.AbstractContextManager:
    """The BF16 policy parity measures: FP32 parameters under CPU BF16 autocast."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()


def cpu_backends(family: Family) -> tuple[str, ...]:
    """The family's declared backends that run on CPU: every one but the flash kernels (CUDA only)."""
    return tuple(b for b in family.backends if b not in FLASH_BACKENDS)


def check_backends(backends: Sequence[str], declared: Sequence[str], family_name: str) -> None:
    for backend in backends:
        if backend not in declared:
            raise ValueError(f"backend {backend!r} is not declared for {family_name}; declared: {', '.join(declared)}")


def golden_checkpoints(run: ParityRun, family: Family, golden: Sequence[str]) -> list[str]:
    """The checkpoints a goldens-based report measures: those asked for (default: every one with goldens),
    each checked to exist and to have goldens; such a report has no `--large-forward`."""
    known = [c.id for c in family.checkpoints]
    chosen = list(run.checkpoints) or [c for c in known if c in golden]
    for checkpoint in chosen:
        if checkpoint not in known:
            raise SystemExit(f"unknown {family.name} checkpoint {checkpoint!r}; known: {', '.join(known)}")
        if checkpoint not in golden:
            raise SystemExit(f"no oracle goldens for {checkpoint!r}; have: {', '.join(golden)}")
    if run.large_forward:
        raise SystemExit(f"--large-forward does not apply to {family.name}, whose forwards are measured on goldens")
    return chosen


def package_versions(packages: Iterable[str]) -> dict[str, str]:
    """Installed version of each package ("not installed" where absent), for a report's `versions`."""
    from importlib import metadata

    found = {}
    for package in packages:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def dims_record(checkpoint: Checkpoint) -> dict[str, int]:
    return dict(zip(("layers", "hidden", "heads"), checkpoint.dims, strict=True))


def logits_record(ours: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor) -> dict[str, object]:
    """`parity_report` of the logits, with the confident-position count and the all-position top-1.

    `top1_agreement` counts only positions where the oracle is confident; seeded weights give few or none,
    which makes it vacuously 1.0, so the count and the argmax agreement over every position go with it.
    """
    report = parity_report(ours, ref, valid, logits=True)
    report["confident_positions"] = int((ref[valid].double().softmax(-1).amax(-1) >= CONFIDENT).sum())
    report["top1_agreement_all"] = top1_agreement(ours, ref, valid, confidence=0.0)
    return report


def hidden_states_record(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], indices: Sequence[int]) -> dict:
    """The worst of the (ours, oracle) hidden-state pairs, already restricted to valid positions."""
    per_state = [relative_l2(a, b) for a, b in pairs]
    # NaN ranks worst, so a broken state is the one reported.
    worst = max(range(len(per_state)), key=lambda i: (math.isnan(per_state[i]), per_state[i]))
    return {
        "worst_relative_l2": per_state[worst],
        "worst_index": indices[worst],
        "worst_max_abs": max(max_abs(a, b) for a, b in pairs),
    }


def conversion_shapes_record(
    checkpoint: Checkpoint,
    expected: Mapping[str, tuple[int, ...]],
    converted_by: Mapping[str, Mapping[str, torch.Tensor]],
) -> dict[str, object]:
    """Compare each official layout's conversion (meta tensors) with our state-dict layout `expected`."""
    problems: list[str] = []
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
        "dims": dims_record(checkpoint),
        "layouts": sorted(converted_by),
        "keys": len(expected),
        "parameters": sum(math.prod(shape) for shape in expected.values()),
        "ok": not problems,
        "problems": problems,
    }


def meta_state_shapes(model_class: type[torch.nn.Module], config: object) -> dict[str, tuple[int, ...]]:
    """Key -> shape of `model_class(config).state_dict()`, built on the meta device (no memory)."""
    with torch.device("meta"):
        return {key: tuple(value.shape) for key, value in model_class(config).state_dict().items()}


def generation_record(checkpoint: str, case: str, strategy: str, steps: int, ours, official) -> dict[str, object]:
    """One seeded generation run against the official sampler's tokens (tensors of one shape, or not)."""
    same_shape = tuple(ours.shape) == tuple(official.shape)
    return {
        "kind": "generation",
        "checkpoint": checkpoint,
        "case": case,
        "sampling_strategy": strategy,
        "max_iter": steps,
        "shape": list(official.shape),
        "tokens_equal": int((ours == official).sum()) if same_shape else 0,
        "tokens": official.numel(),
        "identical": same_shape and bool((ours == official).all()),
    }
