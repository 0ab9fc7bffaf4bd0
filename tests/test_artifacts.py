"""Hub artifacts: `fastplms build` / `verify` / `publish` on a seeded ESM2-8M snapshot at its real dimensions.

The seeded snapshots are not the pinned official weights, so builds pass `allow_unpinned=True`. One
artifact is built per module and shared. The two slow processes, one fresh offline load that serves all
the load checks and the one full `fastplms verify` (whose report the `publish` dry run reuses), start as
soon as that artifact exists and run while the in-process tests do.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from fresh_process import NO_FASTPLMS, offline_env
from safetensors.torch import load_file

import fastplms
from fastplms import cli
from fastplms.artifact import build as build_module
from fastplms.artifact import verify as verify_module
from fastplms.artifact.build import PROVENANCE, BuildError, build, build_all, runtime_closure, sha256_file
from fastplms.artifact.verify import check_hashes
from fastplms.manifest import REPO_ROOT, find_checkpoint
from fastplms.oracles.esm2 import write_fair_esm_pt, write_hf_snapshot

SRC = Path(fastplms.__file__).resolve().parent
SEED = 5
FAMILY, CHECKPOINT = find_checkpoint("esm2_8m")
DIMS = CHECKPOINT.dims
FAIR_FILE = "esm2_t6_8M_UR50D.pt"
SEQUENCES = ["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEV", "GSHMLDKWC", "ACDEFGHIKLMNPQRSTVWY"]


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process this module started, with whatever it started (its own process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --------------------------------------------------------------------------- shared inputs


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    return write_hf_snapshot(tmp_path_factory.mktemp("snapshots") / "hf", *DIMS, seed=SEED)


@pytest.fixture(scope="module")
def artifact(snapshot, tmp_path_factory) -> Path:
    return build("esm2_8m", snapshot, tmp_path_factory.mktemp("artifacts") / "ESM2-8M", allow_unpinned=True)


# --------------------------------------------------------------------------- what a build writes


def test_config_has_auto_map_backends_dtypes_and_no_attn_implementation(artifact):
    config = json.loads((artifact / "config.json").read_text())
    assert config["auto_map"] == dict(FAMILY.auto_classes)
    assert set(config["auto_map"]) >= {"AutoConfig", "AutoModel", "AutoModelForMaskedLM"}
    assert config["allowed_backends"] == list(FAMILY.backends)
    assert config["allowed_dtypes"] == list(FAMILY.dtypes)
    assert config["bf16_policy"] == FAMILY.bf16
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == DIMS
    assert not [key for key in config if "attn_implementation" in key], "the backend is the caller's choice"


def test_runtime_modules_are_exactly_the_closure_and_byte_identical(artifact):
    config = json.loads((artifact / "config.json").read_text())
    tokenizer_config = json.loads((artifact / "tokenizer_config.json").read_text())
    entries = {target.split(".")[0] for target in config["auto_map"].values()}
    entries |= {tokenizer_config["auto_map"]["AutoTokenizer"][0].split(".")[0]}
    closure = runtime_closure(entries)
    shipped = sorted(p.stem for p in artifact.glob("*.py"))
    assert shipped == closure
    assert {"modeling_esm2", "configuration_esm2", "tokenization_esm", "plm_base", "attention"} <= set(shipped)
    for name in shipped:
        assert (artifact / f"{name}.py").read_bytes() == (SRC / f"{name}.py").read_bytes(), name


def test_tokenizer_weights_and_kernels_lock(artifact, snapshot):
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        assert (artifact / name).is_file(), name
    assert (artifact / "kernels.lock").read_bytes() == (REPO_ROOT / "kernels.lock").read_bytes()
    assert not list(artifact.glob("*.bin")) and not (artifact / "model.safetensors.index.json").exists()
    weights = load_file(str(artifact / "model.safetensors"))
    assert weights and all(t.dtype == torch.float32 for t in weights.values())
    # Converted, not copied: same numbers, our key names.
    source = load_file(str(snapshot / "model.safetensors"))
    assert torch.equal(weights["esm.embed_tokens.weight"], source["esm.embeddings.word_embeddings.weight"])


def test_model_card(artifact):
    card = (artifact / "README.md").read_text()
    assert card.startswith("---\nlicense: mit\n")
    assert "License: MIT" in card
    assert 'from_pretrained("<this repo>", trust_remote_code=True' in card
    assert "AutoTokenizer.from_pretrained" in card
    for backend in FAMILY.backends:
        assert f"`{backend}`" in card, backend
    assert FAMILY.citation.strip() in card and "## Citation" in card
    assert "These weights are not the pinned official ones" in card


def test_provenance(artifact, snapshot):
    record = json.loads((artifact / PROVENANCE).read_text())
    source = CHECKPOINT.source("transformers")
    assert record["checkpoint"] == "esm2_8m" and record["published"] == "ESM2-8M"
    assert record["source"]["kind"] == "transformers"
    assert (record["source"]["repo"], record["source"]["revision"]) == (source.repo, source.revision)
    assert record["inputs"] == {
        "config.json": sha256_file(snapshot / "config.json"),
        "model.safetensors": sha256_file(snapshot / "model.safetensors"),
    }
    assert record["transform"] == FAMILY.transform
    assert record["builder"] == f"fastplms {fastplms.__version__}"
    assert record["official_weights"] is False and record["unpinned_files"] == ["model.safetensors"]
    on_disk = {p.name: sha256_file(p) for p in artifact.iterdir() if p.name != PROVENANCE}
    assert record["files"] == on_disk
    assert check_hashes(artifact) == []


def test_pinned_snapshot_builds_without_allow_unpinned_and_is_marked_official(snapshot, tmp_path, monkeypatch):
    # Pin the seeded snapshot's own hash: the pin check, not anything else, is what refuses it normally.
    source = CHECKPOINT.source("transformers")
    pinned = dataclasses.replace(source, files={"model.safetensors": sha256_file(snapshot / "model.safetensors")})
    checkpoint = dataclasses.replace(
        CHECKPOINT, sources=tuple(pinned if s is source else s for s in CHECKPOINT.sources)
    )
    monkeypatch.setattr(build_module, "find_checkpoint", lambda model_id: (FAMILY, checkpoint))
    out = build("esm2_8m", snapshot, tmp_path / "out")
    record = json.loads((out / PROVENANCE).read_text())
    assert record["official_weights"] is True and record["unpinned_files"] == []
    assert "not the pinned official" not in (out / "README.md").read_text()


def test_sharded_weights(artifact, snapshot, tmp_path, monkeypatch):
    from fastplms.modeling_esm2 import ESM2ForMaskedLM

    monkeypatch.setattr(build_module, "SHARD_BYTES", 4 * 1024**2)
    out = build("esm2_8m", snapshot, tmp_path / "sharded", allow_unpinned=True)
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert all(p.stat().st_size <= 4 * 1024**2 + 64 * 1024 for p in shards)
    whole = load_file(str(artifact / "model.safetensors"))
    parts: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors = load_file(str(shard))
        assert all(index["weight_map"][key] == shard.name for key in tensors)
        assert not set(tensors) & set(parts)
        parts |= tensors
    assert parts.keys() == whole.keys() == index["weight_map"].keys()
    assert all(torch.equal(parts[key], whole[key]) for key in whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    record = json.loads((out / PROVENANCE).read_text())
    assert sorted(record["weights"]) == sorted([p.name for p in shards] + ["model.safetensors.index.json"])
    assert check_hashes(out) == []
    # Transformers loads the index like any sharded checkpoint.
    sharded_model, single_model = (ESM2ForMaskedLM.from_pretrained(d) for d in (out, artifact))
    single = single_model.state_dict()
    assert all(torch.equal(value, single[key]) for key, value in sharded_model.state_dict().items())


# --------------------------------------------------------------------------- refusals


def test_refuses_unpinned_snapshot_without_allow_unpinned(snapshot, tmp_path):
    with pytest.raises(BuildError, match="--allow-unpinned") as info:
        build("esm2_8m", snapshot, tmp_path / "out")
    assert "model.safetensors" in str(info.value) and "pinned" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no output, no staging left behind


def test_refuses_missing_files(snapshot, tmp_path):
    with pytest.raises(BuildError, match="is not a directory"):
        build("esm2_8m", tmp_path / "nowhere", tmp_path / "o1", allow_unpinned=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BuildError, match=f"neither a Transformers snapshot.*{re.escape(FAIR_FILE)}"):
        build("esm2_8m", empty, tmp_path / "o2", allow_unpinned=True)
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copyfile(snapshot / "config.json", config_only / "config.json")
    with pytest.raises(BuildError, match="has no model.safetensors or pytorch_model.bin"):
        build("esm2_8m", config_only, tmp_path / "o3", allow_unpinned=True)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (config_only / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(BuildError, match="missing: model-00001-of-00002.safetensors, model-00002-of-00002"):
        build("esm2_8m", config_only, tmp_path / "o4", allow_unpinned=True)
    fair = tmp_path / "fair"
    fair.mkdir()
    (fair / FAIR_FILE).write_bytes(b"not read before the layout is complete")
    with pytest.raises(BuildError, match="missing: esm2_t6_8M_UR50D-contact-regression.pt"):
        build("esm2_8m", fair, tmp_path / "o5", allow_unpinned=True)
    assert not any(tmp_path.glob("o*"))


def test_refuses_wrong_dimensions(snapshot, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    config = json.loads((snapshot / "config.json").read_text())
    config |= {"num_hidden_layers": 12, "hidden_size": 480}
    (wrong / "config.json").write_text(json.dumps(config))
    shutil.copyfile(snapshot / "model.safetensors", wrong / "model.safetensors")
    with pytest.raises(BuildError, match="does not match esm2_8m") as info:
        build("esm2_8m", wrong, tmp_path / "out", allow_unpinned=True)
    assert "num_hidden_layers is 12, expected 6" in str(info.value)
    assert "hidden_size is 480, expected 320" in str(info.value)


def test_refuses_symlink_escaping_the_snapshot(snapshot, tmp_path):
    linked = tmp_path / "linked"
    linked.mkdir()
    shutil.copyfile(snapshot / "config.json", linked / "config.json")
    (linked / "model.safetensors").symlink_to(snapshot / "model.safetensors")
    with pytest.raises(BuildError, match="model.safetensors is a symlink escaping the snapshot"):
        build("esm2_8m", linked, tmp_path / "out", allow_unpinned=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("from ..x import y\n", r"'from \.\.x import \.\.\.' is not a single-dot import"),
        ("from .pkg.sub import y\n", r"'from \.pkg\.sub import \.\.\.' is not a single-dot import"),
        ("from . import helper\n", r"'from \. import \.\.\.' is not a single-dot import"),
        ("import numpy\n", "entry.py imports numpy"),
        ("import fastplms.artifact.build\n", "entry.py imports fastplms"),
        ("from fastplms import build\n", "entry.py imports fastplms"),
        ("from .helper import y\n", "helper.py imports numpy"),  # found through a sibling
        ("from .absent import y\n", "runtime module 'absent' does not exist"),
    ],
)
def test_runtime_closure_refuses_foreign_imports(tmp_path, source, message):
    (tmp_path / "entry.py").write_text("import os\nimport torch\n" + source)
    (tmp_path / "helper.py").write_text("def f():\n    import numpy\n")
    with pytest.raises(BuildError, match=message):
        runtime_closure(["entry"], tmp_path)


def test_runtime_closure_follows_single_dot_imports(tmp_path):
    (tmp_path / "entry.py").write_text("from __future__ import annotations\nimport json\nfrom .a import x\n")
    (tmp_path / "a.py").write_text("import torch\nimport transformers.utils\n\ndef g():\n    from .b import y\n")
    (tmp_path / "b.py").write_text("from safetensors.torch import load_file\nfrom .a import x\n")
    (tmp_path / "unused.py").write_text("import numpy\n")
    assert runtime_closure(["entry"], tmp_path) == ["a", "b", "entry"]


def test_refuses_foreign_output_directory_unless_forced_and_rebuilds_over_a_build(artifact, snapshot, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(BuildError, match="is not a previous fastplms build; pass --force"):
        build("esm2_8m", snapshot, foreign, allow_unpinned=True)
    assert _files(foreign) == {"notes.txt": b"mine"}
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(BuildError, match="is not a previous fastplms build"):
        build("esm2_8m", snapshot, a_file, allow_unpinned=True)

    # Deterministic: a second build is byte-identical, every file.
    again = build("esm2_8m", snapshot, tmp_path / "again", allow_unpinned=True)
    expected = _files(artifact)
    assert _files(again) == expected
    # A previous build is replaced in place without --force (stale files go).
    (again / "stale.txt").write_text("old")
    _flip_byte(again / "modeling_esm2.py")
    assert build("esm2_8m", snapshot, again, allow_unpinned=True) == again
    assert _files(again) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "again", "foreign"]


def test_stages_beside_the_output_so_the_final_move_never_crosses_filesystems(snapshot, tmp_path, monkeypatch):
    # os.replace fails with EXDEV across filesystems (a tmpfs /tmp); emulate that for any move between folders.
    real_replace = os.replace

    def same_folder_only(src, dst):
        if Path(src).parent != Path(dst).parent:
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", same_folder_only)
    out = tmp_path / "new" / "nested" / "ESM2-8M"
    assert build("esm2_8m", snapshot, out, allow_unpinned=True) == out
    assert check_hashes(out) == []
    assert [p.name for p in out.parent.iterdir()] == ["ESM2-8M"]  # no staging folder left behind


# --------------------------------------------------------------------------- other layouts, build_all


def test_fair_esm_layout_builds_the_same_weights(artifact, tmp_path):
    fair = tmp_path / "fair"
    write_fair_esm_pt(fair / FAIR_FILE, *DIMS, seed=SEED)
    assert {p.name for p in fair.iterdir()} == {FAIR_FILE, "esm2_t6_8M_UR50D-contact-regression.pt"}
    out = build("esm2_8m", fair, tmp_path / "out", allow_unpinned=True)
    record = json.loads((out / PROVENANCE).read_text())
    assert record["source"]["kind"] == "fair-esm" and record["source"]["file"] == FAIR_FILE
    assert set(record["inputs"]) == {FAIR_FILE, "esm2_t6_8M_UR50D-contact-regression.pt"}
    assert record["unpinned_files"] == [FAIR_FILE]
    ours, hf = load_file(str(out / "model.safetensors")), load_file(str(artifact / "model.safetensors"))
    assert ours.keys() == hf.keys()
    assert all(torch.equal(ours[key], hf[key]) for key in hf)
    assert (out / "config.json").read_bytes() == (artifact / "config.json").read_bytes()


def test_build_all_builds_present_snapshots(artifact, snapshot, tmp_path):
    root = tmp_path / "snapshots"
    root.mkdir()
    shutil.copytree(snapshot, root / "ESM2-8M")  # the published name (the id works too, see the CLI test)
    (root / "not_a_checkpoint").mkdir()
    built = build_all(root, tmp_path / "out", allow_unpinned=True)
    assert built == [tmp_path / "out" / "ESM2-8M"]
    assert _files(built[0]) == _files(artifact)
    empty = tmp_path / "none"
    empty.mkdir()
    assert build_all(empty, tmp_path / "out2", allow_unpinned=True) == []


# --------------------------------------------------------------------------- CLI


def test_cli_build(artifact, snapshot, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["build", "esm2_8m", "--snapshot", str(snapshot), "--out", str(out), "--allow-unpinned"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert _files(out) == _files(artifact)

    assert cli.main(["build", "esm2_8m", "--snapshot", str(snapshot), "--out", str(tmp_path / "x")]) != 0
    assert "--allow-unpinned" in capsys.readouterr().err

    assert cli.main(["build", "esm2_9m", "--snapshot", str(snapshot), "--out", str(tmp_path / "y")]) != 0
    err = capsys.readouterr().err
    assert "unknown model id 'esm2_9m'" in err
    assert all(c.id in err for c in FAMILY.checkpoints)

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    args = ["build", "ESM2-8M", "--snapshot", str(snapshot), "--out", str(foreign), "--allow-unpinned"]
    assert cli.main(args) != 0
    assert "--force" in capsys.readouterr().err
    assert cli.main([*args, "--force"]) == 0
    assert capsys.readouterr().out.strip() == str(foreign)
    assert _files(foreign) == _files(artifact)

    root = tmp_path / "snapshots"
    root.mkdir()
    shutil.copytree(snapshot, root / "esm2_8m")
    all_args = ["build", "--all", "--out", str(tmp_path / "all"), "--allow-unpinned"]
    assert cli.main([*all_args, "--snapshots", str(root)]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "all" / "ESM2-8M")]
    assert check_hashes(tmp_path / "all" / "ESM2-8M") == []
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    assert cli.main([*all_args, "--snapshots", str(nothing)]) == 1
    assert "no snapshot folders" in capsys.readouterr().err


# --------------------------------------------------------------------------- fresh-process load

# Runs in a fresh offline interpreter with fastplms unimportable: the artifact must work by itself.
FRESH_SCRIPT = (
    NO_FASTPLMS
    + r"""import json, os, sys

report = {}
try:
    import fastplms  # noqa: F401
    report["fastplms_blocked"] = False
except ImportError:
    report["fastplms_blocked"] = True

import torch
import transformers
from safetensors.torch import save_file

artifact, out = sys.argv[1], sys.argv[2]
sequences = json.loads(sys.argv[3])
tensors = {}

try:
    transformers.AutoModel.from_pretrained(artifact)
    report["without_trust"] = None
except ValueError as exc:
    report["without_trust"] = str(exc)
try:
    transformers.AutoModel.from_pretrained(artifact, trust_remote_code=True, attn_implementation="flex")
    report["flex_name"] = None
except ValueError as exc:
    report["flex_name"] = str(exc)

config = transformers.AutoConfig.from_pretrained(artifact, trust_remote_code=True)
report["config"] = type(config).__module__ + "." + type(config).__name__
tokenizer = transformers.AutoTokenizer.from_pretrained(artifact, trust_remote_code=True)
report["tokenizer"] = type(tokenizer).__module__ + "." + type(tokenizer).__name__
batch = tokenizer(sequences, padding=True, return_tensors="pt")
tensors["input_ids"], tensors["attention_mask"] = batch["input_ids"], batch["attention_mask"]

report["classes"] = {}
models = {}
for name in sorted(config.auto_map):
    if name == "AutoConfig":
        continue
    torch.manual_seed(0)  # heads absent from the checkpoint are initialised; the test process does the same
    model = getattr(transformers, name).from_pretrained(artifact, trust_remote_code=True).eval()
    with torch.no_grad():
        output = model(**batch)
    tensor = output.logits if getattr(output, "logits", None) is not None else output.last_hidden_state
    tensors[name] = tensor
    models[name] = model
    report["classes"][name] = {
        "class": type(model).__name__,
        "module": type(model).__module__,
        "backend": model.config._attn_implementation,
    }

mlm = models["AutoModelForMaskedLM"]
report["backends"] = {}
for backend in ("eager", "flex_attention", "sdpa"):
    mlm.set_attn_implementation(backend)
    report["backends"][backend] = [mlm.config._attn_implementation, mlm.attention_backend()]
    with torch.no_grad():
        tensors["backend_" + backend] = mlm(**batch).logits

saved = os.path.join(out, "saved")
mlm.save_pretrained(saved)
report["saved_files"] = sorted(os.listdir(saved))
reloaded = transformers.AutoModelForMaskedLM.from_pretrained(saved, trust_remote_code=True).eval()
report["reloaded_module"] = type(reloaded).__module__
before, after = mlm.state_dict(), reloaded.state_dict()
report["reloaded_keys_equal"] = sorted(before) == sorted(after)
report["reloaded_weights_equal"] = all(torch.equal(before[k], after[k]) for k in before if k in after)
with torch.no_grad():
    tensors["reloaded"] = reloaded(**batch).logits

report["fastplms_imported"] = any(m == "fastplms" or m.startswith("fastplms.") for m in sys.modules)
save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "tensors.safetensors"))
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f)
"""
)


@pytest.fixture(scope="module")
def fresh_process(artifact, tmp_path_factory):
    """The fresh offline process running FRESH_SCRIPT on the artifact: (Popen, work folder)."""
    work = tmp_path_factory.mktemp("fresh")
    (work / "modules").mkdir()
    (work / "out").mkdir()
    script = work / "load_artifact.py"
    script.write_text(FRESH_SCRIPT)
    with open(work / "stdout.txt", "w") as stdout, open(work / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(artifact), str(work / "out"), json.dumps(SEQUENCES)],
            env=offline_env(work / "modules"),
            cwd=work,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # its own process group, so teardown can stop it and its children
        )
    yield proc, work
    _stop(proc)


@pytest.fixture(scope="module", autouse=True)
def _start_slow_processes_early(fresh_process, verify_process):
    """Start the slow fresh-process loads once the artifact exists; they run alongside the other tests."""


@pytest.fixture(scope="module")
def fresh(fresh_process):
    """(report, tensors) of one fresh offline process that exercises the artifact without fastplms."""
    proc, work = fresh_process
    returncode = proc.wait(timeout=600)
    assert returncode == 0, (work / "stderr.txt").read_text()[-6000:]
    report = json.loads((work / "out" / "report.json").read_text())
    return report, load_file(str(work / "out" / "tensors.safetensors"))


def test_fresh_process_cannot_import_fastplms(fresh):
    report, _ = fresh
    assert report["fastplms_blocked"] is True
    assert report["fastplms_imported"] is False


def test_fresh_process_every_auto_class_matches_source_exactly(fresh, artifact):
    from fastplms.tokenization_esm import ESMTokenizer

    report, tensors = fresh
    config = json.loads((artifact / "config.json").read_text())
    advertised = set(config["auto_map"]) - {"AutoConfig"}
    assert set(report["classes"]) == advertised
    assert report["config"].endswith(".configuration_esm2.ESM2Config")
    assert report["tokenizer"].endswith(".tokenization_esm.ESMTokenizer")
    assert not report["tokenizer"].startswith("fastplms")

    ids, mask = tensors["input_ids"], tensors["attention_mask"]
    expected = ESMTokenizer.from_pretrained(str(artifact))(SEQUENCES, padding=True, return_tensors="pt")
    assert torch.equal(ids, expected["input_ids"]) and torch.equal(mask, expected["attention_mask"])
    assert int(mask.sum()) == sum(len(s) + 2 for s in SEQUENCES)

    for name in sorted(advertised):
        module_name, class_name = config["auto_map"][name].split(".")
        info = report["classes"][name]
        assert info["class"] == class_name and info["backend"] == "sdpa"
        assert info["module"].startswith("transformers_modules.") and info["module"].endswith(module_name)
        source_cls = getattr(importlib.import_module(f"fastplms.{module_name}"), class_name)
        torch.manual_seed(0)
        model = source_cls.from_pretrained(str(artifact)).eval()
        with torch.no_grad():
            output = model(input_ids=ids, attention_mask=mask)
        tensor = output.logits if getattr(output, "logits", None) is not None else output.last_hidden_state
        assert tensor.shape == tensors[name].shape, name
        assert torch.isfinite(tensor).all(), name
        assert torch.equal(tensor, tensors[name]), f"{name}: max abs diff {(tensor - tensors[name]).abs().max()}"


def test_fresh_process_switches_backends(fresh):
    report, tensors = fresh
    assert report["backends"] == {b: [b, b] for b in ("eager", "flex_attention", "sdpa")}
    reference = tensors["AutoModelForMaskedLM"]
    assert torch.equal(tensors["backend_sdpa"], reference)
    valid = tensors["attention_mask"].bool()
    for backend in ("eager", "flex_attention"):
        torch.testing.assert_close(tensors[f"backend_{backend}"][valid], reference[valid], atol=1e-5, rtol=1e-5)


def test_fresh_process_save_pretrained_round_trip(fresh):
    report, tensors = fresh
    assert {"config.json", "model.safetensors", "modeling_esm2.py", "configuration_esm2.py"} <= set(
        report["saved_files"]
    )
    assert report["reloaded_module"].startswith("transformers_modules.")
    assert report["reloaded_keys_equal"] and report["reloaded_weights_equal"]
    assert torch.equal(tensors["reloaded"], tensors["AutoModelForMaskedLM"])


def test_fresh_process_refusals(fresh):
    report, _ = fresh
    assert report["without_trust"] is not None and "trust_remote_code" in report["without_trust"]
    message = report["flex_name"]
    assert message is not None and "'flex'" in message
    assert all(name in message for name in FAMILY.backends)


# --------------------------------------------------------------------------- verify and publish


@pytest.fixture
def no_uploads(monkeypatch):
    calls = []

    def refuse(name):
        def method(self, *args, **kwargs):
            calls.append(name)
            raise AssertionError(f"HfApi.{name} called")

        return method

    for name in ("create_repo", "upload_folder", "upload_file", "create_commit", "upload_large_folder"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, refuse(name))
    return calls


@pytest.fixture(scope="module")
def verify_process(artifact, tmp_path_factory):
    """`fastplms verify <artifact>` as a user runs it, in its own process (the file's only full verify)."""
    work = tmp_path_factory.mktemp("verify")
    with open(work / "stdout.txt", "w") as stdout, open(work / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fastplms.cli", "verify", str(artifact)],
            cwd=work,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # its own process group, so teardown can stop it and its children
        )
    yield proc, work
    _stop(proc)


@pytest.fixture(scope="module")
def cli_verify(verify_process):
    """(exit code, stdout, stderr, load report) of `fastplms verify` on the shared artifact."""
    proc, work = verify_process
    code = proc.wait(timeout=600)
    out, err = (work / "stdout.txt").read_text(), (work / "stderr.txt").read_text()
    report = json.loads(out[: out.rindex("}") + 1]) if "}" in out else None
    return code, out, err, report


def test_cli_verify_good_build(artifact, cli_verify):
    code, out, err, report = cli_verify
    assert code == 0, err
    assert f"OK {artifact}" in out
    assert set(report["auto_classes"]) == set(FAMILY.auto_classes) - {"AutoConfig"}
    for name, entry in report["auto_classes"].items():
        assert entry["finite"] and entry["module"].startswith("transformers_modules."), name
    assert check_hashes(artifact) == []  # loading wrote nothing into the artifact


def test_cli_publish_dry_run_lists_files_and_uploads_nothing(artifact, cli_verify, capsys, no_uploads, monkeypatch):
    # The fresh-process load of this very artifact already ran (cli_verify); publish reuses its report.
    assert cli_verify[0] == 0, cli_verify[2]
    loads = []
    monkeypatch.setattr(verify_module, "load_in_fresh_process", lambda path: loads.append(path) or cli_verify[3])
    assert cli.main(["publish", str(artifact), "--repo", "org/name"]) == 0
    assert loads == [artifact], "publish must verify (hashes and a fresh-process load) first"
    captured = capsys.readouterr()
    assert "dry run" in captured.out and "https://huggingface.co/org/name" in captured.out
    listed = dict(reversed(m.groups()) for m in re.finditer(r"^\s+(sha256:[0-9a-f]{64})\s+(\S+)$", captured.out, re.M))
    assert listed == {p.name: sha256_file(p) for p in artifact.iterdir()}
    assert "NOT the pinned official" in captured.err
    assert no_uploads == []


def test_publish_refuses_when_the_fresh_load_fails(artifact, capsys, no_uploads, monkeypatch):
    def broken(path):
        raise RuntimeError(f"loading {path} in a fresh process failed: boom")

    monkeypatch.setattr(verify_module, "load_in_fresh_process", broken)
    for extra in ([], ["--yes"]):
        assert cli.main(["publish", str(artifact), "--repo", "org/name", *extra]) != 0
        captured = capsys.readouterr()
        assert "refusing to publish" in captured.err and "boom" in captured.err
        assert "sha256:" not in captured.out
    assert no_uploads == []


@pytest.mark.parametrize("tamper", ["flip_weights", "flip_module", "add_file", "remove_file", "no_provenance"])
def test_tampered_build_fails_verify_and_publish(artifact, tmp_path, capsys, no_uploads, monkeypatch, tamper):
    def never(path):
        raise AssertionError("a folder that fails its hash check must not be loaded")

    monkeypatch.setattr(verify_module, "load_in_fresh_process", never)
    copy = Path(shutil.copytree(artifact, tmp_path / "copy"))
    expected = {
        "flip_weights": "hash mismatch: model.safetensors",
        "flip_module": "hash mismatch: modeling_esm2.py",
        "add_file": "file not in provenance: extra.py",
        "remove_file": "missing file: vocab.txt",
        "no_provenance": "it is not a fastplms build",
    }[tamper]
    if tamper == "flip_weights":
        _flip_byte(copy / "model.safetensors", offset=(copy / "model.safetensors").stat().st_size // 2)
    elif tamper == "flip_module":
        _flip_byte(copy / "modeling_esm2.py")
    elif tamper == "add_file":
        (copy / "extra.py").write_text("print('hi')\n")
    elif tamper == "remove_file":
        (copy / "vocab.txt").unlink()
    else:
        (copy / PROVENANCE).unlink()
    assert cli.main(["verify", str(copy)]) != 0
    assert expected in capsys.readouterr().err
    for extra in ([], ["--yes"]):
        assert cli.main(["publish", str(copy), "--repo", "org/name", *extra]) != 0
        err = capsys.readouterr().err
        assert "refusing to publish" in err and expected in err
    assert no_uploads == []
