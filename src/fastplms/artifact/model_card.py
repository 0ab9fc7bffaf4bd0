"""Model cards (README.md of an artifact), generated from the manifest and measured parity."""

from __future__ import annotations

import json
from collections.abc import Mapping

from ..manifest import REPO_ROOT, Checkpoint, Family

PARITY_DIR = REPO_ROOT / "reports" / "parity"


def parity_records(family_id: str, checkpoint_id: str) -> list[dict]:
    """Measured parity records of one checkpoint (empty when none were measured)."""
    path = PARITY_DIR / f"{family_id}.json"
    if not path.is_file():
        return []
    report = json.loads(path.read_text())
    return [r for r in report.get("records", []) if r.get("checkpoint") == checkpoint_id]


def _fmt(value: object) -> str:
    return f"{value:.2e}" if isinstance(value, float) else ("—" if value is None else str(value))


def _parity_section(family: Family, checkpoint: Checkpoint) -> str:
    records = parity_records(family.id, checkpoint.id)
    measured = [r for r in records if "logits" in r]
    if not measured:
        return (
            "No forward parity was measured at these dimensions (conversion key and shape checks only); "
            f"see the measured {family.name} checkpoints in the fastplms support matrix.\n"
        )
    # Optional columns (e.g. ESMC's mask variant and embeddings) show only when some record has them.
    with_mask = any("mask" in r for r in measured)
    with_embeddings = any("embeddings" in r for r in measured)
    header = ["oracle", "backend", "dtype"] + (["mask"] if with_mask else [])
    header += ["logits rel. L2", "logits max abs", "worst hidden-state rel. L2"]
    header += ["embeddings rel. L2"] if with_embeddings else []
    where = "every position, padding included" if all("positions" in r for r in measured) else "valid residues"
    lines = [
        "Measured against the official implementation on seeded weights at this checkpoint's real "
        f"dimensions, over {where} (`python -m tools.measure_parity`):\n",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    order = {"default": 0}
    for r in sorted(measured, key=lambda r: (r["oracle"], r["dtype"], r["backend"], order.get(r.get("mask"), 1))):
        logits = r["logits"]
        hidden = r.get("hidden_states") or {}
        cells = [r["oracle"], f"`{r['backend']}`", r["dtype"]] + ([r.get("mask", "—")] if with_mask else [])
        cells += [_fmt(logits.get("relative_l2")), _fmt(logits.get("max_abs")), _fmt(hidden.get("worst_relative_l2"))]
        cells += [_fmt((r.get("embeddings") or {}).get("relative_l2"))] if with_embeddings else []
        lines.append("| " + " | ".join(cells) + " |")
    generation = [r for r in records if r.get("kind") == "generation"]
    if generation:
        same = sum(bool(r.get("identical")) for r in generation)
        lines.append(
            f"\nGeneration: {same} of {len(generation)} seeded runs of the official sampler reproduced token "
            f"for token on CPU ({', '.join(sorted({r['sampling_strategy'] for r in generation}))})."
        )
    return "\n".join(lines) + "\n"


# Hub license identifiers we may name directly; anything else is "other" with its name spelled out.
_HUB_LICENSES = {"mit": "mit", "apache-2.0": "apache-2.0", "apache 2.0": "apache-2.0", "cc-by-4.0": "cc-by-4.0"}


def _license_metadata(name: str) -> str:
    known = _HUB_LICENSES.get(name.strip().lower())
    if known is not None:
        return f"license: {known}"
    slug = "-".join(name.lower().split())
    return f"license: other\nlicense_name: {slug}"


def render_model_card(family: Family, checkpoint: Checkpoint, provenance: Mapping[str, object], usage: str) -> str:
    """The artifact's README.md; `usage` is the family adapter's example (a Python snippet)."""
    source = provenance["source"]
    origin = source["repo"] or source["file"]
    official = provenance["official_weights"]
    warning = (
        ""
        if official
        else (
            "> **These weights are not the pinned official ones.** The snapshot's files differ from the hashes "
            f"recorded for `{origin}` ({', '.join(provenance['unpinned_files']) or 'no pinned hashes'}); "
            "they may be a fine-tune, a test snapshot or random weights.\n\n"
        )
    )
    # A source may publish the same weights under its own license (e.g. Biohub's MIT re-release of ESMC).
    license_name = source.get("license") or checkpoint.license
    license_meta = _license_metadata(license_name)
    # The checkpoint's own license text lives at its link (Hub cards pair `license: other` with `license_link`).
    if checkpoint.license_link and license_meta.startswith("license: other") and license_name == checkpoint.license:
        license_meta += f"\nlicense_link: {checkpoint.license_link}"
    backends = ", ".join(f"`{b}`" for b in family.backends)
    autos = "\n".join(f"| `{name}` | `{target}` |" for name, target in family.auto_classes.items())
    return f"""---
{license_meta}
library_name: transformers
tags: [protein, protein-language-model, fastplms, {family.id}]
---

# {checkpoint.published}

{warning}{family.description}

This repository is the fastplms build of `{checkpoint.id}` ({checkpoint.num_layers} layers, hidden size
{checkpoint.hidden_size}, {checkpoint.num_heads} attention heads), converted from `{origin}`
(revision `{source["revision"] or "n/a"}`) with transform `{provenance["transform"]}` by {provenance["builder"]}.
License: {license_name}. Official implementation: `{family.upstream.repo}`.

## Use

```python
{usage.strip()}
```

## Attention backends

Declared: {backends}. Any other name raises. `output_attentions=True` runs eager for that call with
one warning. FlashAttention needs CUDA and BF16 (FP32 parameters under `torch.autocast("cuda",
dtype=torch.bfloat16)`) and the pinned kernels in `kernels.lock` (`pip install "kernels>=0.15.2,<0.16"`,
then `kernels download .` in a clone of this repository to bake them into an image).
Dtypes: {", ".join(family.dtypes)} (BF16 policy: `{family.bf16}`).

## Parity

{_parity_section(family, checkpoint)}
## AutoClasses

| AutoClass | class |
|---|---|
{autos}

## Citation

```bibtex
{family.citation.strip()}
```
"""
