"""The README's main job: embed examples/proteins.fasta with a model artifact and plot the result.

Offline (as on a fresh machine here), the default model is a demonstration artifact that the real
builder makes from a seeded, official-layout ESM2-8M snapshot: its weights are random, so the plots
show the pipeline working, not biology. Point --model at an artifact built from a real checkpoint
(`fastplms build esm2_8m --snapshot <facebook/esm2_t6_8M_UR50D download>`) or at a Hub id.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..manifest import REPO_ROOT, find_checkpoint

DEMO_ARTIFACT = REPO_ROOT / "dist" / "hub" / "ESM2-8M-demo"
EXAMPLE_FASTA = REPO_ROOT / "examples" / "proteins.fasta"


def demo_artifact(path: Path = DEMO_ARTIFACT) -> Path:
    """Build (once, and again after a runtime code change) the demo artifact from a seeded ESM2-8M snapshot."""
    import tempfile

    from ..artifact.build import PROVENANCE, RUNTIME_DIR, build
    from ..oracles.esm2 import write_hf_snapshot

    # Reused only while its runtime modules match this checkout's: after a code change the demo
    # must run the current code, not a stale copy built earlier.
    if (path / PROVENANCE).is_file() and all(
        (RUNTIME_DIR / module.name).is_file() and (RUNTIME_DIR / module.name).read_bytes() == module.read_bytes()
        for module in path.glob("*.py")
    ):
        return path
    with tempfile.TemporaryDirectory() as tmp:
        _family, checkpoint = find_checkpoint("esm2_8m")
        snapshot = write_hf_snapshot(Path(tmp) / "esm2_t6_8M_UR50D", *checkpoint.dims, seed=0)
        return build("esm2_8m", snapshot, path, allow_unpinned=True)


def _plots(model_dir: str, database: Path, out: Path, note: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from ..embedding import read_embeddings

    result = read_embeddings(database)
    pooled = result.stack()
    centered = pooled - pooled.mean(0)
    _, _, v = torch.linalg.svd(centered, full_matrices=False)
    xy = centered @ v[:2].T
    fig, ax = plt.subplots(figsize=(7, 6))
    ax.scatter(xy[:, 0], xy[:, 1], s=18)
    for (x, y), name in zip(xy.tolist(), result.ids, strict=True):
        ax.annotate(name, (x, y), fontsize=6, alpha=0.8)
    ax.set(title=f"PCA of mean-pooled embeddings ({len(result.ids)} proteins){note}", xlabel="PC1", ylabel="PC2")
    pca = out / "pca.png"
    fig.savefig(pca, dpi=120, bbox_inches="tight")
    plt.close(fig)

    record = min(result.records, key=lambda r: abs(len(r.sequence) - 150))
    model = AutoModelForMaskedLM.from_pretrained(model_dir, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    batch = tokenizer([record.sequence], return_tensors="pt")
    with torch.no_grad():
        contacts = model.predict_contacts(batch["input_ids"], batch["attention_mask"])[0]
    fig, ax = plt.subplots(figsize=(6, 6))
    ax.imshow(contacts, cmap="Blues", origin="upper")
    ax.set(
        title=f"Predicted contacts: {record.id} ({len(record.sequence)} residues)", xlabel="residue", ylabel="residue"
    )
    contact_png = out / "contacts.png"
    fig.savefig(contact_png, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return [pca, contact_png]


def main(argv: list[str] | None = None) -> int:
    from . import main as cli_main

    parser = argparse.ArgumentParser(prog="python -m fastplms.cli.demo", description=__doc__)
    parser.add_argument("--model", default=None, help="artifact directory or Hub id (default: demo artifact)")
    parser.add_argument("--input", default=str(EXAMPLE_FASTA))
    parser.add_argument("--out", default=str(REPO_ROOT / "out" / "demo"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        model = str(demo_artifact())
        print(
            f"Using the demonstration artifact {model}: built by the real builder from a seeded ESM2-8M "
            "snapshot, so its WEIGHTS ARE RANDOM. For real embeddings pass --model <artifact dir | Hub id>, "
            "e.g. an artifact built with `fastplms build esm2_8m --snapshot <facebook/esm2_t6_8M_UR50D copy>`.\n"
        )
    database = out / "embeddings.db"
    code = cli_main(
        ["embed", args.input, "--model", model, "--out", str(database), "--pooling", "mean,max", "--overwrite"]
    )
    if code:
        return code
    note = "\n(demo artifact: random weights)" if args.model is None else ""
    for path in _plots(model, database, out, note):
        print(f"plot         {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
