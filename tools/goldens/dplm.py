"""Golden outputs of the official DPLM sampler (bytedance/dplm ``DiffusionProteinLanguageModel.generate``) on
seeded weights at dplm_150m dims.

Recipe "Official sampler in the fastplms environment" of shared/reference/families.md §2.6: the official
``src/byprot/models/dplm/dplm.py`` (and the ``byprot.models.utils`` helpers it imports) at the pinned commit run
unmodified in the project venv, imported from an oracle folder outside this repository through a namespace shim
(below; our own code), driving the in-environment network oracle ``fastplms.oracles.dplm.
dplm_transformers_network`` (Transformers 5.13 ``EsmForMaskedLM``, SDPA, bit-identical to the official network
on CPU fp32 per the reference). The folder is made by ``tools/goldens/setup_dplm_oracle.sh`` and named by
``--oracle`` or ``FASTPLMS_DPLM_ORACLE``::

    bash tools/goldens/setup_dplm_oracle.sh /path/to/oracle [<dplm git dir or clone URL>]
    FASTPLMS_DPLM_ORACLE=/path/to/oracle .venv/bin/python -m tools.goldens.dplm --out tests/goldens/
    FASTPLMS_DPLM_ORACLE=/path/to/oracle .venv/bin/python -m tools.goldens.dplm --check   # bit-for-bit re-run

Each case builds its input as the official CLI (generate_dplm.py) does: ``<cls>`` + L ``<mask>`` (or fixed
residues for inpainting) + ``<eos>``, right-padded with ``<pad>``; rows of different lengths so that the batch
is padded. It runs on CPU, fp32, one thread, under ``torch.no_grad``, with ``torch.manual_seed(seed)`` right
before ``generate``. Written: ``tests/goldens/dplm_sampler.json`` (the cases and the official tokens) and
``tests/goldens/dplm_manifest.json`` (hashes, versions, timings). Only outputs are committed.

``--golden network`` (or ``all``) makes the second golden, ``tests/goldens/dplm_network.safetensors``, with the
**fully official** network: ByProt's ``EsmForDPLM`` (``.../dplm/modules/dplm_modeling_esm.py``) loaded by the
official ``DiffusionProteinLanguageModel.from_pretrained`` (``.../dplm/dplm.py``) under Transformers 4.39.2, in
the venv of the DPLM2 oracle folder (``tools/goldens/setup_dplm2_env.sh``; ``--official-env`` or
``FASTPLMS_DPLM2_ORACLE``), through the import shim of ``tools/goldens/dplm2.py``::

    FASTPLMS_DPLM2_ORACLE=/path/to/dplm2-oracle .venv/bin/python -m tools.goldens.dplm --golden network
    FASTPLMS_DPLM2_ORACLE=/path/to/dplm2-oracle .venv/bin/python -m tools.goldens.dplm --golden network --check

The project stage writes the seeded weights as an airkingbd/dplm_150m-layout snapshot into
``<oracle>/work/dplm/`` with the input batches, runs ``<oracle>/venv/bin/python -m tools.goldens.dplm --stage
official-network`` (which imports nothing of fastplms), then compares the in-environment oracle
(``dplm_transformers_network`` + ``run_dplm_network``) with what the official stage wrote and records the
differences in the manifest entry ``models.dplm_network``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # the official generate wraps its loop in tqdm
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import importlib  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

from tools.goldens.check import check_against_committed, oracle_folder, run_official_stage  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMIT = "8b3425b7b7134aaf931baa5c53e0328da6a48a1f"  # bytedance/dplm, the commit shared/reference cites
COMMIT_FILE = "DPLM_COMMIT"  # written by setup_dplm_oracle.sh next to tree/ and site/
GOLDEN = "dplm_sampler.json"
MANIFEST = "dplm_manifest.json"
MODELS = ("dplm_sampler",)  # the manifest's one entry (tools/goldens/check.py compares models->name->sha256)
THREADS = 1
DIMS = {"num_layers": 30, "hidden": 640, "heads": 20}  # dplm_150m (reference §2.2)
WEIGHTS_SEED = 0
OFFICIAL_FILES = ("src/byprot/models/dplm/dplm.py", "src/byprot/models/utils.py")  # what the recipe executes
A_ID = 5  # "A" in the ESM alphabet
RESAMPLE_BIAS = {A_ID: 2.5}  # lm_head.bias shift of case f: every step resamples, on 1, 2 or all 3 rows
WEIGHTS = {"base": None, "bias_A": RESAMPLE_BIAS}  # name -> lm_head_bias_shift of dplm_official_state_dict

# Each case: lengths (residues per row), fixed residues (row -> {residue position (0-based, as the CLI's
# --cond_position): letters}), seed, max_iter, generate() keyword arguments, weights (a WEIGHTS name).
CASES: tuple[dict, ...] = (
    {"name": "gumbel_argmax_resample", "lengths": [22, 27, 25], "seed": 101, "max_iter": 8, "kwargs": {}},
    {
        "name": "gumbel_argmax_no_resample",
        "lengths": [26, 21, 24],
        "seed": 102,
        "max_iter": 8,
        "kwargs": {"disable_resample": True},
    },
    {"name": "argmax", "lengths": [23, 28], "seed": 103, "max_iter": 7, "kwargs": {"sampling_strategy": "argmax"}},
    {
        "name": "vanilla_t1",
        "lengths": [25, 20, 29],
        "seed": 104,
        "max_iter": 8,
        "kwargs": {"sampling_strategy": "vanilla", "temperature": 1.0},
    },
    {
        "name": "vanilla_greedy",
        "lengths": [27, 22],
        "seed": 105,
        "max_iter": 6,
        "kwargs": {"sampling_strategy": "vanilla", "temperature": None},
    },
    {
        "name": "gumbel_argmax_resample_fires",
        "lengths": [24, 28, 21],
        "seed": 106,
        "max_iter": 8,
        "kwargs": {},
        "weights": "bias_A",
    },
    {
        "name": "inpainting_partial_masks",
        "lengths": [24, 29, 26],
        "seed": 107,
        "max_iter": 8,
        "kwargs": {},
        "fixed": {0: {2: "MKTA", 15: "EME"}, 1: {0: "ALVE", 20: "GGW"}, 2: {10: "HHHHH"}},
    },
)
RESAMPLE_CASE = "gumbel_argmax_resample_fires"


# What each field of dplm_sampler.json holds (written into the file; B rows, S = max(lengths) + 2, T = max_iter).
LAYOUT = {
    "cases[].input_ids": "(B, S) int: <cls>=0, L residues (<mask>=32 or fixed residue ids), <eos>=2, <pad>=1 after",
    "cases[].partial_masks": "(B, S) bool, generate(partial_masks=...) (the CLI's input_ids != 32), or null",
    "cases[].lengths": "(B,) residues per row; fixed: row -> {0-based residue position: letters} or null",
    "cases[].output_tokens": "(B, S) int, the official generate() result",
    "cases[].step_tokens": "(T, B, S) int, the tokens after each step's re-masking (step_tokens[-1] = output)",
    "cases[].net_call_rows": "batch rows of each network call in order: B for a step's pass, R <= B right after "
    "it when that step's repeat resampling fired on R rows",
    "cases[].net_calls": "len(net_call_rows); resample_calls = net_calls - max_iter",
    "cases[].temperature": "as passed to generate() (null = None)",
    "cases[].weights": "the WEIGHTS entry the case ran on (see weights.<name>)",
    "weights.<name>": "dplm_official_state_dict(num_layers, hidden, heads, seed=seed, lm_head_bias_shift={id: "
    "shift}) and its dplm_state_sha256",
    "network_probe": "run_dplm_network on cases[0].input_ids with the base weights: sha256 of the float32 logits "
    "and last hidden state bytes (CPU-dependent), the hidden-state count, the logits argmax (B, S)",
}


def weights_recipe(name: str) -> dict:
    """How a case's weights are made: ``dplm_official_state_dict(**dims, seed=seed, lm_head_bias_shift=...)``."""
    shift = WEIGHTS[name]
    return {
        "name": name,
        **DIMS,
        "seed": WEIGHTS_SEED,
        "lm_head_bias_shift": {str(k): v for k, v in shift.items()} if shift else None,
    }


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def official_tree_sha256(tree: Path) -> str:
    """sha256 over (relative path, bytes) of the official files the recipe executes."""
    digest = hashlib.sha256()
    for rel in OFFICIAL_FILES:
        digest.update(rel.encode() + b"\0")
        digest.update((tree / rel).read_bytes())
    return digest.hexdigest()


def locate_oracle(oracle: Path | None) -> Path:
    """The oracle folder (checked: at the pinned commit, outside the repository, with tree/ and site/)."""
    oracle = oracle_folder(oracle, "FASTPLMS_DPLM_ORACLE", "setup_dplm_oracle.sh")
    tree = oracle / "tree"
    if not all((tree / rel).is_file() for rel in OFFICIAL_FILES) or not (oracle / "site" / "omegaconf").is_dir():
        raise SystemExit(f"{oracle}: no tree/{OFFICIAL_FILES[0]} or site/omegaconf; run setup_dplm_oracle.sh")
    commit = (oracle / COMMIT_FILE).read_text().strip() if (oracle / COMMIT_FILE).is_file() else "?"
    if commit != COMMIT:
        raise SystemExit(f"{oracle}: official checkout is at {commit}, the recipe needs {COMMIT}")
    if REPO_ROOT in (p.resolve() for p in [tree, *tree.parents]):
        raise SystemExit(f"{tree}: the official code must live outside the repository")
    return oracle


# ---------------------------------------------------------------------------------------------- import shim


@contextlib.contextmanager
def _hashable_byprot_dataclasses():
    """While importing byprot modules, make their dataclasses ``unsafe_hash=True``.

    ``DPLMConfig`` has ``lora: LoRAConfig = field(default=LoRAConfig())``; Python >= 3.11 rejects an unhashable
    (plain ``eq=True``) dataclass instance as a default ("mutable default"). A hash makes it acceptable; nothing
    else about the classes changes. Only classes whose module starts with ``byprot`` are touched."""
    original = dataclasses.dataclass

    def patched(cls=None, /, **kwargs):
        def wrap(c):
            if c.__module__.split(".")[0] == "byprot" and not kwargs.get("frozen"):
                kwargs.setdefault("unsafe_hash", True)
            return original(c, **kwargs)

        return wrap if cls is None else wrap(cls)

    dataclasses.dataclass = patched
    try:
        yield
    finally:
        dataclasses.dataclass = original


def _package(name: str, path: Path | None) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(path)] if path is not None else []
    module.__package__ = name
    sys.modules[name] = module
    if "." in name:
        parent, child = name.rsplit(".", 1)
        setattr(sys.modules[parent], child, module)
    return module


def install_byprot_shim(src: Path) -> None:
    """Register empty ``byprot`` packages carrying the upstream ``__path__``s, so that
    ``byprot.models.dplm.dplm`` and ``byprot.models.utils`` load from the official tree without running the
    package ``__init__``s (which import every data, structure and task module: hydra, pytorch_lightning, ...).

    ``byprot.models.register_model`` is a no-op decorator (``MODEL_REGISTRY`` stays empty); ``byprot.utils``
    is a stub with the two names the loaded modules import (``get_logger``, ``load_yaml_config``; the latter
    is only used by code paths the recipe never takes and raises)."""
    if "byprot" in sys.modules:
        if getattr(sys.modules["byprot"], "__fastplms_shim__", None) != str(src):
            raise RuntimeError("a different byprot is already imported")
        return
    root = src / "byprot"
    byprot = _package("byprot", root)
    byprot.__fastplms_shim__ = str(src)
    models = _package("byprot.models", root / "models")
    models.MODEL_REGISTRY = {}
    models.register_model = lambda name: lambda cls: cls
    _package("byprot.models.dplm", root / "models" / "dplm")
    _package("byprot.models.dplm.modules", root / "models" / "dplm" / "modules")
    _package("byprot.models.dplm2", root / "models" / "dplm2")
    _package("byprot.datamodules", root / "datamodules")
    _package("byprot.datamodules.dataset", root / "datamodules" / "dataset")
    utils = _package("byprot.utils", None)
    utils.get_logger = logging.getLogger

    def load_yaml_config(*_args, **_kwargs):
        raise NotImplementedError("byprot.utils.load_yaml_config is stubbed by the fastplms DPLM shim")

    utils.load_yaml_config = load_yaml_config


def import_official(oracle: Path, module: str) -> types.ModuleType:
    """Import one official byprot module from ``<oracle>/tree/src`` through the shim."""
    oracle = locate_oracle(oracle)
    site = str(oracle / "site")
    if site not in sys.path:
        sys.path.insert(0, site)
    install_byprot_shim(oracle / "tree" / "src")
    with _hashable_byprot_dataclasses():
        loaded = importlib.import_module(module)
    expected = (oracle / "tree" / "src" / (module.replace(".", "/") + ".py")).resolve()
    if Path(loaded.__file__).resolve() != expected:
        raise RuntimeError(f"{module} loaded from {loaded.__file__}, not {expected}")
    return loaded


def import_official_sampler(oracle: Path | None = None):
    """The official ``DiffusionProteinLanguageModel`` class (byprot/models/dplm/dplm.py)."""
    return import_official(oracle, "byprot.models.dplm.dplm").DiffusionProteinLanguageModel


# ----------------------------------------------------------------------------------------------- the recipe


def make_adapter(network, ref, torch):
    """A thin ``nn.Module`` the official wrapper drives in place of ``EsmForDPLM``: ``{"logits",
    "last_hidden_state"}`` with the mask ``input_ids != <pad>`` (anything else the caller passes is ignored, as
    the official forward does), the special ids the wrapper reads, and a log of each call's batch rows."""

    class Adapter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.network = network
            self.tokenizer = None  # the wrapper stores it; generate() never uses it
            self.mask_id, self.pad_id, self.bos_id, self.eos_id = ref.MASK_ID, ref.PAD_ID, ref.BOS_ID, ref.EOS_ID
            self.x_id = ref.X_ID
            self.call_rows: list[int] = []

        def forward(self, input_ids, **_ignored):
            self.call_rows.append(int(input_ids.shape[0]))
            return ref.dplm_network_outputs(self.network, input_ids)

    return Adapter()


def case_inputs(case: dict, ref, torch):
    """(input_ids, partial_masks or None) built as generate_dplm.py's initialize_generation does."""
    vocab = {token: i for i, token in enumerate(ref.DPLM_VOCAB)}
    width = max(case["lengths"]) + 2
    rows = []
    for r, length in enumerate(case["lengths"]):
        residues = [ref.MASK_ID] * length
        for start, letters in case.get("fixed", {}).get(r, {}).items():
            assert start + len(letters) <= length, (case["name"], r)
            residues[start : start + len(letters)] = [vocab[c] for c in letters]
        row = [ref.BOS_ID, *residues, ref.EOS_ID]
        rows.append(row + [ref.PAD_ID] * (width - len(row)))
    input_ids = torch.tensor(rows, dtype=torch.int64)
    # The CLI always passes partial_mask = input_ids != <mask>; without fixed residues that equals None for the
    # sampler (specials are excluded anyway), so the plain cases pass None.
    partial_masks = input_ids.ne(ref.MASK_ID) if "fixed" in case else None
    return input_ids, partial_masks


def check_cli_encoding(case: dict, input_ids, ref, torch, tmp: Path) -> None:
    """Our builder must equal what the CLI's tokenizer call (EsmTokenizer, special tokens, padding="longest")
    makes of the CLI's strings."""
    from transformers import EsmTokenizer

    vocab_file = tmp / "vocab.txt"
    vocab_file.write_text("\n".join(ref.DPLM_VOCAB) + "\n")
    tokenizer = EsmTokenizer(str(vocab_file))
    strings = []
    for r, length in enumerate(case["lengths"]):
        seq = ["<mask>"] * length
        for start, letters in case.get("fixed", {}).get(r, {}).items():
            seq[start : start + len(letters)] = list(letters)
        strings.append("".join(seq))
    batch = tokenizer(strings, add_special_tokens=True, padding="longest", return_tensors="pt")
    if not torch.equal(batch["input_ids"], input_ids):
        raise SystemExit(f"{case['name']}: our input builder differs from the CLI's EsmTokenizer encoding")


def run_case(case: dict, sampler_cls, network, ref, torch) -> tuple[dict, float]:
    input_ids, partial_masks = case_inputs(case, ref, torch)
    adapter = make_adapter(network, ref, torch)
    model = sampler_cls(cfg={}, net=adapter).eval()
    step_tokens = []
    official_reparam = model._reparam_decoding

    def recording_reparam(*args, **kwargs):  # observe each step's result; the official code computes it
        out = official_reparam(*args, **kwargs)
        step_tokens.append(out[1].tolist())
        return out

    model._reparam_decoding = recording_reparam
    kwargs = {
        "temperature": None,
        "sampling_strategy": "gumbel_argmax",
        "disable_resample": False,
        "resample_ratio": 0.25,
        **case["kwargs"],
    }
    t0 = time.perf_counter()
    with torch.no_grad():
        torch.manual_seed(case["seed"])
        output = model.generate(
            input_tokens=input_ids.clone(),
            max_iter=case["max_iter"],
            partial_masks=None if partial_masks is None else partial_masks.clone(),
            **kwargs,
        )
    seconds = time.perf_counter() - t0
    assert output.dtype == torch.int64 and output.shape == input_ids.shape
    assert len(step_tokens) == case["max_iter"] and step_tokens[-1] == output.tolist()
    record = {
        "name": case["name"],
        "seed": case["seed"],
        "max_iter": case["max_iter"],
        "sampling_strategy": kwargs["sampling_strategy"],
        "temperature": kwargs["temperature"],
        "disable_resample": kwargs["disable_resample"],
        "resample_ratio": kwargs["resample_ratio"],
        "lengths": case["lengths"],
        "fixed": {str(r): {str(p): s for p, s in f.items()} for r, f in case["fixed"].items()}
        if "fixed" in case
        else None,
        "weights": weights_recipe(case.get("weights", "base")),
        "input_ids": input_ids.tolist(),
        "partial_masks": None if partial_masks is None else partial_masks.tolist(),
        "output_tokens": output.tolist(),
        "step_tokens": step_tokens,
        "net_calls": len(adapter.call_rows),
        "net_call_rows": adapter.call_rows,
        "resample_calls": len(adapter.call_rows) - case["max_iter"],
    }
    return record, seconds


def check_record(record: dict, ref) -> None:
    """What must hold of any official output (the tests re-check it on the file)."""
    out, inp = record["output_tokens"], record["input_ids"]
    pm = record["partial_masks"]
    for r, (row_in, row_out) in enumerate(zip(inp, out, strict=True)):
        for p, (a, b) in enumerate(zip(row_in, row_out, strict=True)):
            fixed = a in (ref.BOS_ID, ref.EOS_ID, ref.PAD_ID) or (pm is not None and pm[r][p])
            if fixed:
                assert a == b, (record["name"], r, p)
            else:
                assert b not in ref.SUPPRESSED_IDS, (record["name"], r, p, b)


def network_probe(network, ref, torch) -> dict:
    """A fingerprint of the network oracle on one padded batch (the tests rebuild it from the seeded weights)."""
    input_ids, _ = case_inputs(CASES[0], ref, torch)
    logits, hidden = ref.run_dplm_network(network, input_ids)
    return {
        "input": CASES[0]["name"],
        "logits_sha256": sha256_bytes(logits.contiguous().numpy().tobytes()),
        "last_hidden_state_sha256": sha256_bytes(hidden[-1].contiguous().numpy().tobytes()),
        "hidden_states_count": len(hidden),
        "argmax": logits.argmax(-1).tolist(),
    }


def _dumps(value, indent: int = 0) -> str:
    """JSON with lists of scalars on one line (the token tables stay small and readable); sorted keys."""
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{inner}{json.dumps(k)}: {_dumps(v, indent + 1)}" for k, v in sorted(value.items())]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list):
        if all(not isinstance(v, (dict, list)) for v in value):
            return json.dumps(value)
        return "[\n" + ",\n".join(inner + _dumps(v, indent + 1) for v in value) + "\n" + pad + "]"
    return json.dumps(value)


def generate(out_dir: Path, oracle: Path | None) -> dict:
    oracle = locate_oracle(oracle)
    import tempfile

    import torch

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    from fastplms.oracles import dplm as ref

    start = time.perf_counter()
    sampler_cls = import_official_sampler(oracle)
    import omegaconf

    versions = {name: importlib.metadata.version(name) for name in ("torch", "transformers", "numpy", "safetensors")}
    versions["omegaconf"] = omegaconf.__version__
    versions["python"] = platform.python_version()

    networks: dict[str, object] = {}
    weights: dict[str, dict] = {}
    probe = None
    cases, facts = [], {"build_seconds": {}, "case_seconds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            wname = case.get("weights", "base")
            if wname not in networks:
                t0 = time.perf_counter()
                shift = WEIGHTS[wname]
                state = ref.dplm_official_state_dict(**DIMS, seed=WEIGHTS_SEED, lm_head_bias_shift=shift)
                if list(state) != list(ref.dplm_official_spec(**DIMS)):
                    raise SystemExit("dplm_official_state_dict does not follow dplm_official_spec")
                weights[wname] = {
                    **weights_recipe(wname),
                    "state_sha256": ref.dplm_state_sha256(state),
                    "keys": len(state),
                    "parameters": sum(v.numel() for v in state.values()),
                }
                network = ref.dplm_transformers_network(state)
                del state
                assert not network.training and all(p.dtype == torch.float32 for p in network.parameters())
                networks[wname] = network
                facts["build_seconds"][wname] = round(time.perf_counter() - t0, 2)
                if probe is None:
                    probe = network_probe(network, ref, torch)
            input_ids, _ = case_inputs(case, ref, torch)
            check_cli_encoding(case, input_ids, ref, torch, Path(tmp))
            record, seconds = run_case(case, sampler_cls, networks[wname], ref, torch)
            check_record(record, ref)
            cases.append(record)
            facts["case_seconds"][case["name"]] = round(seconds, 2)
            print(
                f"{case['name']}: {record['net_calls']} net calls ({record['resample_calls']} resample), "
                f"{seconds:.2f}s",
                flush=True,
            )
    fired = next(c for c in cases if c["name"] == RESAMPLE_CASE)["resample_calls"]
    if fired < 1:
        raise SystemExit(f"{RESAMPLE_CASE}: the repeat resampling never fired; raise RESAMPLE_BIAS")

    golden = {
        "schema": 1,
        "upstream": {"repo": "bytedance/dplm", "commit": COMMIT, "files": list(OFFICIAL_FILES)},
        "sampler": "byprot.models.dplm.dplm.DiffusionProteinLanguageModel(cfg={}, net=adapter).eval().generate("
        "input_tokens=input_ids, max_iter=max_iter, temperature=temperature, partial_masks=partial_masks, "
        "sampling_strategy=sampling_strategy, disable_resample=disable_resample, resample_ratio=resample_ratio) "
        "under torch.no_grad(), torch.manual_seed(seed) right before, CPU fp32, 1 thread",
        "network": "fastplms.oracles.dplm.dplm_transformers_network(dplm_official_state_dict(num_layers, hidden, "
        "heads, seed=seed, lm_head_bias_shift=...)); adapter = dplm_network_outputs (mask = input_ids != 1)",
        "special_ids": {"bos": ref.BOS_ID, "pad": ref.PAD_ID, "eos": ref.EOS_ID, "x": ref.X_ID, "mask": ref.MASK_ID},
        "suppressed_ids": sorted(ref.SUPPRESSED_IDS),
        "vocab_size": len(ref.DPLM_VOCAB),
        "weights": weights,
        "layout": LAYOUT,
        "network_probe": probe,
        "cases": cases,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / GOLDEN
    path.write_text(_dumps(golden) + "\n")
    manifest = {
        "recipe": "tools/goldens/dplm.py",
        "command": "FASTPLMS_DPLM_ORACLE=<oracle> .venv/bin/python -m tools.goldens.dplm --out tests/goldens/",
        "upstream": {"repo": "bytedance/dplm", "commit": COMMIT, "files_sha256": official_tree_sha256(oracle / "tree")},
        "threads": THREADS,
        "deterministic_algorithms": True,
        "versions": versions,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "models": {
            "dplm_sampler": {
                "file": path.name,
                "sha256": sha256_bytes(path.read_bytes()),
                "bytes": path.stat().st_size,
                "resample_calls": {c["name"]: c["resample_calls"] for c in cases},
                **facts,
            }
        },
    }
    manifest["wall_seconds_total"] = round(time.perf_counter() - start, 2)
    return manifest


# ------------------------------------------------------------------ the network golden (fully official network)

NETWORK_GOLDEN = "dplm_network.safetensors"
NETWORK_MODEL = "dplm_network"  # the manifest entry
NETWORK_SNAPSHOT = "dplm_150m_seed0"
NETWORK_WORK = "dplm"  # <oracle>/work/dplm: snapshot, inputs.json, official_facts.json
# What the official stage executes (for the tree digest): the wrapper, the network, the helpers the wrapper imports.
NETWORK_FILES = (
    "src/byprot/models/dplm/dplm.py",
    "src/byprot/models/dplm/modules/dplm_modeling_esm.py",
    "src/byprot/models/utils.py",
)
# Indices into net.esm(..., output_hidden_states=True).hidden_states (L + 1 = 31 entries): the embedding output,
# the input of layer 15 and of the last layer. Entry 30 (the final LayerNorm output) is last_hidden_state.
NETWORK_HIDDEN_LAYERS = (0, 15, 29)
# Two padded batches (plain data; "<mask>" is one token). Rows: <cls> residues <eos>, right-padded with <pad>.
NETWORK_BATCHES: dict[str, list[str]] = {
    # 11, 26 and 19 residues (S = 28): a few masks, a row without any, a row with a run of masks.
    "a": [
        "MKT<mask>LLVAGE<mask>",
        "MSDNELKQRIEAFLRHGWTCYVPAKD",
        "G<mask><mask>PQRST<mask>VWYACDE<mask>FH",
    ],
    # 36, 10 and 28 residues (S = 38): the longest row unpadded, an all-<mask> row (as generation starts), an X.
    "b": [
        "MAEGKQ<mask>LTRWVHSDFPNYC<mask>IEKLGAMR<mask>TVSQDW",
        "<mask><mask><mask><mask><mask><mask><mask><mask><mask><mask>",
        "PLKVX<mask>DEFGHIKLMN<mask>QRSTVWYAC<mask>D",
    ],
}
NETWORK_LAYOUT = {
    "hidden_state_layers": f"({len(NETWORK_HIDDEN_LAYERS)},) int64, {list(NETWORK_HIDDEN_LAYERS)}: indices into "
    "net.esm(input_ids, attention_mask=input_ids != 1, output_hidden_states=True).hidden_states (31 entries: "
    "entry 0 the embedding output, entry i the input of layer i, entry 30 the final LayerNorm output, which is "
    "bit-equal to last_hidden_state)",
    "<batch>.input_ids": "(B, S) int64: <cls>=0, residues (<mask>=32 where the sequence says so), <eos>=2, then "
    "<pad>=1; equal to the official tokenizer(sequences, padding='longest')",
    "<batch>.logits": "(B, S, 33) float32, net(input_ids=input_ids)['logits'] (EsmForDPLM.forward: mask = ids != "
    "<pad> always), every position (padded queries attend the valid keys, so pads are defined)",
    "<batch>.last_hidden_state": "(B, S, 640) float32, net(input_ids=input_ids)['last_hidden_state'] (final "
    "LayerNorm output), every position",
    "<batch>.hidden_states": f"({len(NETWORK_HIDDEN_LAYERS)}, B, S, 640) float32, hidden_states[hidden_state_layers]",
    "batches": list(NETWORK_BATCHES),
}


def encode_network_batch(sequences: list[str], ref) -> list[list[int]]:
    """``<cls>`` + residue ids (``<mask>`` one token) + ``<eos>``, right-padded with ``<pad>`` to the longest."""
    import re

    vocab = {token: i for i, token in enumerate(ref.DPLM_VOCAB)}
    rows = [[ref.BOS_ID, *(vocab[t] for t in re.findall(r"<mask>|[A-Z]", seq)), ref.EOS_ID] for seq in sequences]
    width = max(len(r) for r in rows)
    return [r + [ref.PAD_ID] * (width - len(r)) for r in rows]


def network_tree_sha256(tree: Path) -> str:
    """sha256 over (relative path, bytes) of the official files the network stage executes."""
    digest = hashlib.sha256()
    for rel in NETWORK_FILES:
        digest.update(rel.encode() + b"\0")
        digest.update((tree / rel).read_bytes())
    return digest.hexdigest()


def locate_official_env(oracle: Path | None) -> Path:
    """The DPLM2 oracle folder (``setup_dplm2_env.sh``; checked by ``tools.goldens.dplm2.locate_oracle``: pinned
    commit, venv, outside the repository), which must also hold the DPLM network files."""
    from tools.goldens import dplm2 as official_env

    oracle = official_env.locate_oracle(oracle)
    if not all((oracle / "tree" / rel).is_file() for rel in NETWORK_FILES):
        raise SystemExit(f"{oracle}: tree/ lacks {NETWORK_FILES}; run setup_dplm2_env.sh")
    return oracle


def run_official_network(oracle: Path, work: Path, out: Path) -> None:
    """The official stage (the DPLM2 oracle's venv, Transformers 4.39.2; imports nothing of fastplms): the
    official wrapper's ``from_pretrained`` on the snapshot, then per batch ``net(input_ids=...)``, the wrapper's
    ``forward`` and ``net.esm(..., output_hidden_states=True)``. Writes ``<out>/dplm_network.safetensors`` and
    ``<work>/official_facts.json``."""
    import torch
    from safetensors.torch import load_file, save_file

    from tools.goldens import dplm2 as official_env

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    t_start = time.perf_counter()
    tree = oracle / "tree"
    official_env.install_official_shim(tree)
    with official_env.hashable_byprot_dataclasses():
        import byprot.models.dplm.dplm as wrapper_module
        import byprot.models.dplm.modules.dplm_modeling_esm as network_module  # registers "dplm_esm"
    for name, rel in zip(
        ("byprot.models.dplm.dplm", "byprot.models.dplm.modules.dplm_modeling_esm", "byprot.models.utils"),
        NETWORK_FILES,
        strict=True,
    ):
        if Path(sys.modules[name].__file__).resolve() != (tree / rel).resolve():
            raise SystemExit(f"{name} loaded from {sys.modules[name].__file__}, not {tree / rel}")
    inputs = json.loads((work / "inputs.json").read_text())
    snapshot = work / inputs["snapshot"]
    facts: dict = {"import_seconds": round(time.perf_counter() - t_start, 2)}

    # ---- build: AutoConfig.dplm_type -> MODEL_REGISTRY["dplm_esm"] (EsmForDPLM).from_pretrained -> wrapper
    t0 = time.perf_counter()
    torch.manual_seed(WEIGHTS_SEED)  # the official init is overwritten by the load; seeded for tidiness only
    model = wrapper_module.DiffusionProteinLanguageModel.from_pretrained(str(snapshot))
    net = model.net
    facts["build_seconds"] = round(time.perf_counter() - t0, 2)
    if type(net) is not network_module.EsmForDPLM:
        raise SystemExit(f"from_pretrained built {type(net)}, not EsmForDPLM")
    facts["net_class"] = f"{type(net).__module__}.{type(net).__qualname__}"
    facts["net_training_after_from_pretrained"] = bool(net.training)
    facts["hidden_dropout_prob"] = net.config.hidden_dropout_prob
    file_state = load_file(str(snapshot / "model.safetensors"))
    official_state = net.state_dict()
    decoder = "lm_head.decoder.weight"
    spec = [[k, list(v.shape)] for k, v in official_state.items() if k != decoder]
    facts["official_state_keys"] = len(official_state)
    facts["official_state_spec_equals_dplm_official_spec"] = spec == inputs["spec"]
    facts["official_state_keys_not_in_file"] = sorted(set(official_state) - set(file_state))
    facts["file_keys_not_in_official_state"] = sorted(set(file_state) - set(official_state))
    facts["official_state_equals_file"] = all(
        torch.equal(official_state[k], file_state[k]) for k in set(official_state) & set(file_state)
    )
    facts["decoder_is_word_embeddings"] = net.lm_head.decoder.weight is net.esm.embeddings.word_embeddings.weight
    if not (
        facts["official_state_spec_equals_dplm_official_spec"]
        and facts["official_state_equals_file"]
        and facts["official_state_keys_not_in_file"] == [decoder]
        and not facts["file_keys_not_in_official_state"]
        and facts["decoder_is_word_embeddings"]
    ):
        raise SystemExit(f"official state differs from dplm_official_spec / the snapshot: {facts}")
    del file_state, official_state
    tok = net.tokenizer
    facts["official_vocab_equals_ours"] = [tok._id_to_token[i] for i in range(len(tok))] == inputs["vocab"]
    facts["official_special_ids"] = {
        name: int(getattr(model, f"{name}_id")) for name in ("mask", "pad", "bos", "eos", "x")
    }
    if not facts["official_vocab_equals_ours"] or facts["official_special_ids"] != inputs["special_ids"]:
        raise SystemExit(f"official tokenizer differs from ours: {facts}")
    model.eval()  # the wrapper never calls it; from_pretrained already put the net in eval (recorded above)

    # ---- forward
    tensors: dict[str, torch.Tensor] = {"hidden_state_layers": torch.tensor(NETWORK_HIDDEN_LAYERS, dtype=torch.int64)}
    network_facts: dict = {}
    t0 = time.perf_counter()
    for name, batch in inputs["batches"].items():
        ids = torch.tensor(batch["input_ids"], dtype=torch.int64)
        official_ids = tok(batch["sequences"], padding="longest", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            result = net(input_ids=ids)
            logits, last = result["logits"], result["last_hidden_state"]
            wrapper_logits, wrapper_last = model(ids, return_last_hidden_state=True)
            again = net(input_ids=ids)
            ones_mask = net(input_ids=ids, attention_mask=torch.ones_like(ids))
            esm = net.esm(ids, attention_mask=ids.ne(net.pad_id), output_hidden_states=True)
        hidden = esm.hidden_states
        network_facts[name] = {
            "shape": list(ids.shape),
            "official_tokenizer_equals_ours": bool(torch.equal(official_ids, ids)),
            "wrapper_forward_equals_net": bool(torch.equal(wrapper_logits, logits) and torch.equal(wrapper_last, last)),
            "rerun_bitwise_equal": bool(torch.equal(again["logits"], logits)),
            "caller_attention_mask_ignored": bool(torch.equal(ones_mask["logits"], logits)),
            "esm_hidden_states_count": len(hidden),
            "esm_last_equals_net_last": bool(torch.equal(esm.last_hidden_state, last)),
            "esm_hidden_states_last_equals_net_last": bool(torch.equal(hidden[-1], last)),
            "logits_dtype": str(logits.dtype),
        }
        if not all(v for k, v in network_facts[name].items() if isinstance(v, bool)):
            raise SystemExit(f"{name}: official network checks failed: {network_facts[name]}")
        tensors[f"{name}.input_ids"] = ids
        tensors[f"{name}.logits"] = logits
        tensors[f"{name}.last_hidden_state"] = last
        tensors[f"{name}.hidden_states"] = torch.stack([hidden[i] for i in NETWORK_HIDDEN_LAYERS])
    facts["network_seconds"] = round(time.perf_counter() - t0, 2)
    facts["network"] = network_facts
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    for key, value in tensors.items():
        if value.is_floating_point():
            assert value.dtype == torch.float32 and torch.isfinite(value).all(), key
    versions = {
        name: importlib.metadata.version(name)
        for name in ("torch", "transformers", "tokenizers", "huggingface_hub", "omegaconf", "numpy", "safetensors")
    }
    versions["python"] = platform.python_version()
    out.mkdir(parents=True, exist_ok=True)
    info = {"model": "dplm_150m", "seed": WEIGHTS_SEED, "dplm_commit": COMMIT, "torch": versions["torch"]}
    # One metadata entry only: safetensors writes several keys in hash-map order, which breaks file hashes.
    save_file(tensors, str(out / NETWORK_GOLDEN), metadata={"dplm_network_golden": json.dumps(info, sort_keys=True)})
    facts["versions"] = versions
    facts["tree_sha256"] = network_tree_sha256(tree)
    facts["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    facts["wall_seconds"] = round(time.perf_counter() - t_start, 2)
    (work / "official_facts.json").write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")


def compare_in_env_network(state, golden_path: Path, ref, torch) -> dict:
    """Max abs difference of the in-environment oracle (``dplm_transformers_network`` + ``run_dplm_network``,
    Transformers 5.13) from the official golden, per batch and tensor, every position."""
    from safetensors.torch import load_file

    golden = load_file(str(golden_path))
    network = ref.dplm_transformers_network(state)
    result = {}
    for name in NETWORK_BATCHES:
        logits, hidden = ref.run_dplm_network(network, golden[f"{name}.input_ids"])
        ours = {
            "logits": logits,
            "last_hidden_state": hidden[-1],
            "hidden_states": torch.stack([hidden[i] for i in NETWORK_HIDDEN_LAYERS]),
        }
        entry: dict = {k: float((v - golden[f"{name}.{k}"]).abs().max()) for k, v in ours.items()}
        entry["hidden_states_count"] = len(hidden)
        entry["bitwise_equal"] = all(torch.equal(v, golden[f"{name}.{k}"]) for k, v in ours.items())
        result[name] = entry
    return result


def generate_network(out_dir: Path, oracle: Path | None, work: Path | None) -> dict:
    """The project stage around the official one; returns the manifest entry ``models.dplm_network``."""

    import torch

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    from safetensors.torch import load_file

    from fastplms.oracles import dplm as ref

    oracle = locate_official_env(oracle)
    work = (work or oracle / "work" / NETWORK_WORK).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out_dir = out_dir.resolve()
    start = time.perf_counter()
    t0 = time.perf_counter()
    snapshot = ref.write_dplm_snapshot(work / NETWORK_SNAPSHOT, **DIMS, seed=WEIGHTS_SEED)
    spec = ref.dplm_official_spec(**DIMS)
    written = load_file(str(snapshot / "model.safetensors"))
    state = {k: written[k] for k in spec}  # dplm_official_state_dict(**DIMS, seed=WEIGHTS_SEED), in its order
    del written
    state_sha = ref.dplm_state_sha256(state)
    batches = {}
    for name, sequences in NETWORK_BATCHES.items():
        batches[name] = {"sequences": sequences, "input_ids": encode_network_batch(sequences, ref)}
    inputs = {
        "snapshot": snapshot.name,
        "spec": [[k, list(v)] for k, v in spec.items()],
        "vocab": list(ref.DPLM_VOCAB),
        "special_ids": {"mask": ref.MASK_ID, "pad": ref.PAD_ID, "bos": ref.BOS_ID, "eos": ref.EOS_ID, "x": ref.X_ID},
        "batches": batches,
    }
    (work / "inputs.json").write_text(json.dumps(inputs) + "\n")
    prepare_seconds = round(time.perf_counter() - t0, 2)

    official_seconds = run_official_stage(
        oracle, "tools.goldens.dplm", "--stage", "official-network", "--official-env", str(oracle),
        "--work", str(work), "--out", str(out_dir), cwd=REPO_ROOT,
    )  # fmt: skip
    official = json.loads((work / "official_facts.json").read_text())

    t0 = time.perf_counter()
    in_env = compare_in_env_network(state, out_dir / NETWORK_GOLDEN, ref, torch)
    compare_seconds = round(time.perf_counter() - t0, 2)
    path = out_dir / NETWORK_GOLDEN
    versions = {name: importlib.metadata.version(name) for name in ("torch", "transformers", "numpy", "safetensors")}
    versions["python"] = platform.python_version()
    entry = {
        "file": path.name,
        "sha256": sha256_bytes(path.read_bytes()),
        "bytes": path.stat().st_size,
        "command": "FASTPLMS_DPLM2_ORACLE=<oracle> .venv/bin/python -m tools.goldens.dplm --golden network "
        "--out tests/goldens/",
        "setup": "bash tools/goldens/setup_dplm2_env.sh <oracle> [<dplm git dir or clone URL>]",
        "oracle": "official bytedance/dplm DiffusionProteinLanguageModel.from_pretrained(snapshot) -> EsmForDPLM "
        "(transformers 4.39.2) in <oracle>/venv, imported from <oracle>/tree through tools/goldens/dplm2.py's "
        "import shim; net(input_ids=...) and net.esm(..., output_hidden_states=True); CPU FP32, 1 thread, "
        "deterministic algorithms, torch.no_grad",
        "upstream": {
            "repo": "bytedance/dplm",
            "commit": COMMIT,
            "files": list(NETWORK_FILES),
            "files_sha256": official["tree_sha256"],
        },
        "weights": {
            "recipe": "fastplms.oracles.dplm.dplm_official_state_dict(30, 640, 20, seed=0) (dplm_150m dims), "
            "written by write_dplm_snapshot",
            **DIMS,
            "seed": WEIGHTS_SEED,
            "dplm_state_sha256": state_sha,
            "keys": len(state),
            "parameters": sum(v.numel() for v in state.values()),
        },
        "threads": THREADS,
        "deterministic_algorithms": True,
        "versions_official": official["versions"],
        "versions_project": versions,
        "cpu_capability": official["cpu_capability"],
        "machine": platform.machine(),
        "batches": {
            k: {"sequences": v["sequences"], "shape": official["network"][k]["shape"]} for k, v in batches.items()
        },
        "hidden_state_layers": list(NETWORK_HIDDEN_LAYERS),
        "layout": NETWORK_LAYOUT,
        "official_checks": {
            k: v
            for k, v in official.items()
            if not k.endswith("_seconds") and k not in ("versions", "tree_sha256", "cpu_capability")
        },
        "in_env_oracle_max_abs_diff": in_env,
        "seconds": {
            "prepare_weights_and_snapshot": prepare_seconds,
            "official_stage": official_seconds,
            "official_import": official["import_seconds"],
            "official_build": official["build_seconds"],
            "official_network": official["network_seconds"],
            "in_env_compare": compare_seconds,
        },
    }
    del state
    entry["wall_seconds"] = round(time.perf_counter() - start, 2)
    print(f"{path}: {entry['bytes']} B sha256={entry['sha256']} {entry['wall_seconds']}s", flush=True)
    for name, diffs in in_env.items():
        print(f"in-env oracle vs official, batch {name}: {diffs}", flush=True)
    return entry


GOLDEN_CHOICES = {"sampler": ("dplm_sampler",), "network": (NETWORK_MODEL,), "all": ("dplm_sampler", NETWORK_MODEL)}


def generate_selected(out_dir: Path, golden: str, args) -> dict:
    """A manifest holding the selected goldens' entries (the sampler run supplies the top-level fields)."""
    manifest: dict = {"models": {}, "wall_seconds_total": 0.0}
    if golden in ("sampler", "all"):
        manifest = generate(out_dir, args.oracle)
    if golden in ("network", "all"):
        entry = generate_network(out_dir, args.official_env, args.work)
        manifest["models"][NETWORK_MODEL] = entry
        manifest["wall_seconds_total"] = round(manifest["wall_seconds_total"] + entry["wall_seconds"], 2)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "goldens")
    parser.add_argument("--oracle", type=Path, default=None, help="folder made by setup_dplm_oracle.sh (sampler)")
    parser.add_argument(
        "--official-env",
        type=Path,
        default=None,
        help="folder made by setup_dplm2_env.sh (network; FASTPLMS_DPLM2_ORACLE)",
    )
    parser.add_argument("--work", type=Path, default=None, help="network scratch folder (default <oracle>/work/dplm)")
    parser.add_argument("--golden", choices=tuple(GOLDEN_CHOICES), default="sampler", help="which golden(s) to make")
    parser.add_argument(
        "--check", action="store_true", help="regenerate into a temporary folder and compare to --out's manifest"
    )
    parser.add_argument("--stage", choices=("all", "official-network"), default="all", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage == "official-network":
        run_official_network(args.official_env.resolve(), args.work.resolve(), args.out.resolve())
        return 0
    names = GOLDEN_CHOICES[args.golden]
    if args.check:
        return check_against_committed(
            args.out / MANIFEST, names, lambda folder: generate_selected(folder, args.golden, args)
        )
    path = args.out / MANIFEST
    previous = json.loads(path.read_text()) if path.is_file() else {"models": {}}
    manifest = generate_selected(args.out, args.golden, args)
    if "dplm_sampler" not in names:  # keep the sampler run's top-level fields and entry
        manifest = {**previous, "models": {**previous.get("models", {}), **manifest["models"]}}
    else:  # keep an entry not regenerated
        manifest["models"] = {**previous.get("models", {}), **manifest["models"]}
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    for name in names:
        entry = manifest["models"][name]
        print(f"{args.out / entry['file']}: {entry['bytes']} B sha256={entry['sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
