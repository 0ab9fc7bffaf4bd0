"""Manifest loader: the real manifests load, and each broken manifest fails naming file and key."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import fastplms
from fastplms.manifest import (
    BACKENDS,
    MANIFEST_DIR,
    Family,
    ManifestError,
    find_checkpoint,
    load_all,
    load_manifest,
    resolve_auto_classes,
)

MANIFESTS = sorted(MANIFEST_DIR.glob("*.toml"))
ESM2 = MANIFEST_DIR / "esm2.toml"

# Written down independently of the manifest (ESM2 paper / facebook Hub cards), so a typo there fails:
# id -> (published, num_layers, hidden_size, num_heads, official Hub repo)
ESM2_FACTS = {
    "esm2_8m": ("ESM2-8M", 6, 320, 20, "facebook/esm2_t6_8M_UR50D"),
    "esm2_35m": ("ESM2-35M", 12, 480, 20, "facebook/esm2_t12_35M_UR50D"),
    "esm2_150m": ("ESM2-150M", 30, 640, 20, "facebook/esm2_t30_150M_UR50D"),
    "esm2_650m": ("ESM2-650M", 33, 1280, 20, "facebook/esm2_t33_650M_UR50D"),
    "esm2_3b": ("ESM2-3B", 36, 2560, 40, "facebook/esm2_t36_3B_UR50D"),
}


# ---------------------------------------------------------------------------- the real manifests


def test_manifest_dir_holds_esm2() -> None:
    assert ESM2 in MANIFESTS


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.stem)
def test_real_manifest_loads(path: Path) -> None:
    family = load_manifest(path, resolve=False)
    assert family.id == path.stem
    assert family.representative_checkpoint.id == family.representative
    assert set(family.backends) <= set(BACKENDS)
    for checkpoint in family.checkpoints:
        assert checkpoint.hidden_size % checkpoint.num_heads == 0
        assert checkpoint.sources, checkpoint.id


def test_backend_names_mirror_the_attention_facade() -> None:
    # The loader keeps its own copy so that reading a manifest needs neither torch nor the runtime.
    from fastplms.attention import ATTENTION_BACKENDS

    assert BACKENDS == ATTENTION_BACKENDS


def test_load_all_matches_files() -> None:
    families = load_all(resolve=False)
    assert sorted(families) == [p.stem for p in MANIFESTS]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.stem)
def test_real_auto_classes_resolve(path: Path) -> None:
    family = load_manifest(path, resolve=False)
    modules = {target.split(".")[0] for target in family.auto_classes.values()}
    missing = sorted(m for m in modules if importlib.util.find_spec(f"fastplms.{m}") is None)
    if missing:
        pytest.skip(f"runtime modules not written yet: {missing}")
    resolved = resolve_auto_classes(family)
    assert set(resolved) == set(family.auto_classes)


def test_esm2_checkpoints_have_documented_dims() -> None:
    family = load_manifest(ESM2, resolve=False)
    assert [c.id for c in family.checkpoints] == list(ESM2_FACTS)
    for checkpoint in family.checkpoints:
        published, layers, hidden, heads, repo = ESM2_FACTS[checkpoint.id]
        assert (
            checkpoint.published,
            checkpoint.num_layers,
            checkpoint.hidden_size,
            checkpoint.num_heads,
        ) == (
            published,
            layers,
            hidden,
            heads,
        )
        assert checkpoint.license == "MIT"
        hub = checkpoint.source("transformers")
        assert hub.repo == repo
        assert hub.revision is not None
        # The official names encode the depth (esm2_t<layers>_...), and fair-esm uses the same stem.
        stem = repo.split("/")[1]
        assert stem.startswith(f"esm2_t{layers}_")
        assert checkpoint.source("fair-esm").file == f"{stem}.pt"


def test_family_conveniences() -> None:
    family = load_manifest(ESM2, resolve=False)
    assert family.backends == BACKENDS
    assert family.dtypes == ("float32", "bfloat16")
    assert family.bf16 == "autocast"
    assert family.checkpoint("esm2_35m").hidden_size == 480
    assert family.representative_checkpoint.id == "esm2_8m"
    assert family.upstream.repo == "facebookresearch/esm"
    with pytest.raises(ManifestError, match=r"esm2\.toml: checkpoints: .*esm2_8m"):
        family.checkpoint("esm2_15b")
    with pytest.raises(KeyError, match="torch-hub"):
        family.checkpoint("esm2_8m").source("torch-hub")


@pytest.mark.parametrize("model_id", ["esm2_650m", "ESM2-650M"])
def test_find_checkpoint_by_id_or_published_name(model_id: str) -> None:
    family, checkpoint = find_checkpoint(model_id)
    assert (family.id, checkpoint.id) == ("esm2", "esm2_650m")


def test_find_checkpoint_unknown_lists_known_ids() -> None:
    with pytest.raises(ManifestError) as info:
        find_checkpoint("esm2_15b")
    message = str(info.value)
    assert "esm2_15b" in message
    assert all(checkpoint_id in message for checkpoint_id in ESM2_FACTS)


# ---------------------------------------------------------------------------- broken copies of esm2.toml


def write_variant(tmp_path: Path, old: str, new: str, name: str = "esm2.toml", count: int = 1) -> Path:
    text = ESM2.read_text(encoding="utf-8")
    # Guard the test's premise: if the manifest changes, a silent no-op replace would test nothing.
    assert old in text, f"test premise gone: {old!r} not in esm2.toml"
    path = tmp_path / name
    path.write_text(text.replace(old, new, count), encoding="utf-8")
    return path


def assert_rejected(path: Path, key: str, fragment: str = "", *, resolve: bool = False) -> None:
    with pytest.raises(ManifestError) as info:
        load_manifest(path, resolve=resolve)
    message = str(info.value)
    assert path.name in message
    assert info.value.key == key, message
    assert f": {key}: " in message
    assert fragment in message


REV_150M = "a695f6045e2e32885fa60af20c13cb35398ce30c"
SHA_8M = "sha256:24c5fa474c48f3b754b86efe752d5f189d2bcd88190fa2270fc92b2ef3034189"
BACKEND_LINE = 'backends = ["eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"]\n'

# (old, new, key path, message fragment); each replaces the first occurrence of `old`.
BROKEN = {
    # unknown keys, at every level
    "unknown-top-level-table": ("[attention]", "[extras]\nx = 1\n\n[attention]", "extras", "unknown key"),
    "unknown-family-key": (
        'tokenizer = "esm"',
        'tokenizer = "esm"\ntokeniser = "esm"',
        "family.tokeniser",
        "",
    ),
    "unknown-checkpoint-key": (
        "num_heads = 20\n",
        "num_heads = 20\nnum_kv_heads = 20\n",
        "checkpoints[0].num_kv_heads",
        "",
    ),
    "unknown-source-key": (
        'kind = "fair-esm"\n',
        'kind = "fair-esm"\nmirror = "x"\n',
        "checkpoints[0].sources[1].mirror",
        "",
    ),
    "key-of-other-source-kind": (
        'revision = "c731040fcd8d73dceaa04b0a8e6329b345b0f5df"\n',
        'revision = "c731040fcd8d73dceaa04b0a8e6329b345b0f5df"\nurl = "https://example.org/x.pt"\n',
        "checkpoints[0].sources[0].url",
        "unknown key",
    ),
    "unknown-dtypes-key": ('bf16 = "autocast"', 'bf16 = "autocast"\nfp16 = "cast"', "dtypes.fp16", ""),
    # missing required keys
    "missing-family-name": ('name = "ESM2"\n', "", "family.name", "missing required key"),
    "missing-upstream-license": (
        'license = "MIT"\n\n[auto_classes]',
        "\n[auto_classes]",
        "upstream.license",
        "missing",
    ),
    "missing-section": (f"[attention]\n{BACKEND_LINE}", "", "attention", "missing required key"),
    "missing-num-heads": ("num_heads = 20\n", "", "checkpoints[0].num_heads", "missing required key"),
    "missing-revision": (
        'revision = "6fbf070e65b0b7291e7bbcd451118c216cff79d8"\n',
        "",
        "checkpoints[1].sources[0].revision",
        "missing required key",
    ),
    "missing-source-kind": (
        'kind = "fair-esm"\n',
        "",
        "checkpoints[0].sources[1].kind",
        "missing required key",
    ),
    "missing-bf16-policy": ('bf16 = "autocast"\n', "", "dtypes.bf16", "missing required key"),
    # wrong types and bad values
    "string-for-int": ("num_layers = 6\n", 'num_layers = "6"\n', "checkpoints[0].num_layers", "integer"),
    "bool-for-int": ("num_layers = 6\n", "num_layers = true\n", "checkpoints[0].num_layers", "integer"),
    "non-positive-int": (
        "hidden_size = 320\n",
        "hidden_size = 0\n",
        "checkpoints[0].hidden_size",
        "positive",
    ),
    "heads-do-not-divide": ("num_heads = 20\n", "num_heads = 7\n", "checkpoints[0].num_heads", "divide"),
    "int-for-string": ('name = "ESM2"', "name = 2", "family.name", "expected a string"),
    "array-for-string": ('id = "esm2_8m"', 'id = ["esm2_8m"]', "checkpoints[0].id", "expected a string"),
    "string-for-array": (BACKEND_LINE, 'backends = "sdpa"\n', "attention.backends", "array"),
    "array-for-table": ("[family]", "[[family]]", "family", "expected a table"),
    "string-for-table": (
        f'files = {{ "model.safetensors" = "{SHA_8M}" }}',
        'files = "x"',
        "checkpoints[0].sources[0].files",
        "",
    ),
    "empty-string": (
        'license = "MIT"\n\n[auto_classes]',
        'license = ""\n\n[auto_classes]',
        "upstream.license",
        "empty",
    ),
    "bad-hash": (
        SHA_8M,
        SHA_8M.replace("sha256:", "md5:"),
        'checkpoints[0].sources[0].files."model.safetensors"',
        "",
    ),
    "hash-for-other-file": (
        '{ "esm2_t6_8M_UR50D.pt" =',
        '{ "esm2_t6_8M_UR50D.bin" =',
        'checkpoints[0].sources[1].files."esm2_t6_8M_UR50D.bin"',
        "only file",
    ),
    "url-not-matching-file": (
        "models/esm2_t6_8M_UR50D.pt",
        "models/esm2_t12_35M_UR50D.pt",
        "checkpoints[0].sources[1].url",
        "does not end with",
    ),
    "unknown-source-kind": (
        'kind = "fair-esm"',
        'kind = "torch-hub"',
        "checkpoints[0].sources[1].kind",
        "torch-hub",
    ),
    "duplicate-source-kind": (
        f'files = {{ "model.safetensors" = "{SHA_8M}" }}\n',
        f'files = {{ "model.safetensors" = "{SHA_8M}" }}\n\n[[checkpoints.sources]]\nkind = "transformers"\n'
        'repo = "facebook/esm2_t6_8M_UR50D"\nrevision = "c731040fcd8d73dceaa04b0a8e6329b345b0f5df"\n',
        "checkpoints[0].sources[1].kind",
        "second",
    ),
    "bad-hub-repo": (
        'repo = "facebook/esm2_t6_8M_UR50D"',
        'repo = "esm2_t6_8M_UR50D"',
        "checkpoints[0].sources[0].repo",
        "",
    ),
    # attention backends
    "backend-flex": ('"flex_attention", ', '"flex", ', "attention.backends[2]", "'flex'"),
    "backend-fa4": (
        '"flash_attention_3"]',
        '"flash_attention_4"]',
        "attention.backends[4]",
        "flash_attention_2",
    ),
    "backend-twice": ('"sdpa", "flex_attention"', '"sdpa", "sdpa"', "attention.backends[2]", "twice"),
    # dtypes
    "unknown-dtype": (
        'allowed = ["float32", "bfloat16"]',
        'allowed = ["float32", "float64"]',
        "dtypes.allowed[1]",
        "float64",
    ),
    "unknown-bf16-policy": ('bf16 = "autocast"', 'bf16 = "fp32"', "dtypes.bf16", "autocast, cast"),
    "bf16-policy-without-bf16": (
        'allowed = ["float32", "bfloat16"]',
        'allowed = ["float32"]',
        "dtypes.bf16",
        "",
    ),
    # revisions: exactly 40 lowercase hex
    "short-revision": (REV_150M, REV_150M[:8], "checkpoints[2].sources[0].revision", "40-character"),
    "uppercase-revision": (REV_150M, REV_150M.upper(), "checkpoints[2].sources[0].revision", "40-character"),
    "branch-revision": (REV_150M, "main", "checkpoints[2].sources[0].revision", "40-character"),
    "upstream-revision": (
        "2b369911bb5b4b0dda914521b9475cad1656b2ac",
        "master",
        "upstream.revision",
        "40-character",
    ),
    # duplicates within the family
    "duplicate-id": ('id = "esm2_35m"', 'id = "esm2_8m"', "checkpoints[1].id", "already used"),
    "duplicate-published": (
        'published = "ESM2-35M"',
        'published = "ESM2-8M"',
        "checkpoints[1].published",
        "already",
    ),
    # Hub repo names are case-insensitive
    "duplicate-published-case": (
        'published = "ESM2-35M"',
        'published = "esm2-8m"',
        "checkpoints[1].published",
        "",
    ),
    "published-equals-other-id": (
        'published = "ESM2-35M"',
        'published = "esm2_8m"',
        "checkpoints[1].published",
        "",
    ),
    # representative
    "representative-unknown": (
        'representative = "esm2_8m"',
        'representative = "esm2_1b"',
        "family.representative",
        "",
    ),
    # AutoClass names and targets (validated without importing the runtime modules)
    "autoclass-misspelt": (
        "AutoModelForMaskedLM =",
        "AutoModelForMaskedLMs =",
        "auto_classes.AutoModelForMaskedLMs",
        "",
    ),
    "autoclass-model-not-auto": (
        "AutoModel =",
        "AutoformerModel =",
        "auto_classes.AutoformerModel",
        "Auto class",
    ),
    "autoclass-not-auto": ("AutoModel =", "EsmModel =", "auto_classes.EsmModel", "Auto class"),
    "autoclass-nested-target": (
        '"modeling_esm2.ESM2Model"',
        '"models.modeling_esm2.ESM2Model"',
        "auto_classes.AutoModel",
        "module.ClassName",
    ),
}


@pytest.mark.parametrize(("old", "new", "key", "fragment"), BROKEN.values(), ids=BROKEN.keys())
def test_broken_manifest_is_rejected(tmp_path: Path, old: str, new: str, key: str, fragment: str) -> None:
    assert_rejected(write_variant(tmp_path, old, new), key, fragment)


def test_family_id_must_equal_file_stem(tmp_path: Path) -> None:
    path = write_variant(tmp_path, 'id = "esm2"', 'id = "esm2"', name="esm3.toml")
    assert_rejected(path, "family.id", "file stem")


def test_invalid_toml_names_file(tmp_path: Path) -> None:
    assert_rejected(write_variant(tmp_path, 'name = "ESM2"', 'name = "ESM2'), "<toml>", "invalid TOML")


# ---------------------------------------------------------------------------- AutoClass resolution


def with_targets(tmp_path: Path, target: str) -> Path:
    """esm2.toml with every AutoClass pointing at `target`."""
    text = ESM2.read_text(encoding="utf-8")
    text, count = re.subn(r'= "(?:configuration|modeling)_esm2\.\w+"', f'= "{target}"', text)
    assert count == 5
    path = tmp_path / "esm2.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_resolve_existing_targets(tmp_path: Path) -> None:
    family = load_manifest(with_targets(tmp_path, "manifest.Family"), resolve=True)
    assert resolve_auto_classes(family) == dict.fromkeys(family.auto_classes, Family)


@pytest.fixture
def runtime_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A throwaway `fastplms.<name>` module, as the runtime modeling modules will be."""
    name = "tiny_runtime_for_manifest_test"
    folder = tmp_path / "runtime"
    folder.mkdir()
    (folder / f"{name}.py").write_text("class TinyModel:\n    pass\n", encoding="utf-8")
    monkeypatch.setattr(fastplms, "__path__", [*fastplms.__path__, str(folder)])
    importlib.invalidate_caches()
    yield name
    sys.modules.pop(f"fastplms.{name}", None)


def test_resolve_runtime_module_target(tmp_path: Path, runtime_module: str) -> None:
    family = load_manifest(with_targets(tmp_path, f"{runtime_module}.TinyModel"), resolve=False)
    resolved = resolve_auto_classes(family)
    assert {cls.__name__ for cls in resolved.values()} == {"TinyModel"}
    assert resolved["AutoModel"].__module__ == f"fastplms.{runtime_module}"


@pytest.mark.parametrize(
    ("target", "fragment"),
    [
        ("manifest.NoSuchClass", "no attribute"),
        ("manifest.load_manifest", "not a class"),
        ("no_such_module_for_manifest_test.Model", "cannot import fastplms.no_such_module_for_manifest_test"),
    ],
)
def test_unresolvable_target_is_rejected(tmp_path: Path, target: str, fragment: str) -> None:
    path = with_targets(tmp_path, target)
    load_manifest(path, resolve=False)  # well-formed: only resolution can catch it
    assert_rejected(path, "auto_classes.AutoConfig", fragment, resolve=True)


# ---------------------------------------------------------------------------- across families


def test_load_all_rejects_checkpoint_id_in_two_families(tmp_path: Path) -> None:
    (tmp_path / "esm2.toml").write_text(ESM2.read_text(encoding="utf-8"), encoding="utf-8")
    write_variant(tmp_path, 'id = "esm2"', 'id = "esm2_copy"', name="esm2_copy.toml")
    with pytest.raises(ManifestError) as info:
        load_all(tmp_path, resolve=False)
    message = str(info.value)
    assert info.value.key == "checkpoints[0].id"
    assert "esm2_copy.toml" in message and "esm2.toml checkpoints[0]" in message


def test_load_all_rejects_published_name_in_two_families(tmp_path: Path) -> None:
    (tmp_path / "esm2.toml").write_text(ESM2.read_text(encoding="utf-8"), encoding="utf-8")
    text = ESM2.read_text(encoding="utf-8").replace('id = "esm2', 'id = "other')
    text = text.replace('representative = "esm2_8m"', 'representative = "other_8m"')
    (tmp_path / "other.toml").write_text(text, encoding="utf-8")
    with pytest.raises(ManifestError) as info:
        load_all(tmp_path, resolve=False)
    assert info.value.key == "checkpoints[0].published"
    assert "other.toml" in str(info.value)


def test_load_all_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no such manifest directory"):
        load_all(tmp_path / "absent")


# ---------------------------------------------------------------------------- config tables, profluent, license_link

E1 = MANIFEST_DIR / "e1.toml"


def test_e1_manifest_config_tables() -> None:
    family = load_manifest(E1, resolve=False)
    assert family.config["rope_theta_global"] == 500000.0 and family.config["gated_mlp"] is True
    assert family.config["hidden_act"] == "silu" and family.config["vocab_size"] == 34
    ckpt = family.checkpoint("e1_300m")
    assert dict(ckpt.config) == {"num_kv_heads": 16, "intermediate_size": 3072}
    merged = family.checkpoint_config("e1_300m")
    assert merged["num_kv_heads"] == 16 and merged["clip_qkv"] == 8.0 and "num_layers" not in merged
    assert ckpt.license_link == "https://github.com/Profluent-AI/E1/blob/main/LICENSE"
    source = ckpt.source("profluent")
    assert (source.repo, source.revision) == ("Profluent-Bio/E1-300m", None)
    # Families without the new keys are unchanged.
    esm2 = load_manifest(ESM2, resolve=False)
    assert dict(esm2.config) == {} and all(c.license_link is None and not c.config for c in esm2.checkpoints)


def write_e1_variant(tmp_path: Path, old: str, new: str) -> Path:
    text = E1.read_text(encoding="utf-8")
    assert old in text, f"test premise gone: {old!r} not in e1.toml"
    path = tmp_path / "e1.toml"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    return path


E1_KV = "config = { num_kv_heads = 12, intermediate_size = 2304 }"
E1_BROKEN = {
    "config-not-a-table": ("[config]\n", "[[config]]\n", "config", "expected a table"),
    "config-array-value": ("vocab_size = 34\n", "vocab_size = [34]\n", "config.vocab_size", "string, number"),
    "config-table-value": ("vocab_size = 34\n", "vocab_size = { a = 1 }\n", "config.vocab_size", "string, number"),
    "config-bad-name": ("vocab_size = 34\n", "VocabSize = 34\n", "config.VocabSize", "config field name"),
    "config-empty-string": ('hidden_act = "silu"', 'hidden_act = " "', "config.hidden_act", "empty"),
    "checkpoint-config-empty": (E1_KV, "config = {}", "checkpoints[0].config", "must not be empty"),
    "checkpoint-config-not-table": (E1_KV, "config = 12", "checkpoints[0].config", "expected a table"),
    "checkpoint-config-restates-family": (
        E1_KV,
        "config = { num_kv_heads = 12, intermediate_size = 2304, clip_qkv = 4.0 }",
        "checkpoints[0].config.clip_qkv",
        "already set in [config]",
    ),
    "checkpoint-config-restates-dims": (
        E1_KV,
        "config = { num_kv_heads = 12, intermediate_size = 2304, num_layers = 20 }",
        "checkpoints[0].config.num_layers",
        "on the checkpoint itself",
    ),
    "checkpoint-config-bad-value": (
        E1_KV,
        "config = { num_kv_heads = [12], intermediate_size = 2304 }",
        "checkpoints[0].config.num_kv_heads",
        "string, number",
    ),
    "license-link-not-https": (
        'license_link = "https://github.com/Profluent-AI/E1/blob/main/LICENSE"',
        'license_link = "http://example.org/LICENSE"',
        "checkpoints[0].license_link",
        "https://",
    ),
    "license-link-not-string": (
        'license_link = "https://github.com/Profluent-AI/E1/blob/main/LICENSE"',
        "license_link = 1",
        "checkpoints[0].license_link",
        "expected a string",
    ),
    "profluent-missing-repo": (
        'kind = "profluent"\nrepo = "Profluent-Bio/E1-150m"\n',
        'kind = "profluent"\n',
        "checkpoints[0].sources[0].repo",
        "missing required key",
    ),
    "profluent-bad-revision": (
        'repo = "Profluent-Bio/E1-150m"\n',
        'repo = "Profluent-Bio/E1-150m"\nrevision = "main"\n',
        "checkpoints[0].sources[0].revision",
        "40-character",
    ),
    "profluent-unknown-key": (
        'repo = "Profluent-Bio/E1-150m"\n',
        'repo = "Profluent-Bio/E1-150m"\nfile = "model.safetensors"\n',
        "checkpoints[0].sources[0].file",
        "unknown key",
    ),
    "checkpoint-unknown-key-still-fails": (
        E1_KV,
        E1_KV + "\nnum_kv_heads = 12",
        "checkpoints[0].num_kv_heads",
        "unknown key",
    ),
}


@pytest.mark.parametrize(("old", "new", "key", "fragment"), E1_BROKEN.values(), ids=E1_BROKEN.keys())
def test_broken_e1_manifest_is_rejected(tmp_path: Path, old: str, new: str, key: str, fragment: str) -> None:
    assert_rejected(write_e1_variant(tmp_path, old, new), key, fragment)


def test_profluent_revision_when_pinned(tmp_path: Path) -> None:
    rev = "0123456789abcdef0123456789abcdef01234567"
    path = write_e1_variant(
        tmp_path, 'repo = "Profluent-Bio/E1-150m"\n', f'repo = "Profluent-Bio/E1-150m"\nrevision = "{rev}"\n'
    )
    assert load_manifest(path, resolve=False).checkpoint("e1_150m").source("profluent").revision == rev


def test_config_table_is_optional_and_unknown_top_level_keys_still_fail(tmp_path: Path) -> None:
    assert_rejected(write_variant(tmp_path, "[attention]", "[configs]\nx = 1\n\n[attention]"), "configs", "unknown key")
    assert_rejected(write_variant(tmp_path, "[attention]", "[config]\n\n[attention]"), "config", "must not be empty")
    path = write_variant(tmp_path, "[attention]", "[config]\nx = 1\n\n[attention]")
    assert dict(load_manifest(path, resolve=False).config) == {"x": 1}
