"""Typed, strict loader for family manifests (`manifests/<family>.toml`).

A manifest is the single source of truth for a family: checkpoints and their official sources,
AutoClasses, attention backends, dtypes. Every problem is a `ManifestError` that names the file and
the key path, because a manifest mistake found late (at build or test time) is far harder to trace.
"""

from __future__ import annotations

import functools
import importlib
import re
import tomllib
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NoReturn


def _find_repo_root() -> Path:
    # Walk up instead of counting parents so the loader does not depend on the src/ layout depth.
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "manifests").is_dir() and (parent / "pyproject.toml").is_file():
            return parent
    return here.parents[3]  # src/fastplms/manifest/loader.py -> repo root; load_all reports it if absent


REPO_ROOT = _find_repo_root()
MANIFEST_DIR = REPO_ROOT / "manifests"

# Mirrors the names `fastplms.attention` accepts, so that reading a manifest needs neither torch nor the runtime.
BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
DTYPES = ("float32", "bfloat16", "float16")
# autocast: FP32 parameters under BF16 autocast; cast: parameters themselves cast to BF16.
BF16_POLICIES = ("autocast", "cast")
# Per source kind: required keys (besides `kind`) and optional keys.
SOURCE_KINDS: Mapping[str, tuple[frozenset[str], frozenset[str]]] = MappingProxyType(
    {
        "transformers": (frozenset({"repo", "revision"}), frozenset({"files"})),  # official Hub snapshot
        "fair-esm": (frozenset({"file", "url"}), frozenset({"files"})),  # original fair-esm .pt
        # A Hub snapshot holding the EvolutionaryScale `esm` package's state dict at `file` (a path in the repo).
        # `revision` is optional because not every official commit could be traced; pin it when known.
        "esm": (frozenset({"repo", "file"}), frozenset({"revision", "files", "license"})),
        # A Biohub Hub snapshot (safetensors with Transformer-Engine names and config.json).
        "biohub": (frozenset({"repo"}), frozenset({"revision", "files", "license"})),
        # A Profluent-Bio Hub snapshot (config.json, model.safetensors, tokenizer.json) of the official E1 code.
        "profluent": (frozenset({"repo"}), frozenset({"revision", "files", "license"})),
        # An airkingbd Hub snapshot saved by ByProt's EsmForDPLM / EsmForDPLM2 (config.json with `dplm_type`,
        # Transformers Esm key names, the decoder tied or not as the config says).
        "byprot": (frozenset({"repo"}), frozenset({"revision", "files", "license"})),
        # An ElnaggarLab Hub snapshot of Transformers' T5 (config.json, weights, tokenizer.json or spiece.model).
        "elnaggarlab": (frozenset({"repo"}), frozenset({"revision", "files", "license"})),
    }
)

_REVISION = re.compile(r"[0-9a-f]{40}")
_HASH = re.compile(r"sha256:[0-9a-f]{64}")
_ID = re.compile(r"[a-z][a-z0-9_]*")
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_PUBLISHED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# Exactly one dot: the runtime bundle is a flat folder of modules, so targets cannot be nested.
_TARGET = re.compile(r"[A-Za-z_]\w*\.[A-Za-z_]\w*")
# Auto classes we can advertise in an artifact's auto_map. `startswith("Auto")` alone would admit
# model classes such as transformers.AutoformerModel.
_AUTO_NAME = re.compile(r"Auto(Config|Tokenizer|Model|ModelFor\w+)")
# Config field names (`[config]`, a checkpoint's `config`): Python identifiers as a config's attributes are.
_FIELD = re.compile(r"[a-z][a-z0-9_]*")
# Checkpoint keys that are fields of their own, so a checkpoint's `config` cannot restate them.
_CHECKPOINT_DIMS = frozenset({"num_layers", "hidden_size", "num_heads"})

ConfigValue = str | int | float | bool


class ManifestError(ValueError):
    """A manifest problem; the message is always `<file>: <key path>: <what is wrong>`."""

    def __init__(self, file: str, key: str, message: str) -> None:
        super().__init__(f"{file}: {key}: {message}")
        self.file = file
        self.key = key


@dataclass(frozen=True)
class Source:
    """One official place a checkpoint's weights come from."""

    kind: str
    repo: str | None = None
    revision: str | None = None
    file: str | None = None
    url: str | None = None
    files: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    # The license this source publishes its weights under, when it differs from the checkpoint's.
    license: str | None = None


@dataclass(frozen=True)
class Checkpoint:
    id: str
    published: str
    num_layers: int
    hidden_size: int
    num_heads: int
    license: str
    sources: tuple[Source, ...]
    # The Hub card's `license_link` (with license `other`), where the license is not a standard Hub one.
    license_link: str | None = None
    # Config fields of this checkpoint alone (e.g. E1's num_kv_heads); the family's shared ones are in
    # `Family.config`, `Family.checkpoint_config` merges both.
    config: Mapping[str, ConfigValue] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    # Config fields not known offline (a dimension no reachable source states): the build reads them from the
    # snapshot's own config.json instead of guessing.
    from_snapshot: tuple[str, ...] = ()

    @property
    def dims(self) -> tuple[int, int, int]:
        """(num_layers, hidden_size, num_heads): what seeded weights and shape checks are built at."""
        return self.num_layers, self.hidden_size, self.num_heads

    def source(self, kind: str) -> Source:
        for source in self.sources:
            if source.kind == kind:
                return source
        known = ", ".join(s.kind for s in self.sources)
        raise KeyError(f"checkpoint {self.id!r} has no {kind!r} source; it has: {known}")


@dataclass(frozen=True)
class Upstream:
    repo: str
    revision: str
    license: str


@dataclass(frozen=True)
class Family:
    id: str
    name: str
    description: str
    architecture: str
    tokenizer: str
    transform: str
    representative: str
    citation: str
    upstream: Upstream
    auto_classes: Mapping[str, str] = field(hash=False)
    backends: tuple[str, ...]
    dtypes: tuple[str, ...]
    bf16: str | None
    checkpoints: tuple[Checkpoint, ...]
    path: Path = field(compare=False)
    # `[config]`: scalar config fields shared by every checkpoint (beyond the dims every family has).
    config: Mapping[str, ConfigValue] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    # `[attention] unsupported`: backend -> why the family refuses it (the refusal's message says so).
    unsupported: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), hash=False)

    def checkpoint(self, checkpoint_id: str) -> Checkpoint:
        for checkpoint in self.checkpoints:
            if checkpoint.id == checkpoint_id:
                return checkpoint
        known = ", ".join(c.id for c in self.checkpoints)
        raise ManifestError(_label(self.path), "checkpoints", f"no checkpoint {checkpoint_id!r}; known: {known}")

    @property
    def representative_checkpoint(self) -> Checkpoint:
        return self.checkpoint(self.representative)

    def checkpoint_config(self, checkpoint_id: str) -> dict[str, ConfigValue]:
        """The family's `[config]` fields with the checkpoint's own `config` fields (the two never share a key)."""
        return {**self.config, **self.checkpoint(checkpoint_id).config}


def _label(path: Path) -> str:
    # Repo-relative when possible: short, and stable across checkouts.
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


class _Table:
    """A TOML table with its key path; checks its key set on construction, typed getters after."""

    def __init__(
        self,
        file: str,
        where: str,
        raw: object,
        required: Set[str],
        optional: Set[str] | None = frozenset(),
    ) -> None:
        """`optional=None` means free-form keys that the caller validates itself."""
        self.file, self.where = file, where
        if not isinstance(raw, dict):
            self.fail_at(where, f"expected a table, got {type(raw).__name__}")
        self.raw: dict[str, Any] = raw
        # Unknown keys first: a misspelt key would otherwise surface as a confusing "missing" error.
        for key in raw:
            if optional is not None and key not in required and key not in optional:
                allowed = ", ".join(sorted(required | optional))
                self.fail(key, f"unknown key; allowed here: {allowed}")
        for key in sorted(required):
            if key not in raw:
                self.fail(key, "missing required key")

    def fail_at(self, where: str, message: str) -> NoReturn:
        raise ManifestError(self.file, where or "<root>", message)

    def fail(self, key: str, message: str) -> NoReturn:
        self.fail_at(_join(self.where, key), message)

    def table(self, key: str, required: Set[str], optional: Set[str] | None = frozenset()) -> _Table:
        return _Table(self.file, _join(self.where, key), self.raw[key], required, optional)

    def string(self, key: str, pattern: re.Pattern[str] | None = None, what: str = "") -> str:
        value = self.raw[key]
        if not isinstance(value, str):
            self.fail(key, f"expected a string, got {type(value).__name__}")
        if not value.strip():
            self.fail(key, "must not be empty")
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(key, f"{value!r} is not {what or 'valid: must match ' + pattern.pattern}")
        return value

    def opt_string(self, key: str, pattern: re.Pattern[str] | None = None, what: str = "") -> str | None:
        return self.string(key, pattern, what) if key in self.raw else None

    def positive_int(self, key: str) -> int:
        value = self.raw[key]
        # TOML booleans are Python ints; reject them explicitly.
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"expected an integer, got {type(value).__name__}")
        if value <= 0:
            self.fail(key, f"must be positive, got {value}")
        return value

    def choices(self, key: str, valid: tuple[str, ...]) -> tuple[str, ...]:
        """A non-empty array of distinct names, each one of `valid`."""
        value = self.raw[key]
        where = _join(self.where, key)
        if not isinstance(value, list) or not value:
            self.fail(key, "expected a non-empty array of strings")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                self.fail_at(f"{where}[{i}]", f"expected a string, got {type(item).__name__}")
            if item not in valid:
                self.fail_at(f"{where}[{i}]", f"unknown name {item!r}; valid: {', '.join(valid)}")
            if item in value[:i]:
                self.fail_at(f"{where}[{i}]", f"{item!r} listed twice")
        return tuple(value)

    def array_of_tables(self, key: str) -> list[object]:
        value = self.raw[key]
        if not isinstance(value, list) or not value:
            self.fail(key, "expected a non-empty array of tables")
        return value


def _read_config(file: str, where: str, raw: object) -> dict[str, ConfigValue]:
    """A non-empty table of config field name -> scalar (string, integer, float or boolean)."""
    if not isinstance(raw, dict):
        raise ManifestError(file, where, f"expected a table of config fields, got {type(raw).__name__}")
    if not raw:
        raise ManifestError(file, where, "must not be empty: leave the table out instead")
    fields: dict[str, ConfigValue] = {}
    for key, value in raw.items():
        if not _FIELD.fullmatch(key):
            raise ManifestError(file, _join(where, key), "not a config field name: lowercase letters, digits and '_'")
        if not isinstance(value, str | int | float | bool):
            raise ManifestError(
                file, _join(where, key), f"expected a string, number or boolean, got {type(value).__name__}"
            )
        if isinstance(value, str) and not value.strip():
            raise ManifestError(file, _join(where, key), "must not be empty")
        fields[key] = value
    return fields


def _read_source(file: str, where: str, raw: object) -> Source:
    if not isinstance(raw, dict):
        raise ManifestError(file, where, f"expected a table, got {type(raw).__name__}")
    # The kind decides which keys are allowed, so it is read before the key set is checked.
    kind = raw.get("kind")
    if kind is None:
        raise ManifestError(file, f"{where}.kind", "missing required key")
    if not isinstance(kind, str) or kind not in SOURCE_KINDS:
        raise ManifestError(file, f"{where}.kind", f"unknown source kind {kind!r}; valid: {', '.join(SOURCE_KINDS)}")
    required, optional = SOURCE_KINDS[kind]
    table = _Table(file, where, raw, required | {"kind"}, optional)
    repo = table.opt_string("repo", _REPO, "a Hub repo id 'owner/name'")
    revision = table.opt_string("revision", _REVISION, "a 40-character lowercase hex commit sha")
    name = table.opt_string("file")
    if name is not None and (name.startswith("/") or "\\" in name or ".." in name.split("/")):
        table.fail("file", f"{name!r} must be a relative path inside the source: no leading '/', no '\\', no '..'")
    url = table.opt_string("url")
    license_name = table.opt_string("license")
    if url is not None and not url.startswith("https://"):
        table.fail("url", f"{url!r} must be an https:// URL")
    if url is not None and name is not None and not url.endswith("/" + name):
        table.fail("url", f"{url!r} does not end with file {name!r}")
    files: dict[str, str] = {}
    if "files" in raw:
        files_where = _join(where, "files")
        files_raw = raw["files"]
        if not isinstance(files_raw, dict) or not files_raw:
            table.fail("files", "expected a non-empty table of file name -> 'sha256:<64 hex>'")
        for file_name, digest in files_raw.items():
            key = f'{files_where}."{file_name}"'  # quoted as in TOML: file names contain dots
            if not isinstance(digest, str) or not _HASH.fullmatch(digest):
                raise ManifestError(file, key, f"{digest!r} is not 'sha256:' + 64 lowercase hex digits")
            if name is not None and file_name != name:
                # A single-file source can only pin its own file; anything else is a typo.
                raise ManifestError(file, key, f"this source has only file {name!r}")
            files[file_name] = digest
    return Source(kind, repo, revision, name, url, MappingProxyType(files), license_name)


def _read_checkpoint(
    file: str, where: str, raw: object, family_config: Mapping[str, ConfigValue] = MappingProxyType({})
) -> Checkpoint:
    table = _Table(
        file,
        where,
        raw,
        {"id", "published", "num_layers", "hidden_size", "num_heads", "license", "sources"},
        {"license_link", "config", "from_snapshot"},
    )
    checkpoint_id = table.string("id", _ID, "a checkpoint id: lowercase letters, digits and '_'")
    published = table.string("published", _PUBLISHED, "a Hub repo name: letters, digits, '.', '_', '-'")
    hidden_size, num_heads = table.positive_int("hidden_size"), table.positive_int("num_heads")
    if hidden_size % num_heads:
        table.fail("num_heads", f"{num_heads} does not divide hidden_size {hidden_size}")
    sources = tuple(
        _read_source(file, f"{where}.sources[{i}]", raw_source)
        for i, raw_source in enumerate(table.array_of_tables("sources"))
    )
    kinds = [s.kind for s in sources]
    for i, kind in enumerate(kinds):
        if kind in kinds[:i]:
            # Checkpoint.source(kind) must be unambiguous.
            raise ManifestError(file, f"{where}.sources[{i}].kind", f"a second {kind!r} source")
    license_link = table.opt_string("license_link")
    if license_link is not None and not license_link.startswith("https://"):
        table.fail("license_link", f"{license_link!r} must be an https:// URL")
    config: dict[str, ConfigValue] = {}
    if "config" in table.raw:
        config_where = _join(where, "config")
        config = _read_config(file, config_where, table.raw["config"])
        for key in config:
            if key in _CHECKPOINT_DIMS:
                raise ManifestError(
                    file, _join(config_where, key), f"set {key} on the checkpoint itself, not in config"
                )
            if key in family_config:
                raise ManifestError(
                    file, _join(config_where, key), "already set in [config]; a field is set in one place only"
                )
    from_snapshot: tuple[str, ...] = ()
    if "from_snapshot" in table.raw:
        value = table.raw["from_snapshot"]
        if not isinstance(value, list) or not all(isinstance(v, str) and _ID.fullmatch(v) for v in value):
            table.fail("from_snapshot", "expected an array of config field names")
        overlap = sorted(set(value) & (set(config) | set(family_config)))
        if overlap:
            table.fail("from_snapshot", f"{overlap} are set in the manifest too; a field comes from one place")
        from_snapshot = tuple(value)
    return Checkpoint(
        id=checkpoint_id,
        published=published,
        num_layers=table.positive_int("num_layers"),
        hidden_size=hidden_size,
        num_heads=num_heads,
        license=table.string("license"),
        sources=sources,
        license_link=license_link,
        config=MappingProxyType(config),
        from_snapshot=from_snapshot,
    )


def _lookup_names(checkpoint: Checkpoint) -> dict[str, str]:
    # Hub repo names are case-insensitive, so published names are compared case-folded; a checkpoint
    # may share a name between its own id and published name (e.g. ankh_base / ANKH_base).
    names = {checkpoint.id: "id"}
    names.setdefault(checkpoint.published.casefold(), "published")
    return names


def _claim(owners: dict[str, str], checkpoint: Checkpoint, file: str, where: str) -> None:
    """Register a checkpoint's lookup names, failing if another checkpoint already uses one."""
    for name, key in _lookup_names(checkpoint).items():
        owner = owners.get(name)
        if owner is not None:
            value = checkpoint.id if key == "id" else checkpoint.published
            raise ManifestError(file, f"{where}.{key}", f"{value!r} already used by {owner}")
    for name in _lookup_names(checkpoint):
        owners[name] = f"{file} {where} ({checkpoint.id})"


@functools.cache
def _transformers_names() -> frozenset[str]:
    # dir() of transformers' lazy module lists its public names without importing the torch-backed
    # modules behind them (hasattr would, at several seconds); deferred so importing this is cheap.
    import transformers

    return frozenset(dir(transformers))


def load_manifest(path: str | Path, *, resolve: bool = True) -> Family:
    """Load and validate one manifest; `resolve` also imports every AutoClass target."""
    path = Path(path)
    file = _label(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ManifestError(file, "<file>", f"cannot read: {error}") from error
    except tomllib.TOMLDecodeError as error:
        raise ManifestError(file, "<toml>", f"invalid TOML: {error}") from error

    root = _Table(
        file, "", data, {"family", "upstream", "auto_classes", "attention", "dtypes", "checkpoints"}, {"config"}
    )
    fam = root.table(
        "family",
        {"id", "name", "description", "architecture", "tokenizer", "transform", "representative", "citation"},
    )
    family_id = fam.string("id", _ID, "a family id: lowercase letters, digits and '_'")
    if family_id != path.stem:
        fam.fail("id", f"{family_id!r} must equal the file stem {path.stem!r}")

    up = root.table("upstream", {"repo", "revision", "license"})
    upstream = Upstream(
        repo=up.string("repo", _REPO, "a GitHub repo 'owner/name'"),
        revision=up.string("revision", _REVISION, "a 40-character lowercase hex commit sha"),
        license=up.string("license"),
    )

    autos = root.table("auto_classes", set(), optional=None)
    if not autos.raw:
        root.fail("auto_classes", "must name at least one AutoClass")
    auto_classes: dict[str, str] = {}
    for name in autos.raw:
        if not _AUTO_NAME.fullmatch(name) or name not in _transformers_names():
            autos.fail(name, "not a transformers Auto class name")
        auto_classes[name] = autos.string(name, _TARGET, "a runtime target 'module.ClassName'")

    attention = root.table("attention", {"backends"}, {"unsupported"})
    backends = attention.choices("backends", BACKENDS)
    unsupported: dict[str, str] = {}
    if "unsupported" in attention.raw:
        reasons = attention.table("unsupported", set(), optional=None)
        for name in reasons.raw:
            if name not in BACKENDS or name in backends:
                reasons.fail(name, f"not a backend outside attention.backends; valid: {', '.join(BACKENDS)}")
            unsupported[name] = reasons.string(name)

    dt = root.table("dtypes", {"allowed"}, {"bf16"})
    dtypes = dt.choices("allowed", DTYPES)
    bf16 = dt.opt_string("bf16")
    if bf16 is not None and bf16 not in BF16_POLICIES:
        dt.fail("bf16", f"unknown policy {bf16!r}; valid: {', '.join(BF16_POLICIES)}")
    if "bfloat16" in dtypes and bf16 is None:
        dt.fail("bf16", "missing required key: 'bfloat16' is allowed, so its execution policy must be set")
    if "bfloat16" not in dtypes and bf16 is not None:
        dt.fail("bf16", "set, but 'bfloat16' is not in dtypes.allowed")

    family_config = _read_config(file, "config", data["config"]) if "config" in data else {}
    checkpoints = tuple(
        _read_checkpoint(file, f"checkpoints[{i}]", raw, family_config)
        for i, raw in enumerate(root.array_of_tables("checkpoints"))
    )
    owners: dict[str, str] = {}
    for i, checkpoint in enumerate(checkpoints):
        _claim(owners, checkpoint, file, f"checkpoints[{i}]")

    representative = fam.string("representative")
    if representative not in {c.id for c in checkpoints}:
        known = ", ".join(c.id for c in checkpoints)
        fam.fail("representative", f"{representative!r} is not a checkpoint id; known: {known}")

    family = Family(
        id=family_id,
        name=fam.string("name"),
        description=fam.string("description"),
        architecture=fam.string("architecture"),
        tokenizer=fam.string("tokenizer"),
        transform=fam.string("transform"),
        representative=representative,
        citation=fam.string("citation"),
        upstream=upstream,
        auto_classes=MappingProxyType(auto_classes),
        backends=backends,
        unsupported=MappingProxyType(unsupported),
        dtypes=dtypes,
        bf16=bf16,
        checkpoints=checkpoints,
        path=path,
        config=MappingProxyType(family_config),
    )
    if resolve:
        resolve_auto_classes(family)
    return family


def resolve_auto_classes(family: Family) -> dict[str, type]:
    """Import each AutoClass target as `fastplms.<module>` and return AutoClass name -> class."""
    file = _label(family.path)
    resolved: dict[str, type] = {}
    for name, target in family.auto_classes.items():
        module_name, class_name = target.split(".")
        key = f"auto_classes.{name}"
        try:
            module = importlib.import_module(f"fastplms.{module_name}")
        except ImportError as error:
            raise ManifestError(file, key, f"cannot import fastplms.{module_name}: {error}") from error
        obj = getattr(module, class_name, None)
        if not isinstance(obj, type):
            what = "no attribute" if obj is None else f"not a class ({type(obj).__name__})"
            raise ManifestError(file, key, f"fastplms.{target}: {what}")
        resolved[name] = obj
    return resolved


def load_all(directory: str | Path = MANIFEST_DIR, *, resolve: bool = True) -> dict[str, Family]:
    """Load every `*.toml` in `directory` as family id -> Family.

    Also rejects a checkpoint id or published name used by two families, since lookups
    (`find_checkpoint`, Hub repo names) are global.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ManifestError(_label(directory), "<directory>", "no such manifest directory")
    families: dict[str, Family] = {}
    owners: dict[str, str] = {}
    for path in sorted(directory.glob("*.toml")):
        family = load_manifest(path, resolve=resolve)
        for i, checkpoint in enumerate(family.checkpoints):
            _claim(owners, checkpoint, _label(path), f"checkpoints[{i}]")
        families[family.id] = family
    return families


def find_checkpoint(model_id: str, directory: str | Path = MANIFEST_DIR) -> tuple[Family, Checkpoint]:
    """Find a checkpoint by its id (`esm2_8m`) or published name (`ESM2-8M`)."""
    # A lookup needs no runtime imports; whoever builds from the result resolves AutoClasses itself.
    families = load_all(directory, resolve=False)
    for family in families.values():
        for checkpoint in family.checkpoints:
            if model_id in (checkpoint.id, checkpoint.published):
                return family, checkpoint
    known = ", ".join(f"{c.id} ({c.published})" for f in families.values() for c in f.checkpoints)
    raise ManifestError(_label(Path(directory)), "checkpoints", f"unknown model id {model_id!r}; known: {known}")
