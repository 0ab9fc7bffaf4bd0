"""Golden outputs of the official DPLM2 code (bytedance/dplm@8b3425b) on seeded weights at dplm2_150m dims.

Two stages, one command. Run from the project venv; it drives the official stage in the oracle folder's own venv
(made by ``tools/goldens/setup_dplm2_env.sh``: Python 3.11, torch 2.13 CPU, transformers 4.39.2, ...)::

    bash tools/goldens/setup_dplm2_env.sh /path/to/dplm2-oracle [<dplm git dir or clone URL>]
    FASTPLMS_DPLM2_ORACLE=/path/to/dplm2-oracle .venv/bin/python -m tools.goldens.dplm2 --out tests/goldens/
    FASTPLMS_DPLM2_ORACLE=/path/to/dplm2-oracle .venv/bin/python -m tools.goldens.dplm2 --check  # bit for bit

1. Project stage (project venv): draws ``fastplms.oracles.dplm2.dplm2_official_state_dict(30, 640, 20, seed=0)``
   and writes it as an airkingbd/dplm2_150m-layout snapshot (config.json, model.safetensors, reconstructed
   vocab.txt) into ``<oracle>/work/``, with the network input batches built by our ``DPLM2Tokenizer.pack``.
2. Official stage (oracle venv, ``--stage official``; imports nothing of fastplms): imports the official
   wrapper (``byprot/models/dplm2/dplm2.py``), network (``.../modules/dplm2_modeling_esm.py``) and
   ``generate_dplm2.py`` from ``<oracle>/tree`` through an import shim (empty ``byprot`` namespace packages,
   stub ``byprot.utils``, stub ``datasets``/``pandas``/``tree``/``peft``/``Bio.SeqIO`` modules, byprot
   dataclasses made ``unsafe_hash`` so that Python 3.11 accepts their instance defaults), loads the snapshot
   with the official ``MultimodalDiffusionProteinLanguageModel.from_pretrained`` (tokenizer vocab overridden to
   the snapshot: the default is the Hub's airkingbd/dplm2_650m), and on CPU, FP32, one thread, deterministic
   algorithms: (A) the wrapper forward (double embedding, batch-wide split rotary) on the network batches;
   (B) ``generate`` with ``torch.manual_seed(seed)`` right before each call, inputs made by the official
   ``generate_dplm2.initialize_generation`` / ``initialize_conditional_generation``.
3. Project stage again: the in-environment oracle (``fastplms.oracles.dplm2.run_dplm2_network``, Transformers
   5.13 ``EsmForMaskedLM``) on the same weights and batches, compared with (A); then the manifest.

File layout and facts: ``tools/goldens/README.md`` (DPLM2). Only outputs are committed.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TQDM_DISABLE"] = "1"  # the official generate wraps its loop in tqdm

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import importlib.machinery  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

from tools.goldens.check import check_against_committed, oracle_folder, run_official_stage  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMIT = "8b3425b7b7134aaf931baa5c53e0328da6a48a1f"  # bytedance/dplm, as shared/reference/families.md cites it
COMMIT_FILE = "DPLM_COMMIT"  # written by setup_dplm2_env.sh next to tree/ and venv/
MODEL = "dplm2_150m"
DIMS = (30, 640, 20)  # dplm2_150m: layers, hidden, heads (reference §3.2; net.name airkingbd/dplm_150m)
SEED = 0
THREADS = 1  # fixed: GEMM reduction order can depend on the thread count
MANIFEST = "dplm2_manifest.json"
NETWORK_FILE = "dplm2_network.safetensors"
SAMPLER_FILE = "dplm2_sampler.json"
GOLDENS = ("dplm2_network", "dplm2_sampler")
HIDDEN_STATE_LAYERS = (0, 15, 30)  # indices into hidden_states (L + 1 entries): embedding output, middle, final LN
LOGITS_HEAD, LOGITS_TAIL = 64, 64  # logit columns kept: ids 0..63 and 8165..8228
MAX_ITER = 5

# ---------------------------------------------------------------------------- panels (plain data)
# Network batches: rows are (structure, sequence); None = that track absent (a single-modality row).
NETWORK_BATCHES: dict[str, list[tuple[str | None, str | None]]] = {
    # Two packed rows of 12 and 17 residues: each track padded to its own longest (19), L = 38.
    "packed": [
        (
            "6349,2865,<mask_struct>,1490,3558,6768,5605,<mask_struct>,7699,5640,4237,0222",
            "SGE<mask_aa>SNW<mask_aa>AFK<mask_aa>",
        ),
        (
            "2294,7488,5174,6446,0875,1075,2110,6815,1596,5262,7128,4512,4495,2726,2444,0000,8191",
            "HIYFPARVVWWCDCMAC",
        ),
    ],
    # aa only (no split rotary): 22 and 9 residues, L = 24.
    "aa_only": [(None, "MGCPQTGWWFECQKTWFYRAYC"), (None, "QYQL<mask_aa>PKDD")],
    # One aa-only row and one packed row of 9 residues, L = 22: the batch holds types 0 and 1, so the official
    # rotary splits the aa-only row at L/2 too.
    "mixed": [
        (None, "FCHWHICG<mask_aa>TR"),
        ("3148,7903,5424,7251,5450,4074,7570,6608,1870", "QYQLAPKDD"),
    ],
    # Odd width: an aa-only row and a struct-only row of 11 tokens each, L = 13: halves of 7 and 6.
    "odd_mixed": [
        (None, "FCHWHICGITR"),
        ("1130,7208,3827,7221,4867,7118,6775,4021,2860,7577,0365", None),
    ],
}
# Sampler cases: (task, seed, sampling_strategy or None = generate() default, unmasking_strategy or None).
CO_GENERATION_LENGTH = 20
FOLDING_FASTA = [("fold_a", "QQKEYMYLRNVRSRIN"), ("fold_b", "CPYKAKESRLCNSRMHVPWIV")]
INVERSE_FOLDING_FASTA = [
    ("inv_a", "6093,1780,7971,7392,2060,0790,6111,3088,4470,0720,0247,5758,1030,3013,3890,4152,6349,5765"),
    (
        "inv_b",
        "7826,0692,6314,6084,1168,1781,7519,0431,7656,2006,7235,2002,7075,3870,3446,4499,2189,7458,0381,4751,"
        "3992,7131,7172",
    ),
]
_CLI = ("annealing@2.2:0.1", "stochastic1.0")  # generate_dplm2.py's --sampling_strategy / --unmasking_strategy
SAMPLER_CASES: dict[str, dict] = {
    "co_generation_default": {"task": "co_generation", "seed": 0, "sampling": None, "unmasking": None},
    "co_generation_cli": {"task": "co_generation", "seed": 1, "sampling": _CLI[0], "unmasking": _CLI[1]},
    "co_generation_gumbel": {"task": "co_generation", "seed": 2, "sampling": "gumbel_argmax", "unmasking": _CLI[1]},
    "folding": {"task": "folding", "seed": 3, "sampling": "argmax", "unmasking": "deterministic"},
    "inverse_folding": {"task": "inverse_folding", "seed": 4, "sampling": "argmax", "unmasking": "deterministic"},
    "backbone_generation": {"task": "backbone_generation", "seed": 5, "sampling": _CLI[0], "unmasking": _CLI[1]},
    "sequence_generation": {"task": "sequence_generation", "seed": 6, "sampling": _CLI[0], "unmasking": _CLI[1]},
}
GENERATE_DEFAULTS = {
    "temperature": 1.0,
    "unmasking_strategy": "stochastic1.0",
    "sampling_strategy": "annealing@2.2:1.0",
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def official_files(tree: Path) -> list[Path]:
    """The official files the recipe runs (for the tree digest)."""
    src = tree / "src" / "byprot"
    return [
        src / "models" / "dplm2" / "dplm2.py",
        src / "models" / "dplm2" / "modules" / "dplm2_modeling_esm.py",
        src / "models" / "utils.py",
        src / "datamodules" / "dataset" / "tokenized_protein.py",
        tree / "generate_dplm2.py",
    ]


def tree_sha256(tree: Path) -> str:
    digest = hashlib.sha256()
    for path in official_files(tree):
        digest.update(path.relative_to(tree).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def locate_oracle(oracle: Path | None) -> Path:
    oracle = oracle_folder(oracle, "FASTPLMS_DPLM2_ORACLE", "setup_dplm2_env.sh")
    commit = (oracle / COMMIT_FILE).read_text().strip() if (oracle / COMMIT_FILE).is_file() else "?"
    if commit != COMMIT:
        raise SystemExit(f"{oracle}: official tree is at {commit}, the recipe needs {COMMIT}; run setup_dplm2_env.sh")
    if not all(p.is_file() for p in official_files(oracle / "tree")) or not (oracle / "venv/bin/python").is_file():
        raise SystemExit(f"{oracle}: incomplete oracle folder; run setup_dplm2_env.sh")
    if REPO_ROOT in (p.resolve() for p in [oracle, *oracle.parents]):
        raise SystemExit(f"{oracle}: the official code must live outside the repository")
    return oracle


# ============================================================================ official stage (oracle venv)


def _module(name: str, path: Path | None = None, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=path is not None)
    if path is not None:
        module.__path__ = [str(path)]
    for key, value in attrs.items():
        setattr(module, key, value)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def install_official_shim(tree: Path) -> None:
    """Make the official byprot modules in ``tree`` importable without ``byprot``'s package ``__init__`` files
    (which import every data, structure and training module). Shared with the DPLM network recipe
    (``tools/goldens/dplm.py``). Registers stub modules for packages the official files import at module level
    but never use for inference, and empty ``byprot`` namespace packages carrying the tree's ``__path__``s
    (``byprot.models.register_model`` fills ``byprot.models.MODEL_REGISTRY``). Import the official modules
    inside ``hashable_byprot_dataclasses()``."""
    import logging

    import transformers  # noqa: F401  (first: its availability probes must see the real environment)
    import transformers.models.esm.modeling_esm  # noqa: F401

    src = tree / "src" / "byprot"

    def unavailable(*_args, **_kwargs):
        raise RuntimeError("stubbed out by tools/goldens/dplm2.py: not needed for the DPLM2 forward or generate")

    # Stubs for modules the official files import at module level but never use for inference.
    _module("datasets", load_dataset=unavailable, Dataset=None)
    _module("pandas", read_csv=unavailable, concat=unavailable)
    _module("tree")  # dm-tree, imported by generate_dplm2.py

    class PeftModel:  # generate_dplm2.py only uses it in an issubclass test
        pass

    _module("peft", path=Path("/nonexistent"))
    _module("peft.peft_model", PeftModel=PeftModel)

    def parse_fasta(path, fmt):
        assert fmt == "fasta"
        name, lines = None, []
        for line in Path(path).read_text().splitlines() + [">"]:
            if line.startswith(">"):
                if name is not None:
                    yield types.SimpleNamespace(name=name, seq="".join(lines))
                name, lines = line[1:].split(" ")[0], []
            elif line.strip():
                lines.append(line.strip())

    _module("Bio", path=Path("/nonexistent"))
    _module("Bio.SeqIO", parse=parse_fasta)

    registry: dict = {}

    def register_model(name):
        def decorator(cls):
            registry[name] = cls
            return cls

        return decorator

    _module("byprot", path=src)
    _module("byprot.utils", get_logger=logging.getLogger, load_yaml_config=unavailable)
    _module("byprot.models", path=src / "models", MODEL_REGISTRY=registry, register_model=register_model)
    _module("byprot.models.dplm", path=src / "models" / "dplm")  # its __init__ would import dplm_invfold
    _module("byprot.models.dplm2", path=src / "models" / "dplm2")
    _module("byprot.datamodules", path=src / "datamodules")
    _module("byprot.datamodules.dataset", path=src / "datamodules" / "dataset")


@contextlib.contextmanager
def hashable_byprot_dataclasses():
    """While importing official modules, make dataclasses of ``byprot`` modules ``unsafe_hash=True``: Python
    3.11 rejects their unhashable instance defaults (``field(default=LoRAConfig())``) as mutable."""
    import dataclasses

    original = dataclasses.dataclass

    def dataclass_shim(cls=None, /, **kwargs):
        def wrap(klass):
            if klass.__module__.startswith("byprot"):
                kwargs.setdefault("unsafe_hash", True)
            return original(klass, **kwargs)

        return wrap if cls is None else wrap(cls)

    dataclasses.dataclass = dataclass_shim
    try:
        yield
    finally:
        dataclasses.dataclass = original


def import_official(tree: Path):
    """Import the official wrapper, network and CLI modules from ``tree`` through ``install_official_shim``.
    Returns (wrapper module, network module, generate_dplm2 module)."""
    install_official_shim(tree)
    with hashable_byprot_dataclasses():
        import byprot.models.dplm2.dplm2 as wrapper_module
        import byprot.models.dplm2.modules.dplm2_modeling_esm as network_module
    dplm2_pkg = sys.modules["byprot.models.dplm2"]
    dplm2_pkg.MultimodalDiffusionProteinLanguageModel = wrapper_module.MultimodalDiffusionProteinLanguageModel
    dplm2_pkg.DPLM2Bit = None  # generate_dplm2.py imports it; only --bit_model uses it
    spec = importlib.util.spec_from_file_location("generate_dplm2", tree / "generate_dplm2.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return wrapper_module, network_module, cli


class DrawLog:
    """Counts the RNG draws the official sampler makes (torch.rand_like and torch.multinomial, which
    Categorical.sample calls), in order, by wrapping the torch functions; the draws themselves are unchanged."""

    def __init__(self, torch):
        self.torch = torch
        self.draws: list[str] = []
        self.originals = {name: getattr(torch, name) for name in ("rand_like", "multinomial")}

    def __enter__(self):
        for name, fn in self.originals.items():

            def counted(*args, _fn=fn, _name=name, **kwargs):
                out = _fn(*args, **kwargs)
                shape = tuple(args[0].shape)
                self.draws.append(f"{_name}{list(shape)}")
                return out

            setattr(self.torch, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(self.torch, name, fn)


def official_network_batch(tokenizer, rows, torch):
    """The batch as the official CLI builds a packed batch: each track's strings with explicit specials
    (structure codes joined without commas, as ``initialize_conditional_generation`` does), encoded by the official
    tokenizer with ``add_special_tokens=False, padding="longest"``, the tracks concatenated; a single-track row
    is its track right-padded to the batch width."""
    width = 0
    encoded = []
    for structure, sequence in rows:
        parts = []
        if structure is not None:
            text = tokenizer.struct_cls_token + "".join(structure.split(",")) + tokenizer.struct_eos_token
            parts.append(text)
        if sequence is not None:
            parts.append(tokenizer.aa_cls_token + sequence + tokenizer.aa_eos_token)
        encoded.append(parts)
    packed_rows = [i for i, (s, a) in enumerate(rows) if s is not None and a is not None]
    out = [None] * len(rows)
    if packed_rows:
        struct = tokenizer.batch_encode_plus(
            [encoded[i][0] for i in packed_rows], add_special_tokens=False, padding="longest", return_tensors="pt"
        )["input_ids"]
        aa = tokenizer.batch_encode_plus(
            [encoded[i][1] for i in packed_rows], add_special_tokens=False, padding="longest", return_tensors="pt"
        )["input_ids"]
        packed = torch.cat([struct, aa], dim=1)
        for j, i in enumerate(packed_rows):
            out[i] = packed[j].tolist()
    for i, parts in enumerate(encoded):
        if out[i] is None:
            out[i] = tokenizer.batch_encode_plus(parts, add_special_tokens=False)["input_ids"][0]
    width = max(len(r) for r in out)
    return [r + [tokenizer._token_to_id[tokenizer.pad_token]] * (width - len(r)) for r in out]


def run_official(oracle: Path, work: Path, out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    t_start = time.perf_counter()
    tree = oracle / "tree"
    wrapper_module, network_module, cli = import_official(tree)
    inputs = json.loads((work / "inputs.json").read_text())
    snapshot = work / inputs["snapshot"]
    facts: dict = {"import_seconds": round(time.perf_counter() - t_start, 2)}

    # ---- build: the official from_pretrained path (AutoConfig.dplm_type -> EsmForDPLM2.from_pretrained -> wrapper)
    t0 = time.perf_counter()
    torch.manual_seed(SEED)  # the official init is overwritten by the load; seeded for tidiness only
    model = wrapper_module.MultimodalDiffusionProteinLanguageModel.from_pretrained(
        str(snapshot), cfg_override={"tokenizer": {"vocab_file": str(snapshot)}}
    )
    net = model.net
    facts["build_seconds"] = round(time.perf_counter() - t0, 2)
    assert type(net) is network_module.EsmForDPLM2, type(net)
    file_state = load_file(str(snapshot / "model.safetensors"))
    official_state = net.state_dict()
    official_spec = [[k, list(v.shape)] for k, v in official_state.items()]
    facts["official_state_keys"] = len(official_spec)
    facts["official_state_spec_equals_dplm2_official_spec"] = official_spec == inputs["spec"]
    facts["official_state_keys_not_in_file"] = sorted(set(official_state) - set(file_state))
    facts["file_keys_not_in_official_state"] = sorted(set(file_state) - set(official_state))
    facts["official_state_equals_file"] = all(
        torch.equal(official_state[k], file_state[k]) for k in set(official_state) & set(file_state)
    )
    facts["official_tie_word_embeddings"] = bool(net.config.tie_word_embeddings)
    facts["decoder_is_word_embeddings"] = net.lm_head.decoder.weight is net.esm.embeddings.word_embeddings.weight
    facts["hidden_dropout_prob"] = net.config.hidden_dropout_prob
    facts["contact_head_in_features"] = int(net.esm.contact_head.regression.in_features)
    if not facts["official_state_spec_equals_dplm2_official_spec"] or not facts["official_state_equals_file"]:
        raise SystemExit(f"official state layout differs from dplm2_official_spec: {facts}")
    del file_state, official_state

    # ---- tokenizer and wrapper facts
    tok = model.tokenizer
    vocab = [tok._id_to_token[i] for i in range(len(tok._id_to_token))]
    facts["official_vocab_size"] = len(tok)
    facts["official_vocab_equals_reconstructed"] = vocab == inputs["vocab"]
    facts["official_all_tokens_50"] = tok.all_tokens[50]
    names = [
        "aa_bos_id", "aa_eos_id", "aa_mask_id", "struct_bos_id", "struct_eos_id", "struct_mask_id", "pad_id",
        "aa_unk_id", "struct_unk_id", "aa_X_id", "aa_B_id", "aa_U_id", "aa_Z_id", "aa_O_id",
    ]  # fmt: skip
    facts["official_special_ids"] = {name: int(getattr(model, name)) for name in names}
    facts["official_special_token_list"] = [int(i) for i in model.special_token_list]
    facts["special_token_list_equals_SUPPRESSED_IDS"] = facts["official_special_token_list"] == inputs["suppressed_ids"]
    facts["official_generic_specials"] = {
        name: getattr(tok, name, None) for name in ("cls_token", "eos_token", "mask_token", "unk_token")
    }
    if not (facts["official_vocab_equals_reconstructed"] and facts["special_token_list_equals_SUPPRESSED_IDS"]):
        raise SystemExit(f"official tokenizer facts differ from ours: {facts}")

    # ---- (A) network: the official wrapper forward, with hooks observing it
    model.eval()
    captured: dict = {}
    calls = {"embeddings": 0}

    def count_embeddings(_module, _args, _out):
        calls["embeddings"] += 1

    def capture(name):
        def hook(_module, args):
            captured[name] = args[0].detach().clone()

        return hook

    hooks = [
        net.esm.embeddings.register_forward_hook(count_embeddings),
        net.esm.encoder.register_forward_pre_hook(capture(0)),
        *(net.esm.encoder.layer[i].register_forward_pre_hook(capture(i)) for i in HIDDEN_STATE_LAYERS[1:-1]),
    ]
    tensors: dict[str, torch.Tensor] = {"hidden_state_layers": torch.tensor(HIDDEN_STATE_LAYERS, dtype=torch.int64)}
    network_facts: dict = {}
    t0 = time.perf_counter()
    for name, batch in inputs["network_batches"].items():
        ids = torch.tensor(batch["input_ids"], dtype=torch.int64)
        rows = [tuple(r) for r in NETWORK_BATCHES[name]]
        cli_ids = official_network_batch(tok, rows, torch)
        type_ids = model.get_modality_type(ids)
        calls["embeddings"] = 0
        captured.clear()
        with torch.no_grad():
            result = model(input_ids=ids)
        logits, last = result["logits"], result["last_hidden_state"]
        hidden = [captured[0], *(captured[i] for i in HIDDEN_STATE_LAYERS[1:-1]), last]
        embedding_calls = calls["embeddings"]
        with torch.no_grad():
            again = model(input_ids=ids)
        facts_b = {
            "shape": list(ids.shape),
            "official_cli_batch_equals_pack": cli_ids == batch["input_ids"],
            "type_ids_equal_ours": type_ids.tolist() == batch["type_ids"],
            "split_rotary": bool((type_ids == 1).any() and (type_ids == 0).any()),
            "embedding_calls_per_forward": embedding_calls,
            "rerun_bitwise_equal": bool(torch.equal(again["logits"], logits)),
            "logits_dtype": str(logits.dtype),
        }
        if not (facts_b["official_cli_batch_equals_pack"] and facts_b["type_ids_equal_ours"]):
            raise SystemExit(f"{name}: official batch construction differs from DPLM2Tokenizer.pack: {facts_b}")
        # Batch dependence: each row alone (unpadded) against its row in the batch.
        alone = []
        for r in range(ids.shape[0]):
            row = ids[r : r + 1, : int(ids[r].ne(1).nonzero().max()) + 1]
            with torch.no_grad():
                single = model(input_ids=row)["logits"][0]
            width = row.shape[1]
            valid = ids[r, :width].ne(1)
            alone.append(float((single[valid] - logits[r, :width][valid]).abs().max()))
        facts_b["row_alone_vs_batch_max_abs_logits"] = alone
        network_facts[name] = facts_b
        tensors[f"{name}.input_ids"] = ids
        tensors[f"{name}.type_ids"] = type_ids.to(torch.int64)
        tensors[f"{name}.hidden_states"] = torch.stack(hidden)
        tensors[f"{name}.logits_head"] = logits[..., :LOGITS_HEAD]
        tensors[f"{name}.logits_tail"] = logits[..., -LOGITS_TAIL:]
        tensors[f"{name}.logits_argmax"] = logits.argmax(-1)
        tensors[f"{name}.logits_logsumexp"] = logits.logsumexp(-1)
    for h in hooks:
        h.remove()
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
    info = {"model": MODEL, "seed": SEED, "dplm_commit": COMMIT, "torch": versions["torch"]}
    # One metadata entry only: safetensors writes several keys in hash-map order, which breaks file hashes.
    save_file(tensors, str(out / NETWORK_FILE), metadata={"dplm2_golden": json.dumps(info, sort_keys=True)})

    # ---- (B) sampler
    t0 = time.perf_counter()
    device = torch.device("cpu")
    for fasta_name, records in (("folding.fasta", FOLDING_FASTA), ("inverse_folding.fasta", INVERSE_FOLDING_FASTA)):
        (work / fasta_name).write_text("".join(f">{n}\n{s}\n" for n, s in records))
    cases: dict = {}
    sampler_facts: dict = {}
    for name, case in SAMPLER_CASES.items():
        task = case["task"]
        partial = None
        if task in ("co_generation", "backbone_generation"):
            builder = (
                f"generate_dplm2.initialize_generation(task={task!r}, num_seqs=2, length={CO_GENERATION_LENGTH}, "
                "tokenizer, device='cpu', batch_size=2)[0]"
            )
            input_tokens = cli.initialize_generation(task, 2, CO_GENERATION_LENGTH, tok, device, batch_size=2)[0]
            if task == "backbone_generation":  # what unconditional_generate passes to generate for this task
                input_tokens = input_tokens.chunk(2, dim=1)[0]
                builder += ".chunk(2, dim=1)[0]  (unconditional_generate: backbone_generation keeps the struct half)"
        elif task == "sequence_generation":
            # generate_dplm2.initialize_generation raises for this task at this commit (create_init_seq returns a
            # string, then the loop reads the unset seq_struct); record that, and take the aa half of the
            # co-generation input, which is what unconditional_generate would pass.
            try:
                cli.initialize_generation(task, 2, CO_GENERATION_LENGTH, tok, device, batch_size=2)
                sampler_facts["sequence_generation_cli_raises"] = None
            except Exception as error:  # noqa: BLE001
                sampler_facts["sequence_generation_cli_raises"] = f"{type(error).__name__}: {error}"
            input_tokens = cli.initialize_generation(
                "co_generation", 2, CO_GENERATION_LENGTH, tok, device, batch_size=2
            )[0].chunk(2, dim=1)[1]
            builder = (
                f"generate_dplm2.initialize_generation(task='co_generation', num_seqs=2, length="
                f"{CO_GENERATION_LENGTH}, tokenizer, device='cpu', batch_size=2)[0].chunk(2, dim=1)[1]  "
                "(the CLI's own sequence_generation init raises at this commit)"
            )
        else:
            fasta = work / f"{task}.fasta"
            args = argparse.Namespace(task=task, batch_size=2)
            batches, names = cli.initialize_conditional_generation(str(fasta), tok, device, args=args, model=model)
            assert len(batches) == 1
            input_tokens, partial = batches[0]["input_tokens"], batches[0]["partial_mask"]
            builder = (
                f"generate_dplm2.initialize_conditional_generation({task}.fasta, tokenizer, device='cpu', "
                f"args=Namespace(task={task!r}, batch_size=2), model=model)[0][0]  (rows sorted by length: {names[0]})"
            )
        kwargs: dict = {"max_iter": MAX_ITER}
        if case["sampling"] is not None:
            kwargs.update(temperature=1.0, sampling_strategy=case["sampling"], unmasking_strategy=case["unmasking"])
        if partial is not None:
            kwargs["partial_masks"] = partial
        original_input = input_tokens.clone()
        torch.manual_seed(case["seed"])
        with DrawLog(torch) as log:
            output = model.generate(input_tokens=input_tokens, **kwargs)["output_tokens"]
        torch.manual_seed(case["seed"])
        rerun = model.generate(input_tokens=input_tokens.clone(), **kwargs)["output_tokens"]
        type_ids = model.get_modality_type(original_input)
        mutable = model.get_non_special_symbol_mask(original_input, partial_masks=partial)
        checks = constraint_checks(original_input, output, type_ids, mutable, inputs["suppressed_ids"], torch)
        checks["rerun_identical"] = bool(torch.equal(rerun, output))
        checks["input_unchanged_by_generate"] = bool(torch.equal(input_tokens, original_input))
        if not all(checks.values()):
            raise SystemExit(f"{name}: sampler checks failed: {checks}")
        strategies = {
            "temperature": kwargs.get("temperature", GENERATE_DEFAULTS["temperature"]),
            "sampling_strategy": kwargs.get("sampling_strategy", GENERATE_DEFAULTS["sampling_strategy"]),
            "unmasking_strategy": kwargs.get("unmasking_strategy", GENERATE_DEFAULTS["unmasking_strategy"]),
        }
        decoded = decode_official(tok, output, task)
        cases[name] = {
            "task": task,
            "builder": builder,
            "fasta": [list(r) for r in (FOLDING_FASTA if task == "folding" else INVERSE_FOLDING_FASTA)]
            if task in ("folding", "inverse_folding")
            else None,
            "seed": case["seed"],
            "max_iter": MAX_ITER,
            **strategies,
            "strategies_from": "generate() defaults (not passed)" if case["sampling"] is None else "passed explicitly",
            "call": "torch.manual_seed(seed); model.generate(input_tokens=input_tokens, "
            + ", ".join(
                f"{k}={v!r}" if k != "partial_masks" else "partial_masks=partial_mask" for k, v in kwargs.items()
            )
            + ')["output_tokens"]',
            "input_tokens": original_input.tolist(),
            "type_ids": type_ids.tolist(),
            "partial_mask": partial.tolist() if partial is not None else None,
            "mutable": mutable.tolist(),
            "output_tokens": output.tolist(),
            "decoded": decoded,
            "rng_draws": log.draws,
            "checks": checks,
        }
    facts["sampler_seconds"] = round(time.perf_counter() - t0, 2)
    facts["sampler"] = sampler_facts
    record = {
        "schema": 1,
        "model": MODEL,
        "upstream": {"repo": "bytedance/dplm", "commit": COMMIT, "tree_sha256": tree_sha256(tree)},
        "oracle": "MultimodalDiffusionProteinLanguageModel.generate (byprot/models/dplm2/dplm2.py) on "
        "MultimodalDiffusionProteinLanguageModel.from_pretrained(snapshot, cfg_override={'tokenizer': {'vocab_file': "
        "snapshot}}), CPU, FP32 (no autocast), torch.set_num_threads(1), deterministic algorithms",
        "weights": {
            "recipe": f"fastplms.oracles.dplm2.dplm2_official_state_dict{DIMS}, seed={SEED}",
            "state_sha256": inputs["state_sha256"],
            "dims": {"num_layers": DIMS[0], "hidden": DIMS[1], "heads": DIMS[2], "vocab": len(vocab)},
        },
        "versions": versions,
        "device": "cpu",
        "dtype": "float32",
        "threads": THREADS,
        "special_ids": facts["official_special_ids"],
        "suppressed_ids": facts["official_special_token_list"],
        "generate_defaults": GENERATE_DEFAULTS,
        "cases": cases,
    }
    (out / SAMPLER_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    facts["versions"] = versions
    facts["tree_sha256"] = record["upstream"]["tree_sha256"]
    facts["wall_seconds"] = round(time.perf_counter() - t_start, 2)
    facts["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    (work / "official_facts.json").write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")


def constraint_checks(inp, out, type_ids, mutable, suppressed, torch) -> dict[str, bool]:
    aa_pos = mutable & type_ids.eq(1)
    struct_pos = mutable & type_ids.eq(0)
    suppressed_hit = torch.isin(out, torch.tensor(suppressed))
    return {
        "no_masks_left": bool(~torch.isin(out, torch.tensor([32, 8228])).any()),
        "aa_positions_hold_aa_ids": bool((out[aa_pos] < 33).all()),
        "struct_positions_hold_struct_codes": bool(((out[struct_pos] >= 36) & (out[struct_pos] <= 8227)).all()),
        "suppressed_ids_never_emitted": bool(~(suppressed_hit & mutable).any()),
        "non_mutable_positions_unchanged": bool(torch.equal(out[~mutable], inp[~mutable])),
    }


def decode_official(tok, output, task) -> dict:
    """The strings the CLI's save_results writes (batch_decode with skip_special_tokens, joined by its rules)."""
    if task == "sequence_generation":
        return {"aa": ["".join(s.split()) for s in tok.batch_decode(output, skip_special_tokens=True)]}
    if task == "backbone_generation":
        return {"struct": [",".join(s.split()) for s in tok.batch_decode(output, skip_special_tokens=True)]}
    struct, aa = output.chunk(2, dim=-1)
    return {
        "struct": [",".join(s.split()) for s in tok.batch_decode(struct, skip_special_tokens=True)],
        "aa": ["".join(s.split()) for s in tok.batch_decode(aa, skip_special_tokens=True)],
    }


# ============================================================================ project stage (project venv)


def network_inputs(tokenizer) -> dict:
    """The network batches as our DPLM2Tokenizer builds them: the packed rows of a batch in one ``pack`` call
    (each track padded to its own longest), single-track rows alone; all right-padded to the batch width."""
    from fastplms.tokenization_dplm2 import PAD_ID, modality_type_ids

    batches = {}
    for name, rows in NETWORK_BATCHES.items():
        encoded: list[list[int] | None] = [None] * len(rows)
        packed = [i for i, (s, a) in enumerate(rows) if s is not None and a is not None]
        if packed:
            ids = tokenizer.pack([rows[i][0] for i in packed], [rows[i][1] for i in packed])["input_ids"]
            for i, row in zip(packed, ids, strict=True):
                encoded[i] = row
        for i, (structure, sequence) in enumerate(rows):
            if encoded[i] is None:
                structures = None if structure is None else [structure]
                sequences = None if sequence is None else [sequence]
                encoded[i] = tokenizer.pack(structures, sequences)["input_ids"][0]
        width = max(len(r) for r in encoded)
        ids = [r + [PAD_ID] * (width - len(r)) for r in encoded]
        types = [modality_type_ids(r) for r in ids]
        batches[name] = {"rows": [list(r) for r in rows], "input_ids": ids, "type_ids": types}
    return batches


def compare_in_env(state, network_path: Path) -> dict:
    """The in-environment oracle (Transformers 5.13) against the official network goldens, per batch."""
    import torch
    from safetensors.torch import load_file

    from fastplms.oracles.dplm2 import dplm2_transformers_network, run_dplm2_network

    torch.set_num_threads(THREADS)
    goldens = load_file(str(network_path))
    model = dplm2_transformers_network(state)
    result = {}
    for name in NETWORK_BATCHES:
        ids, types = goldens[f"{name}.input_ids"], goldens[f"{name}.type_ids"]
        logits, hidden = run_dplm2_network(model, ids, types)
        ours = {
            "hidden_states": torch.stack([hidden[i] for i in HIDDEN_STATE_LAYERS]),
            "logits_head": logits[..., :LOGITS_HEAD],
            "logits_tail": logits[..., -LOGITS_TAIL:],
            "logits_logsumexp": logits.logsumexp(-1),
        }
        entry = {k: float((v - goldens[f"{name}.{k}"]).abs().max()) for k, v in ours.items()}
        entry["logits_argmax_equal"] = bool(torch.equal(logits.argmax(-1), goldens[f"{name}.logits_argmax"]))
        entry["bitwise_equal"] = (
            all(torch.equal(v, goldens[f"{name}.{k}"]) for k, v in ours.items()) and entry["logits_argmax_equal"]
        )
        result[name] = entry
    return result


def generate(out_dir: Path, oracle: Path | None, work: Path | None) -> dict:
    from fastplms.oracles.dplm2 import (
        SUPPRESSED_IDS,
        dplm2_official_spec,
        dplm2_official_state_dict,
        dplm2_state_sha256,
        write_dplm2_snapshot,
    )
    from fastplms.tokenization_dplm2 import DPLM2_VOCAB, DPLM2Tokenizer, write_vocab

    oracle = locate_oracle(oracle)
    work = (work or oracle / "work").resolve()
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    t0 = time.perf_counter()
    state = dplm2_official_state_dict(*DIMS, seed=SEED)
    state_sha = dplm2_state_sha256(state)
    snapshot = write_dplm2_snapshot(work / f"{MODEL}_seed{SEED}", *DIMS, state=state)
    tokenizer = DPLM2Tokenizer(str(write_vocab(work / "vocab.txt", DPLM2_VOCAB)))
    inputs = {
        "snapshot": snapshot.name,
        "state_sha256": state_sha,
        "spec": [[k, list(v)] for k, v in dplm2_official_spec(*DIMS).items()],
        "vocab": list(DPLM2_VOCAB),
        "suppressed_ids": list(SUPPRESSED_IDS),
        "network_batches": network_inputs(tokenizer),
    }
    (work / "inputs.json").write_text(json.dumps(inputs) + "\n")
    prepare_seconds = round(time.perf_counter() - t0, 2)

    official_seconds = run_official_stage(
        oracle, "tools.goldens.dplm2", "--stage", "official", "--oracle", str(oracle),
        "--work", str(work), "--out", str(out_dir), cwd=REPO_ROOT,
    )  # fmt: skip
    official = json.loads((work / "official_facts.json").read_text())

    t0 = time.perf_counter()
    in_env = compare_in_env(state, out_dir / NETWORK_FILE)
    compare_seconds = round(time.perf_counter() - t0, 2)
    versions = {name: importlib.metadata.version(name) for name in ("torch", "transformers", "numpy", "safetensors")}
    manifest = {
        "recipe": "tools/goldens/dplm2.py",
        "command": "FASTPLMS_DPLM2_ORACLE=<oracle> .venv/bin/python -m tools.goldens.dplm2 --out tests/goldens/",
        "setup": "bash tools/goldens/setup_dplm2_env.sh <oracle> [<dplm git dir or clone URL>]",
        "oracle": "official bytedance/dplm DPLM2 wrapper + EsmForDPLM2 (transformers 4.39.2) in <oracle>/venv, "
        "imported from <oracle>/tree through an import shim; CPU FP32, 1 thread, deterministic algorithms",
        "upstream": {"repo": "bytedance/dplm", "commit": COMMIT, "tree_sha256": official["tree_sha256"]},
        "model": MODEL,
        "weights": {
            "recipe": f"fastplms.oracles.dplm2.dplm2_official_state_dict{DIMS}, seed={SEED}",
            "state_sha256": state_sha,
            "keys": len(state),
            "parameters": sum(v.numel() for v in state.values()),
        },
        "seed": SEED,
        "threads": THREADS,
        "max_iter": MAX_ITER,
        "versions_official": official["versions"],
        "versions_project": versions,
        "cpu_capability": official["cpu_capability"],
        "machine": platform.machine(),
        "panel": {"network_batches": {k: v["rows"] for k, v in inputs["network_batches"].items()}},
        "layout": LAYOUT,
        "models": {},
        "official_checks": {k: v for k, v in official.items() if not k.endswith("_seconds") and k != "versions"},
        "in_env_oracle": in_env,
        "seconds": {
            "prepare_weights_and_snapshot": prepare_seconds,
            "official_stage": official_seconds,
            "official_build": official["build_seconds"],
            "official_network": official["network_seconds"],
            "official_sampler": official["sampler_seconds"],
            "in_env_compare": compare_seconds,
        },
    }
    for name, file in (("dplm2_network", NETWORK_FILE), ("dplm2_sampler", SAMPLER_FILE)):
        path = out_dir / file
        manifest["models"][name] = {"file": file, "sha256": sha256(path), "bytes": path.stat().st_size}
        print(f"{name}: {path} {path.stat().st_size} B sha256={manifest['models'][name]['sha256']}", flush=True)
    for name, entry in in_env.items():
        print(f"in-env oracle vs official, {name}: {entry}", flush=True)
    del state
    manifest["wall_seconds_total"] = round(time.perf_counter() - start, 2)
    return manifest


LAYOUT = {
    "dplm2_network.safetensors": {
        "hidden_state_layers": "(3,) int64, [0, 15, 30]: indices into hidden_states (L + 1 entries: entry 0 the "
        "twice-embedded input = the official encoder's input, entry i the input of layer i, entry 30 the final "
        "LayerNorm output = the official last_hidden_state)",
        "<batch>.input_ids": "(B, L) int64, the batch (DPLM2Tokenizer.pack rows; single-track rows right-padded "
        "with <pad>=1), equal to the official CLI-style construction",
        "<batch>.type_ids": "(B, L) int64, the official get_modality_type (1 aa, 0 struct, 2 pad)",
        "<batch>.hidden_states": "(3, B, L, 640) float32, hidden_states[hidden_state_layers], every position "
        "(pads included: keys-only masking makes them defined)",
        "<batch>.logits_head": "(B, L, 64) float32, official logits at ids 0..63",
        "<batch>.logits_tail": "(B, L, 64) float32, official logits at ids 8165..8228",
        "<batch>.logits_argmax": "(B, L) int64, argmax over all 8229 ids",
        "<batch>.logits_logsumexp": "(B, L) float32, logsumexp over all 8229 ids",
        "batches": list(NETWORK_BATCHES),
    },
    "dplm2_sampler.json": "cases.<name>: task, builder, fasta, seed, max_iter, temperature, sampling_strategy, "
    "unmasking_strategy, strategies_from, call, input_tokens (B, L), type_ids, partial_mask (or null), mutable, "
    "output_tokens (B, L), decoded (the CLI's strings), rng_draws (torch.rand_like / torch.multinomial calls in "
    "order, with the shape of their input), checks",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "goldens")
    parser.add_argument("--oracle", type=Path, default=None, help="folder made by setup_dplm2_env.sh")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default <oracle>/work)")
    parser.add_argument(
        "--check", action="store_true", help="regenerate into a temporary folder and compare to --out's manifest"
    )
    parser.add_argument("--stage", choices=("all", "official"), default="all", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage == "official":
        run_official(args.oracle.resolve(), args.work.resolve(), args.out.resolve())
        return 0
    if not args.check:
        manifest = generate(args.out.resolve(), args.oracle, args.work)
        (args.out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return 0
    return check_against_committed(
        args.out / MANIFEST, GOLDENS, lambda folder: generate(folder.resolve(), args.oracle, args.work)
    )


if __name__ == "__main__":
    sys.exit(main())
