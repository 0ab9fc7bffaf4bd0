"""Golden outputs of the official ESMC (EvolutionaryScale ``esm``) on seeded weights at real dims.

Run in the oracle venv only (``tools/goldens/setup_esmc_venv.sh``), from the repository root::

    .venv-esmc/bin/python -m tools.goldens.esmc --out tests/goldens/
    .venv-esmc/bin/python -m tools.goldens.esmc --out tests/goldens/ --check   # bit-for-bit re-run

For each of esmc_300m / esmc_600m it builds ``esm.models.esmc.ESMC`` with the official constructor
(``use_flash_attn=False``), loads ``fastplms.oracles.esmc.esmc_official_state_dict`` strictly, and runs
``fastplms.oracles.esmc.esmc_panel()`` in FP32 on CPU, once with ``sequence_id=None`` (mask derived from
padding) and once with the panel's explicit integer ``sequence_id`` (chains of the multi-chain row kept apart).
File layout: ``tools/goldens/README.md``. Only the outputs are committed, never the ``esm`` code.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

from tools.goldens.check import check_against_committed

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE_PATH = REPO_ROOT / "src" / "fastplms" / "oracles" / "esmc.py"
MANIFEST_LOADER_PATH = REPO_ROOT / "src" / "fastplms" / "manifest" / "loader.py"
MODELS = ("esmc_300m", "esmc_600m")
SEED = 0
THREADS = 1  # fixed: GEMM reduction order can depend on the thread count
MANIFEST = "esmc_manifest.json"


def _load_by_path(name: str, path: Path):
    # fastplms is not installed in the oracle venv; these two modules import nothing of it.
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_reference():
    """``fastplms.oracles.esmc`` loaded by file path."""
    return _load_by_path("_fastplms_esmc_reference_by_path", REFERENCE_PATH)


def model_dims(name: str) -> tuple[int, int, int]:
    """(n_layers, d_model, n_heads) of checkpoint ``name``, as ``manifests/esmc.toml`` states them."""
    loader = _load_by_path("_fastplms_manifest_loader_by_path", MANIFEST_LOADER_PATH)
    return loader.load_manifest(REPO_ROOT / "manifests" / "esmc.toml", resolve=False).checkpoint(name).dims


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hidden_layers(n_layers: int) -> list[int]:
    """Indices into the official ``hidden_states`` stack that the goldens keep: first, middle, last."""
    return [0, n_layers // 2, n_layers - 1]


def build_official(n_layers: int, d_model: int, n_heads: int):
    from esm.models.esmc import ESMC
    from esm.tokenization import EsmSequenceTokenizer

    model = ESMC(
        d_model=d_model, n_heads=n_heads, n_layers=n_layers, tokenizer=EsmSequenceTokenizer(), use_flash_attn=False
    )
    assert not model._use_flash_attn
    return model


def run_model(name: str, ref, torch) -> tuple[dict, dict]:
    """Returns (tensors to save, facts for the manifest)."""
    n_layers, d_model, n_heads = model_dims(name)
    panel = ref.esmc_panel()
    facts: dict = {}

    t0 = time.perf_counter()
    torch.manual_seed(SEED)  # the official init is overwritten by the strict load; seeded for tidiness only
    model = build_official(n_layers, d_model, n_heads)
    official_spec = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected_spec = ref.esmc_official_spec(n_layers, d_model, n_heads)
    if list(official_spec.items()) != list(expected_spec.items()):
        raise SystemExit(f"{name}: esmc_official_spec disagrees with the official ESMC state_dict layout")
    state = ref.esmc_official_state_dict(n_layers, d_model, n_heads, seed=SEED)
    model.load_state_dict(state, strict=True)
    del state
    model.eval()
    facts["build_seconds"] = round(time.perf_counter() - t0, 2)

    # The panel's ids must be exactly what the official tokenizer and batching produce.
    official_ids = model._tokenize(panel.sequences)
    if not torch.equal(official_ids, panel.input_ids):
        raise SystemExit(f"{name}: esmc_panel().input_ids differ from the official tokenizer's batch")

    t0 = time.perf_counter()
    with torch.inference_mode():
        out_a = model(sequence_tokens=panel.input_ids)
        out_b = model(sequence_tokens=panel.input_ids, sequence_id=panel.sequence_id)
        again = model(sequence_tokens=panel.input_ids)
    facts["forward_seconds"] = round(time.perf_counter() - t0, 2)
    facts["in_process_rerun_bitwise_equal"] = bool(
        torch.equal(again.sequence_logits, out_a.sequence_logits)
        and torch.equal(again.embeddings, out_a.embeddings)
        and torch.equal(again.hidden_states, out_a.hidden_states)
    )
    # Rows without a chain break have the same mask pattern in both variants.
    single = [b for b in range(panel.input_ids.shape[0]) if not (panel.input_ids[b] == ref.CHAIN_BREAK_ID).any()]
    facts["single_chain_rows"] = single
    facts["single_chain_rows_bitwise_equal_across_variants"] = bool(
        torch.equal(out_a.sequence_logits[single], out_b.sequence_logits[single])
        and torch.equal(out_a.embeddings[single], out_b.embeddings[single])
    )
    facts["hidden_states_count"] = int(out_a.hidden_states.shape[0])
    if not facts["in_process_rerun_bitwise_equal"]:
        raise SystemExit(f"{name}: the official forward is not deterministic in-process")

    valid = panel.attention_mask.bool()
    layers = hidden_layers(n_layers)
    tensors = {
        "input_ids": panel.input_ids,
        "attention_mask": panel.attention_mask,
        "sequence_id": panel.sequence_id,
        "hidden_state_layers": torch.tensor(layers, dtype=torch.int64),
        "logits": out_a.sequence_logits,
        "embeddings": out_a.embeddings[valid],
        "hidden_states": out_a.hidden_states[layers][:, valid],
        "seqid_logits": out_b.sequence_logits,
        "seqid_embeddings": out_b.embeddings[valid],
    }
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    for key, value in tensors.items():
        if value.is_floating_point():
            assert value.dtype == torch.float32 and torch.isfinite(value).all(), key
    facts["logits_std"] = float(out_a.sequence_logits[valid].std())
    facts["embeddings_std"] = float(out_a.embeddings[valid].std())
    del model, out_a, out_b, again
    return tensors, facts


def generate(out_dir: Path, models: tuple[str, ...]) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    import esm
    import numpy as np
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    ref = load_reference()
    out_dir.mkdir(parents=True, exist_ok=True)
    panel = ref.esmc_panel()

    start = time.perf_counter()
    versions = {
        "esm": importlib.metadata.version("esm"),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "safetensors": importlib.metadata.version("safetensors"),
        "python": platform.python_version(),
    }
    del esm
    manifest: dict = {
        "recipe": "tools/goldens/esmc.py",
        "command": ".venv-esmc/bin/python -m tools.goldens.esmc --out tests/goldens/",
        "oracle": "esm.models.esmc.ESMC(d_model, n_heads, n_layers, tokenizer=EsmSequenceTokenizer(), "
        "use_flash_attn=False), strict load_state_dict, eval, FP32 CPU",
        "weights": "fastplms.oracles.esmc.esmc_official_state_dict(n_layers, d_model, n_heads, seed)",
        "seed": SEED,
        "threads": THREADS,
        "deterministic_algorithms": True,
        "versions": versions,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "panel": {
            "sequences": panel.sequences,
            "input_ids": panel.input_ids.tolist(),
            "sequence_id": panel.sequence_id.tolist(),
        },
        "layout": {
            "input_ids": "(B, S) int64, official token ids, right-padded with <pad>=1",
            "attention_mask": "(B, S) int64, input_ids != 1",
            "sequence_id": "(B, S) int64, chain index per real token, -1 on padding (input of the seqid_* run)",
            "hidden_state_layers": "(3,) int64, indices into the official hidden_states stack "
            "(entry i = output of block i, before the final norm)",
            "logits": "(B, S, 64) float32, sequence_logits of the run with sequence_id=None, all positions",
            "embeddings": "(N, d_model) float32, final-normed embeddings at valid positions "
            "(x[attention_mask.bool()], row-major), run with sequence_id=None",
            "hidden_states": "(3, N, d_model) float32, hidden_states[hidden_state_layers] at valid positions, "
            "run with sequence_id=None",
            "seqid_logits": "(B, S, 64) float32, run with sequence_id=<sequence_id>",
            "seqid_embeddings": "(N, d_model) float32, run with sequence_id=<sequence_id>, valid positions",
        },
        "models": {},
    }
    for name in models:
        n_layers, d_model, n_heads = model_dims(name)
        t0 = time.perf_counter()
        tensors, facts = run_model(name, ref, torch)
        path = out_dir / f"{name}.safetensors"
        # One metadata entry only: safetensors keeps metadata in a hash map and writes several keys in a
        # random order, which would break the bit-for-bit file hashes.
        info = {"model": name, "seed": SEED, "esm": versions["esm"], "torch": versions["torch"]}
        metadata = {"esmc_golden": json.dumps(info, sort_keys=True)}
        save_file(tensors, str(path), metadata=metadata)
        manifest["models"][name] = {
            "file": path.name,
            "sha256": sha256(path),
            "bytes": path.stat().st_size,
            "n_layers": n_layers,
            "d_model": d_model,
            "n_heads": n_heads,
            "ffn_hidden": ref.esmc_ffn_hidden(d_model),
            "hidden_state_layers": hidden_layers(n_layers),
            "wall_seconds": round(time.perf_counter() - t0, 2),
            **facts,
        }
        print(f"{name}: {path} sha256={manifest['models'][name]['sha256']} {manifest['models'][name]['wall_seconds']}s")
    manifest["wall_seconds_total"] = round(time.perf_counter() - start, 2)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "goldens")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--check", action="store_true", help="regenerate into a temporary folder and compare to --out's manifest"
    )
    args = parser.parse_args(argv)
    models = tuple(args.models)
    if not args.check:
        manifest = generate(args.out, models)
        if set(models) != set(MODELS):
            # Keep the other models' entries when only some were regenerated.
            old_path = args.out / MANIFEST
            if old_path.exists():
                old = json.loads(old_path.read_text())
                manifest["models"] = {**old.get("models", {}), **manifest["models"]}
        (args.out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return 0
    return check_against_committed(args.out / MANIFEST, models, lambda folder: generate(folder, models))


if __name__ == "__main__":
    sys.exit(main())
