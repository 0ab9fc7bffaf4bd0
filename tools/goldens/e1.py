"""Golden outputs of the official Profluent E1 code on seeded weights at real dims (e1_150m, e1_300m).

Runs in the project venv (recipe (a) of shared/reference/families.md §1.6): the official ``src/`` of
Profluent-AI/E1 at the pinned commit and ``einops==0.8.1`` come from an oracle folder outside this repository,
made by ``tools/goldens/setup_e1_oracle.sh`` and named by ``--oracle`` or ``FASTPLMS_E1_ORACLE``::

    bash tools/goldens/setup_e1_oracle.sh /path/to/oracle [<E1 git dir or clone URL>]
    FASTPLMS_E1_ORACLE=/path/to/oracle .venv/bin/python -m tools.goldens.e1 --out tests/goldens/
    FASTPLMS_E1_ORACLE=/path/to/oracle .venv/bin/python -m tools.goldens.e1 --check   # bit-for-bit re-run

Per model it builds ``E1ForMaskedLM(E1Config(**e1_config_kwargs(dims)))`` with dims from the E1 manifest,
checks its state-dict layout against ``fastplms.oracles.e1.e1_official_spec``, loads
``e1_official_state_dict(dims, seed=0)`` strictly, checks that the official ``E1BatchPreparer`` produces
``e1_panel()``'s tensors, and runs the panel in FP32 on CPU (one thread, deterministic algorithms); then the
cache cases (``CACHE_ROW`` alone: the context forward with ``use_cache``, the cache cropped to the context,
the query suffix run against it). File layout: ``tools/goldens/README.md``. Only outputs are committed.
"""

from __future__ import annotations

import os

# Before anything imports huggingface_hub: the official modeling.py calls kernels.get_kernel at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

from tools.goldens.check import check_against_committed, oracle_folder  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS = ("e1_150m", "e1_300m")
SEED = 0
THREADS = 1  # fixed: GEMM reduction order can depend on the thread count
MANIFEST = "e1_manifest.json"
COMMIT = "219c7c7a3a803b8552ae6a44ce6dd24f133fefbd"  # Profluent-AI/E1, as manifests/e1.toml pins it
COMMIT_FILE = "E1_COMMIT"  # written by setup_e1_oracle.sh next to tree/ and site/


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_sha256(src: Path) -> str:
    """sha256 over (relative path, bytes) of the official package files the recipe runs."""
    digest = hashlib.sha256()
    for path in sorted(p for p in (src / "E1").rglob("*") if p.is_file() and p.suffix in (".py", ".json")):
        if "__pycache__" in path.parts:
            continue
        digest.update(path.relative_to(src).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def locate_oracle(oracle: Path | None) -> tuple[Path, str]:
    """Put the official ``src`` and the einops folder on sys.path; return (src, tree sha256)."""
    oracle = oracle_folder(oracle, "FASTPLMS_E1_ORACLE", "setup_e1_oracle.sh")
    src, site = oracle / "tree" / "src", oracle / "site"
    if not (src / "E1" / "modeling.py").is_file() or not (src / "E1" / "tokenizer.json").is_file():
        raise SystemExit(f"{oracle}: no tree/src/E1/modeling.py + tokenizer.json; run setup_e1_oracle.sh")
    commit = (oracle / COMMIT_FILE).read_text().strip() if (oracle / COMMIT_FILE).is_file() else "?"
    if commit != COMMIT:
        raise SystemExit(f"{oracle}: official checkout is at {commit}, the recipe needs {COMMIT}")
    if REPO_ROOT in (p.resolve() for p in [src, *src.parents]):
        raise SystemExit(f"{src}: the official code must live outside the repository")
    sys.path[:0] = [str(src), str(site)]
    return src, tree_sha256(src)


def hidden_state_layers(n_layers: int) -> list[int]:
    """Indices into the official ``hidden_states`` (L + 1 entries) the goldens keep: first, middle, last."""
    return [0, n_layers // 2, n_layers]


def build_official(dims, ref, torch):
    from E1.config import E1Config
    from E1.modeling import E1ForMaskedLM

    config = E1Config(**ref.e1_config_kwargs(dims))
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (ref.PAD_ID, ref.BOS_ID, ref.EOS_ID)
    assert config.vocab_size == dims.vocab_size and config.intermediate_size == dims.intermediate_size
    return E1ForMaskedLM(config)


def check_layers(model, dims, ref) -> None:
    """Layer types, rotary bases and table sizes of the built model against the dims."""
    global_layers = ref.e1_global_layers(dims)
    for i, layer in enumerate(model.model.layers):
        attn = layer.norm_attn_norm.self_attn
        is_global = attn.layer_type.value == "global"
        assert is_global == (i in global_layers), i
        theta = dims.rope_theta_global if is_global else dims.rope_theta_within_seq
        rows = dims.max_positions_global if is_global else dims.max_positions_within_seq
        assert attn.rotary_emb.base == theta and attn.rotary_emb.max_seq_len_cached == rows, i
        assert attn.clip_qkv == dims.clip_qkv and attn.head_dim == dims.head_dim, i


def check_panel(panel, ref, torch) -> None:
    """The panel's tensors must be exactly what the official batch preparer makes of its instances."""
    from E1.batch_preparer import E1BatchPreparer
    from E1.tokenizer import get_tokenizer

    vocab = get_tokenizer().get_vocab()
    if dict(sorted(vocab.items(), key=lambda kv: kv[1])) != {t: i for i, t in enumerate(ref.E1_VOCAB)}:
        raise SystemExit("E1_VOCAB differs from the official tokenizer.json")
    official = E1BatchPreparer().get_batch_kwargs(panel.instances, device=torch.device("cpu"))
    for key, value in panel.model_inputs().items():
        if not torch.equal(official[key], value):
            raise SystemExit(f"e1_panel().{key} differs from the official E1BatchPreparer")
    if official["context_len"] != panel.context_len.tolist():
        raise SystemExit("e1_panel().context_len differs from the official E1BatchPreparer")


def clip_fractions(model, inputs, dims, torch) -> dict[str, float]:
    """Fraction of valid q/k/v projection entries beyond +-clip_qkv (what the clamp changes), over all layers."""
    counts = {"q_proj": [0, 0], "k_proj": [0, 0], "v_proj": [0, 0]}
    valid = inputs["sequence_ids"] >= 0
    hooks = []
    for layer in model.model.layers:
        attn = layer.norm_attn_norm.self_attn
        for name in counts:

            def hook(_module, _args, out, name=name):
                x = out[valid]
                counts[name][0] += int((x.abs() > dims.clip_qkv).sum())
                counts[name][1] += x.numel()

            hooks.append(getattr(attn, name).register_forward_hook(hook))
    try:
        with torch.inference_mode():
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return {name: clipped / total for name, (clipped, total) in counts.items()}


def cached_query(model, inputs, context_len, torch):
    """(full forward, query-suffix forward against the cache cropped to the context) of one unpadded row."""
    with torch.inference_mode():
        full = model(**inputs, use_cache=True)
        cache = full.past_key_values
        cache.crop(context_len)
        assert cache.get_seq_length() == context_len
        suffix = {k: v[:, context_len:] for k, v in inputs.items()}
        cached = model(**suffix, past_key_values=cache, use_cache=True)
    return full, cached


def max_abs(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def run_model(name: str, ref, torch) -> tuple[dict, dict]:
    """Returns (tensors to save, facts for the manifest)."""
    dims = ref.e1_dims(name)
    panel = ref.e1_panel()
    inputs = panel.model_inputs()
    facts: dict = {}

    t0 = time.perf_counter()
    torch.manual_seed(SEED)  # the official init is overwritten by the strict load; seeded for tidiness only
    model = build_official(dims, ref, torch)
    official_spec = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected_spec = ref.e1_official_spec(dims)
    if list(official_spec.items()) != list(expected_spec.items()):
        raise SystemExit(f"{name}: e1_official_spec disagrees with the official E1ForMaskedLM state_dict layout")
    state = ref.e1_official_state_dict(dims, seed=SEED)
    facts["state_sha256"] = ref.e1_state_sha256(state)
    model.load_state_dict(state, strict=True)
    del state
    model.eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    check_layers(model, dims, ref)
    facts["build_seconds"] = round(time.perf_counter() - t0, 2)

    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model(**inputs, output_hidden_states=True)
        again = model(**inputs, output_hidden_states=True)
    facts["forward_seconds"] = round(time.perf_counter() - t0, 2)
    hs = out.hidden_states
    facts["hidden_states_count"] = len(hs)
    assert len(hs) == dims.num_layers + 1 and hs[-1] is out.embeddings and out.logits.dtype == torch.float32
    facts["in_process_rerun_bitwise_equal"] = bool(
        torch.equal(again.logits, out.logits)
        and all(torch.equal(a, b) for a, b in zip(again.hidden_states, hs, strict=True))
    )
    if not facts["in_process_rerun_bitwise_equal"]:
        raise SystemExit(f"{name}: the official forward is not deterministic in-process")
    facts["clip_fraction"] = clip_fractions(model, inputs, dims, torch)

    # Cache, single-sequence query: the cache holds the row's two context sequences.
    row = panel.instances[ref.CACHE_ROW]
    cache_inputs, context_len = ref.e1_cache_split(row, n_context=2)
    assert context_len == int(panel.context_len[ref.CACHE_ROW])
    full, cached = cached_query(model, cache_inputs, context_len, torch)
    width = cache_inputs["input_ids"].shape[1]
    facts["cache_single_query"] = {
        "row": ref.CACHE_ROW,
        "context_len": context_len,
        "query_len": width - context_len,
        "max_abs_logits_vs_full": max_abs(cached.logits, full.logits[:, context_len:]),
        "max_abs_embeddings_vs_full": max_abs(cached.embeddings, full.embeddings[:, context_len:]),
        "full_row_vs_panel_batch_max_abs_logits": max_abs(full.logits[0], out.logits[ref.CACHE_ROW, :width]),
        "full_row_vs_panel_batch_max_abs_embeddings": max_abs(
            full.embeddings[0], out.embeddings[ref.CACHE_ROW, :width]
        ),
    }
    cache_tensors = {
        "cache_context_len": torch.tensor([context_len], dtype=torch.int64),
        "cache_logits": cached.logits,
        "cache_embeddings": cached.embeddings,
        "cache_full_logits": full.logits,
        "cache_full_embeddings": full.embeddings,
    }
    # Cache, two-sequence "query" (the official cached path does not handle it): deviation only.
    multi_inputs, multi_context = ref.e1_cache_split(row, n_context=1)
    mfull, mcached = cached_query(model, multi_inputs, multi_context, torch)
    second = int(panel.context_len[ref.CACHE_ROW]) - multi_context  # suffix tokens of the first query sequence
    d_logits = (mcached.logits - mfull.logits[:, multi_context:]).abs()
    d_emb = (mcached.embeddings - mfull.embeddings[:, multi_context:]).abs()
    facts["cache_two_sequence_query"] = {
        "row": ref.CACHE_ROW,
        "context_len": multi_context,
        "first_query_sequence_max_abs_logits": float(d_logits[:, :second].max()),
        "second_query_sequence_max_abs_logits": float(d_logits[:, second:].max()),
        "first_query_sequence_max_abs_embeddings": float(d_emb[:, :second].max()),
        "second_query_sequence_max_abs_embeddings": float(d_emb[:, second:].max()),
    }

    layers = hidden_state_layers(dims.num_layers)
    tensors = {
        **inputs,
        "context_len": panel.context_len,
        "hidden_state_layers": torch.tensor(layers, dtype=torch.int64),
        "logits": out.logits,
        "hidden_states": torch.stack([hs[i] for i in layers]),
        **cache_tensors,
    }
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    for key, value in tensors.items():
        if value.is_floating_point():
            assert value.dtype == torch.float32 and torch.isfinite(value).all(), key
    valid = panel.valid
    facts["logits_std"] = float(out.logits[valid].std())
    facts["embeddings_std"] = float(out.embeddings[valid].std())
    facts["spec"] = {"keys": len(expected_spec), "parameters": sum(v.numel() for v in model.state_dict().values())}
    facts["dims"] = dims._asdict()
    facts["global_layers"] = ref.e1_global_layers(dims)
    facts["hidden_state_layers"] = layers
    del model, out, again, full, cached, mfull, mcached
    return tensors, facts


def generate(out_dir: Path, models: tuple[str, ...], oracle: Path | None) -> dict:
    _, official_tree = locate_oracle(oracle)
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    import E1.modeling  # noqa: F401  (the import-time kernel probe; offline it falls back to F.rms_norm)

    from fastplms.oracles import e1 as ref

    out_dir.mkdir(parents=True, exist_ok=True)
    panel = ref.e1_panel()
    check_panel(panel, ref, torch)
    start = time.perf_counter()
    versions = {
        name: importlib.metadata.version(name)
        for name in ("torch", "transformers", "tokenizers", "kernels", "numpy", "safetensors")
    }
    import einops

    versions["einops"] = einops.__version__
    versions["python"] = platform.python_version()
    manifest: dict = {
        "recipe": "tools/goldens/e1.py",
        "command": "FASTPLMS_E1_ORACLE=<oracle> .venv/bin/python -m tools.goldens.e1 --out tests/goldens/",
        "oracle": "E1.modeling.E1ForMaskedLM(E1.config.E1Config(**e1_config_kwargs(dims))) from Profluent-AI/E1 "
        "src/, strict load_state_dict, eval, FP32 CPU, HF_HUB_OFFLINE=1 (RMSNorm = F.rms_norm), varlen/block "
        "flex attention unfused on CPU",
        "upstream": {"repo": "Profluent-AI/E1", "commit": COMMIT, "tree_sha256": official_tree},
        "weights": "fastplms.oracles.e1.e1_official_state_dict(e1_dims(name), seed)",
        "dims_from": ref.e1_manifest_path().relative_to(REPO_ROOT).as_posix(),
        "seed": SEED,
        "threads": THREADS,
        "deterministic_algorithms": True,
        "versions": versions,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "panel": {
            "builder": "fastplms.oracles.e1.e1_panel() (checked equal to the official E1BatchPreparer)",
            "instances": panel.instances,
            "context_len": panel.context_len.tolist(),
            **{k: v.tolist() for k, v in panel.model_inputs().items()},
        },
        "layout": {
            "input_ids": "(B, S) int64, official ids, right-padded with <pad>=0",
            "sequence_ids": "(B, S) int64, sequence index in the row (0..k), -1 on padding",
            "within_seq_position_ids": "(B, S) int64, position within its sequence, -1 on padding",
            "global_position_ids": "(B, S) int64, position in the row, -1 on padding",
            "context_len": "(B,) int64, tokens before the query sequence (0 for single-sequence rows)",
            "hidden_state_layers": "(3,) int64, indices into the official hidden_states (L + 1 entries: entry i "
            "is the input of layer i, entry L the final-normed output = embeddings)",
            "logits": "(B, S, 34) float32, official logits (float32), every position (pads included)",
            "hidden_states": "(3, B, S, D) float32, hidden_states[hidden_state_layers], every position",
            "cache_context_len": "(1,) int64, C: tokens of the two context sequences of row CACHE_ROW",
            "cache_full_logits": "(1, T, 34) float32, row CACHE_ROW alone (T tokens, no padding), use_cache=True",
            "cache_full_embeddings": "(1, T, D) float32, same run, final-normed hidden state",
            "cache_logits": "(1, T - C, 34) float32, the query suffix run against that run's cache cropped to C",
            "cache_embeddings": "(1, T - C, D) float32, same cached run",
        },
        "models": {},
    }
    for name in models:
        t0 = time.perf_counter()
        tensors, facts = run_model(name, ref, torch)
        path = out_dir / f"{name}.safetensors"
        # One metadata entry only: safetensors keeps metadata in a hash map and writes several keys in a
        # random order, which would break the bit-for-bit file hashes.
        info = {"model": name, "seed": SEED, "e1_commit": COMMIT, "torch": versions["torch"]}
        save_file(tensors, str(path), metadata={"e1_golden": json.dumps(info, sort_keys=True)})
        manifest["models"][name] = {
            "file": path.name,
            "sha256": sha256(path),
            "bytes": path.stat().st_size,
            "wall_seconds": round(time.perf_counter() - t0, 2),
            **facts,
        }
        entry = manifest["models"][name]
        print(f"{name}: {path} {entry['bytes']} B sha256={entry['sha256']} {entry['wall_seconds']}s", flush=True)
    manifest["wall_seconds_total"] = round(time.perf_counter() - start, 2)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "goldens")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--oracle", type=Path, default=None, help="folder made by setup_e1_oracle.sh")
    parser.add_argument(
        "--check", action="store_true", help="regenerate into a temporary folder and compare to --out's manifest"
    )
    args = parser.parse_args(argv)
    models = tuple(args.models)
    if not args.check:
        manifest = generate(args.out, models, args.oracle)
        old_path = args.out / MANIFEST
        if set(models) != set(MODELS) and old_path.exists():
            # Keep the other models' entries when only some were regenerated.
            manifest["models"] = {**json.loads(old_path.read_text())["models"], **manifest["models"]}
        old_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return 0
    return check_against_committed(args.out / MANIFEST, models, lambda folder: generate(folder, models, args.oracle))


if __name__ == "__main__":
    sys.exit(main())
