"""The Profluent-E1 side of `python -m benchmarks.embed --model e1_150m`: ours against Profluent's official code.

What a user would otherwise run is Profluent-AI/E1 (the pinned commit of `manifests/e1.toml`): its README embeds
sequences by handing a list of them to `E1BatchPreparer.get_batch_kwargs` (padded to the longest) and running
`E1ForMaskedLM` on the batch, keeping the embeddings of the last sequence's residues; its embedding cookbook
runs `E1Predictor` (batches grouped by length under `max_batch_tokens`, always under BF16 autocast). The official
code runs in the project venv from an oracle folder outside this repository (`tools/goldens/setup_e1_oracle.sh`:
the official tree plus einops), named by `FASTPLMS_E1_ORACLE` (default `~/.cache/fastplms/e1-oracle`, set up on
first use; a structured `unavailable` with the exact error when that fails). Both sides load the same seeded
weights: a Profluent-layout snapshot in FP32 at the checkpoint's real dims (`fastplms.oracles.e1.write_e1_snapshot`),
loaded into the official `E1ForMaskedLM` (built from its config and loaded strictly, see `load_official`) and
built into our artifact. Single
sequences, no retrieval context; embeddings are the mean over each sequence's residues on both sides.

Not a runtime module: it may import anything the dev environment has.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ORACLE_SETUP = REPO / "tools" / "goldens" / "setup_e1_oracle.sh"
ORACLE_COMMIT = "219c7c7a3a803b8552ae6a44ce6dd24f133fefbd"  # Profluent-AI/E1, as manifests/e1.toml pins it
# The official code is measured length-sorted at these budgets (padded tokens per batch, 4 boundary tokens per
# sequence: <bos> 1 ... 2 <eos>); fastplms at its default (4096). `E1Predictor` groups by residues under
# `max_batch_tokens` (the cookbook's 16384, 4096 "on Colab T4"): 4096 here.
E1_BUDGETS = (2048, 4096)
E1_PREDICTOR_TOKENS = 4096
E1_SPECIAL = 4
# Default records per profile (ESM2-35M: 400): E1-150M costs about 0.31 GFLOP per token and the official code
# runs its global layers through flex attention uncompiled on CPU, so 24 records (lognormal ~7,500 residues,
# short ~2,900) keep a full run of both profiles, one repeat, under about six minutes on 2 CPU cores.
E1_RECORDS = 24
E1_RECORDS_QUICK = 8


def is_e1(model: str) -> bool:
    return model.startswith("e1_")


def oracle_dir() -> Path:
    return Path(os.environ.get("FASTPLMS_E1_ORACLE", Path.home() / ".cache" / "fastplms" / "e1-oracle"))


def oracle_paths(oracle: Path) -> list[str]:
    """What goes on sys.path for the official code: its `src` and the einops folder."""
    return [str(oracle / "tree" / "src"), str(oracle / "site")]


def oracle_status() -> dict:
    """Set up the oracle folder if missing (setup_e1_oracle.sh), then import the official model code in a
    subprocess of this venv: {"available": True, "commit", "folder"} or {"available": False, "error": ...}
    with the exact error of whichever step failed."""
    oracle = oracle_dir()
    stamp = oracle / "E1_COMMIT"
    if not stamp.exists() or stamp.read_text().strip() != ORACLE_COMMIT:
        command = ["bash", str(ORACLE_SETUP), str(oracle)]
        if os.environ.get("FASTPLMS_E1_SOURCE"):  # a local E1 git dir (the default clones from GitHub)
            command.append(os.environ["FASTPLMS_E1_SOURCE"])
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            return {"available": False, "error": f"{' '.join(command)} timed out after 900 s"}
        if done.returncode != 0:
            return {"available": False, "error": (done.stderr or done.stdout)[-2000:]}
    probe = "from E1.modeling import E1ForMaskedLM; from E1.batch_preparer import E1BatchPreparer; print('ok')"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(oracle_paths(oracle))}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0:
        return {"available": False, "error": done.stderr[-2000:]}
    return {"available": True, "commit": stamp.read_text().strip(), "folder": str(oracle)}


def e1_dims(model: str):
    from fastplms.oracles.e1 import e1_dims as dims

    return dims(model)


def e1_matmul_params(dims) -> int:
    """Weights of the bias-free q, o (hidden wide), k, v (kv_heads * head_dim wide) and gated SiLU FFN, all layers."""
    d, kv = dims.hidden_size, dims.num_kv_heads * dims.head_dim
    return dims.num_layers * (2 * d * d + 2 * d * kv + 3 * d * dims.intermediate_size)


def e1_flops(lengths: list[int], dims) -> float:
    """Matmul FLOPs of an unpadded E1 encoder forward (no MLM head) over single sequences of these lengths.

    Per sequence of L residues (T = L + 4 tokens: <bos> 1 ... 2 <eos>): T * 2 * P + layers * 4 * hidden * T^2,
    where P = layers * (2 * hidden^2 + 2 * hidden * kv + 3 * hidden * F) are the bias-free q, o, k, v
    (kv = kv_heads * head_dim) and gated FFN weights; the second term is Q K^T plus P V (a single sequence's
    within-sequence and block-causal layers both see the whole sequence).
    """
    params = e1_matmul_params(dims)
    d, layers = dims.hidden_size, dims.num_layers
    return float(sum((n + E1_SPECIAL) * 2 * params + layers * 4 * d * (n + E1_SPECIAL) ** 2 for n in lengths))


FLOPS_FORMULA = (
    "per sequence of L residues, T = L + 4 tokens (<bos> 1 ... 2 <eos>): T * 2 * P + layers * 4 * hidden * T^2, "
    "P = layers * (2 * hidden^2 + 2 * hidden * kv + 3 * hidden * F), kv = kv_heads * head_dim (bias-free q, o, k, v "
    "and gated SiLU FFN); divided by the residues"
)


def e1_model_record(model: str) -> dict:
    """Extra dims of the record's `model` entry."""
    dims = e1_dims(model)
    return {
        "kv_heads": dims.num_kv_heads,
        "intermediate": dims.intermediate_size,
        "global_every": dims.global_attention_every_n_layers,
        "encoder_matmul_params": e1_matmul_params(dims),
    }


def prepare_e1_assets(model: str, seed: int, root: Path, artifact: Path) -> dict[str, str]:
    """The seeded Profluent-layout snapshot (FP32) once per (model, seed), our artifact built from it once per
    runtime code, and the oracle folder the official child puts on its path."""
    import torch

    from fastplms.artifact.build import build
    from fastplms.oracles.e1 import write_e1_snapshot

    snapshot = root / "snapshot"
    if not (snapshot / "model.safetensors").exists():
        tmp = root / "snapshot.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_e1_snapshot(tmp, e1_dims(model), seed=seed, dtype=torch.float32)
        shutil.rmtree(snapshot, ignore_errors=True)
        tmp.replace(snapshot)
    if not (artifact / "provenance.json").exists():
        build(model, snapshot, artifact, allow_unpinned=True, force=True)
    return {"snapshot": str(snapshot), "ours": str(artifact), "oracle": str(oracle_dir())}


def e1_cases(args, oracle: dict) -> list[dict]:
    """fastplms default against the official E1 (README batching: `E1BatchPreparer` on length-sorted batches
    under each budget), FP32 and BF16 (autocast on both sides), and the official `E1Predictor` (the embedding
    cookbook's path; BF16 only: its forward always runs under BF16 autocast). `--quick`: FP32, budget 4096.
    Every case embeds 64 residues untimed first and is rated end to end (runs are a few batches); the output
    check takes the first records from the timed run itself."""
    gpu = args.device.startswith("cuda")
    dtypes = ("bfloat16",) if gpu else ("float32", "bfloat16")
    if args.quick:
        dtypes = ("float32",)
    cases: list[dict] = []
    for dtype in dtypes:
        cases.append({"engine": "ours", "label": "fastplms default", "backend": "default", "dtype": dtype})
        for budget in (4096,) if args.quick else E1_BUDGETS:
            cases.append(
                {
                    "engine": "e1-official",
                    "label": f"official E1 length-sorted {budget}",
                    "batching": "sorted",
                    "budget": budget,
                    "dtype": dtype,
                }
            )
        if dtype == "bfloat16":
            cases.append(
                {
                    "engine": "e1-official",
                    "label": f"official E1Predictor max_batch_tokens={E1_PREDICTOR_TOKENS}",
                    "batching": "predictor",
                    "budget": E1_PREDICTOR_TOKENS,
                    "dtype": dtype,
                }
            )
    for case in cases:
        case.update(check_from_run=True, warmup=True)
        if case["engine"] == "e1-official" and not oracle["available"]:
            case["skip"] = {"status": "unavailable", "error": oracle["error"]}
    return cases


def load_official(snapshot: str | Path, model_class, config_class, torch):
    """The official `E1ForMaskedLM` holding the snapshot's weights, built as `tools/goldens/e1.py` builds it:
    `E1ForMaskedLM(E1Config(**config.json))` and a strict `load_state_dict`. Not `from_pretrained`: the official
    code pins transformers<4.57, and under Transformers 5 `from_pretrained` leaves the rotary tables the official
    attention computes in `__init__` (non-persistent `inv_freq`, `cos_cached`, `sin_cached` buffers, in no
    checkpoint) uninitialised: measured, `inv_freq` wrong and `cos_cached` NaN, embeddings at cosine ~0.93."""
    import json

    from safetensors.torch import load_file

    folder = Path(snapshot)
    config = json.loads((folder / "config.json").read_text())
    kept = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = model_class(config_class(**kept))
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("the official E1 should hold float32 weights here")
    return model


def child_e1_official(case: dict) -> dict:
    """Profluent's official E1 (project venv, the oracle folder on sys.path): `sorted` runs the README's
    `E1BatchPreparer.get_batch_kwargs` + `E1ForMaskedLM` forward on length-sorted batches under the case's
    budget (FP32 unless the case is BF16: autocast); `predictor` runs `E1Predictor.predict_batch` over
    `E1Predictor.batch_sequences` (what its `predict` loops over, without the progress bar). Mean over the
    residues of each sequence (`~get_boundary_token_mask`), as the README selects them."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # the official modeling.py asks the Hub for a kernel at import time
    sys.path[:0] = oracle_paths(Path(case["assets"]["oracle"]))
    import torch
    from E1.batch_preparer import E1BatchPreparer
    from E1.config import E1Config
    from E1.modeling import E1ForMaskedLM

    from benchmarks.embed import (
        WARMUP_RESIDUES,
        _length_sorted_batches,
        _memory,
        case_autocast,
        read_fasta,
        timed_batches,
    )

    device = case["device"]
    t_load = time.perf_counter()
    model = load_official(case["assets"]["snapshot"], E1ForMaskedLM, E1Config, torch).to(device).eval()
    load_s = time.perf_counter() - t_load
    records = read_fasta(case["dataset"])
    lengths = [len(s) for _, s in records]
    sequences = [s for _, s in records]

    if case["batching"] == "predictor":
        from E1.predictor import E1Predictor

        predictor = E1Predictor(model, max_batch_tokens=case["budget"], fields_to_save=["mean_token_embeddings"])
        batches = [indices for indices, valid in predictor.batch_sequences(sequences) if valid]

        def embed(seqs: list[str]):
            predictions = predictor.predict_batch(seqs, [{"id": i} for i in range(len(seqs))])
            return torch.stack([p["mean_token_embeddings"].float() for p in predictions]).cpu()

    else:
        preparer = E1BatchPreparer()
        batches = _length_sorted_batches(lengths, case["budget"], special=E1_SPECIAL)
        autocast = case_autocast(case)

        def embed(seqs: list[str]):
            batch = preparer.get_batch_kwargs(seqs, device=torch.device(device))
            with torch.inference_mode(), autocast:
                out = model(
                    input_ids=batch["input_ids"],
                    within_seq_position_ids=batch["within_seq_position_ids"],
                    global_position_ids=batch["global_position_ids"],
                    sequence_ids=batch["sequence_ids"],
                    past_key_values=None,
                    use_cache=False,
                    output_attentions=False,
                    output_hidden_states=False,
                )
            last = batch["sequence_ids"] == batch["sequence_ids"].max(dim=1)[0][:, None]
            keep = (last & ~preparer.get_boundary_token_mask(batch["input_ids"])).unsqueeze(-1)
            return (out.embeddings.float().masked_fill(~keep, 0).sum(1) / keep.sum(1)).cpu()

    out = {"status": "ok", "load_s": load_s}
    if case.get("warmup"):  # the same short untimed call as fastplms' (benchmarks.embed.WARMUP_RESIDUES)
        t_warm = time.perf_counter()
        embed([sequences[0][:WARMUP_RESIDUES]])
        out["warmup_s"] = time.perf_counter() - t_warm
    timed = timed_batches(lambda indices: embed([sequences[i] for i in indices]), batches, lengths, case)
    return {**out, **timed, **_memory(device)}


def e1_comparisons(data: dict) -> list[tuple[str, str, str]]:
    """E1 has no numeric targets: fastplms default against the official E1 in the same run, on end-to-end rates
    (every case is a few batches after an untimed warm-up), per dtype, peak RSS at the same budget, and the FP32
    output check against the official FP32 run (the harness's reference)."""
    from benchmarks.report import _find, _num, memory_and_output_rows

    def rate(row: dict) -> float:
        return row["summary"]["end_to_end_res_per_s"]["median"]

    results, rows = data["results"], []
    for dtype in ("float32", "bfloat16"):
        ours = _find(results, engine="ours", label="fastplms default", dtype=dtype)
        official = _find(results, engine="e1-official", dtype=dtype)
        best = max((r for r in official if r["case"]["batching"] == "sorted"), key=rate, default=None)
        predictor = next((r for r in official if r["case"]["batching"] == "predictor"), None)
        for name, other in (
            (f"length-sorted at its best budget ({best and best['case']['budget']})", best),
            (f"E1Predictor (max_batch_tokens={E1_PREDICTOR_TOKENS})", predictor),
        ):
            if not ours or other is None:
                continue
            value = rate(ours[0]) / rate(other)
            rows.append(
                (
                    f"{dtype}: faster than the official E1 {name}",
                    f"{value:.2f}x ({_num(rate(ours[0]))} vs {_num(rate(other))} res/s end to end)",
                    "met" if value > 1 else "missed",
                )
            )
    return rows + memory_and_output_rows(results, "e1-official", "the official E1", "the official E1's")
