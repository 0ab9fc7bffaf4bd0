"""The ESMC (ESM++) side of `python -m benchmarks.embed --model esmc_300m`: ours against the official code.

The alternative a user would otherwise run is EvolutionaryScale's `esm` package (`esm.models.esmc.ESMC`).
It cannot share the main venv, so its cases run in the oracle venv of `tools/goldens/setup_esmc_venv.sh`
(`.venv-esmc`, set up on first use), through the same child entry point as every other case. Both sides
load the same seeded weights: the official state dict written as the `.pth` file of the esm snapshot
layout, which is also what our artifact is built from. There is no Transformers or fair-esm ESMC, and
esm-cpp runs ESM2 only, so an ESMC run compares fastplms with the official model alone.

Not a runtime module: it may import anything the dev environment has.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.venvs import side_venv

REPO = Path(__file__).resolve().parent.parent
ORACLE_PYTHON = REPO / ".venv-esmc" / "bin" / "python"
ORACLE_SETUP = REPO / "tools" / "goldens" / "setup_esmc_venv.sh"
OFFICIAL_BUDGETS = (2048, 4096)


def esmc_flops(lengths: list[int], layers: int, hidden: int) -> float:
    """Matmul FLOPs of an unpadded ESMC encoder forward (no sequence head) over sequences of these lengths.

    Per sequence of L residues (T = L + 2 tokens): T * 2 * P + layers * 4 * hidden * T^2, where
    P = layers * (4 * hidden^2 + 3 * hidden * F) are the bias-free fused QKV, output projection and SwiGLU
    weights (F = 8/3 * hidden rounded up to a multiple of 256) and the second term is Q K^T plus P V.
    """
    from fastplms.oracles.esmc import esmc_ffn_hidden

    params = layers * (4 * hidden * hidden + 3 * hidden * esmc_ffn_hidden(hidden))
    return float(sum((n + 2) * 2 * params + layers * 4 * hidden * (n + 2) ** 2 for n in lengths))


FLOPS_FORMULA = (
    "per sequence of L residues, T = L + 2 tokens: T * 2 * P + layers * 4 * hidden * T^2, "
    "P = layers * (4 * hidden^2 + 3 * hidden * F), F = 8/3 * hidden rounded up to 256; divided by the residues"
)


def prepare_esmc_assets(model: str, seed: int, root: Path, artifact: Path) -> dict[str, str]:
    """The seeded official state dict as an esm-layout snapshot, and our artifact built from it."""
    import torch

    from fastplms.artifact.build import build
    from fastplms.manifest import find_checkpoint
    from fastplms.oracles.esmc import esmc_official_state_dict

    _family, checkpoint = find_checkpoint(model)
    source = next(s for s in checkpoint.sources if s.kind == "esm")
    snapshot = root / "esm"
    weights = snapshot / source.file
    if not weights.exists():
        weights.parent.mkdir(parents=True, exist_ok=True)
        tmp = weights.with_suffix(".tmp")
        torch.save(esmc_official_state_dict(*checkpoint.dims, seed=seed), tmp)
        tmp.replace(weights)
    if not (artifact / "provenance.json").exists():
        build(model, snapshot, artifact, allow_unpinned=True, force=True)
    return {"official": str(weights), "ours": str(artifact)}


def oracle_status() -> dict:
    """Set up .venv-esmc if missing; a structured 'unavailable' with the exact error if that fails."""
    probe = "import importlib.metadata as m; print(m.version('esm'))"
    status = side_venv(ORACLE_PYTHON, ORACLE_SETUP, probe, setup_timeout=1800)
    if status["available"]:
        return {"available": True, "version": status["stdout"]}
    return status


def esmc_cases(args, oracle: dict) -> list[dict]:
    """fastplms (default and each CPU backend) and the official ESMC length-sorted at each budget."""
    gpu = args.device.startswith("cuda")
    dtypes = ("bfloat16",) if gpu else ("float32", "bfloat16")
    backends = ("default", "flex_attention") if gpu else ("default", "eager", "flex_attention")
    if args.quick:
        backends, dtypes = ("default",), ("float32",)
    cases = [
        {"engine": "ours", "label": f"fastplms {backend}", "backend": backend, "dtype": dtype}
        for dtype in dtypes
        for backend in backends
    ]
    for dtype in dtypes:
        for budget in (4096,) if args.quick else OFFICIAL_BUDGETS:
            case = {
                "engine": "esmc-official",
                "label": f"official ESMC length-sorted {budget}",
                "batching": "sorted",
                "budget": budget,
                "dtype": dtype,
            }
            if not oracle["available"]:
                case["skip"] = {"status": "unavailable", "error": oracle["error"]}
            cases.append(case)
    return cases


def child_esmc_official(case: dict) -> dict:
    """EvolutionaryScale's ESMC (run with .venv-esmc's python): length-sorted padded batches, as its
    `_tokenize` pads them, `sequence_tokens` only (its mask comes from padding), SDPA (no flash-attn on CPU)."""

    import torch
    from esm.models.esmc import ESMC
    from esm.tokenization import EsmSequenceTokenizer

    from benchmarks.embed import (
        _length_sorted_batches,
        _mean_pool_hidden,
        _memory,
        case_autocast,
        read_fasta,
        timed_batches,
    )
    from fastplms.manifest import find_checkpoint

    device = case["device"]
    layers, hidden, heads = find_checkpoint(case["model"])[1].dims
    t_load = time.perf_counter()
    model = ESMC(d_model=hidden, n_heads=heads, n_layers=layers, tokenizer=EsmSequenceTokenizer(), use_flash_attn=False)
    model.load_state_dict(torch.load(case["assets"]["official"], map_location="cpu"), strict=True)
    model = model.eval().to(device)
    load_s = time.perf_counter() - t_load
    records = read_fasta(case["dataset"])
    lengths = [len(s) for _, s in records]
    batches = _length_sorted_batches(lengths, case["budget"])
    autocast = case_autocast(case)

    def run(indices):
        tokens = model._tokenize([records[i][1] for i in indices]).to(device)
        with torch.inference_mode(), autocast:
            hidden_states = model(sequence_tokens=tokens).embeddings
        return _mean_pool_hidden(hidden_states, tokens != model.tokenizer.pad_token_id)

    return {"status": "ok", "load_s": load_s, **timed_batches(run, batches, lengths, case), **_memory(device)}
