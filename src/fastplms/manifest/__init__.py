"""Family manifests (`manifests/<family>.toml`): the typed, strict loader and what it returns."""

from .loader import (
    BACKENDS,
    BF16_POLICIES,
    DTYPES,
    MANIFEST_DIR,
    REPO_ROOT,
    SOURCE_KINDS,
    Checkpoint,
    Family,
    ManifestError,
    Source,
    Upstream,
    find_checkpoint,
    load_all,
    load_manifest,
    resolve_auto_classes,
)

__all__ = [
    "BACKENDS",
    "BF16_POLICIES",
    "DTYPES",
    "MANIFEST_DIR",
    "REPO_ROOT",
    "SOURCE_KINDS",
    "Checkpoint",
    "Family",
    "ManifestError",
    "Source",
    "Upstream",
    "find_checkpoint",
    "load_all",
    "load_manifest",
    "resolve_auto_classes",
]
