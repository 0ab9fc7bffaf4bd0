"""FlashAttention through pinned, hash-locked Hugging Face kernels.

This module ships inside remote-code artifacts, so it may import only the standard library, torch and
(lazily) ``kernels``. Nothing runs at import time.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import types
from typing import Any

import torch

FLASH_PINS: dict[str, tuple[str, str]] = {
    "flash_attention_2": ("kernels-community/flash-attn2", "db6b51744f0cd7061386442c09df890fc6d9f47e"),
    "flash_attention_3": ("kernels-community/flash-attn3", "43f0bd269777115d94ff826e0d113ce9c1c9087b"),
}

_INSTALL_HINT = 'pip install "kernels>=0.15.2,<0.16" (or the fastplms "flash" extra)'
_KERNELS_RANGE = ((0, 15, 2), (0, 16, 0))
# validate_kernel computes only this scheme (it never reads hash_type), so any other value cannot be checked.
_HASH_TYPE = "git_lfs_concat"


class FlashKernelError(RuntimeError):
    """A pinned FlashAttention kernel could not be loaded; the message names repo@revision and the cause."""

    def __init__(self, repo_id: str, revision: str, cause: str) -> None:
        super().__init__(f"FlashAttention kernel {repo_id}@{revision} unavailable: {cause}")
        self.repo_id = repo_id
        self.revision = revision
        self.cause = cause

    def __reduce__(self) -> tuple[Any, ...]:
        # The default reduce would call __init__ with the formatted message only.
        return (type(self), (self.repo_id, self.revision, self.cause))


def default_lockfile() -> pathlib.Path | None:
    """The nearest ``kernels.lock`` at or above this file's folder (the repo root in a source checkout)."""
    here = pathlib.Path(__file__).resolve().parent
    for folder in (here, *here.parents):
        candidate = folder / "kernels.lock"
        if candidate.is_file():
            return candidate
    return None


def load_flash_kernel(implementation: str, lockfile: str | os.PathLike[str] | None = None) -> types.ModuleType:
    """Import the pinned kernel for ``implementation``, verified against the lock's variant hashes.

    Raises FlashKernelError for every failure; there is no fallback to another revision or package.
    """
    if implementation not in FLASH_PINS:
        raise ValueError(
            f"Unknown FlashAttention implementation {implementation!r}; expected one of {sorted(FLASH_PINS)}"
        )
    repo_id, revision = FLASH_PINS[implementation]
    path = pathlib.Path(lockfile) if lockfile is not None else default_lockfile()
    if path is None:
        cause = f"no kernels.lock found at or above {pathlib.Path(__file__).parent}"
        raise FlashKernelError(repo_id, revision, cause)
    return _load_pinned(implementation, path.resolve())


@functools.cache
def _load_pinned(implementation: str, lock_path: pathlib.Path) -> types.ModuleType:
    repo_id, revision = FLASH_PINS[implementation]
    hashes = _pinned_variant_hashes(repo_id, revision, lock_path)
    try:
        import kernels
        from kernels.lockfile import VariantLock
    except ImportError as exc:
        cause = f"kernels is not importable ({exc}); {_INSTALL_HINT}"
        raise FlashKernelError(repo_id, revision, cause) from exc
    # install_kernel's variant_locks and the lock format are specific to this kernels series.
    version = str(getattr(kernels, "__version__", "?"))
    if not _KERNELS_RANGE[0] <= _version_tuple(version) < _KERNELS_RANGE[1]:
        raise FlashKernelError(repo_id, revision, f"kernels {version} is unsupported; {_INSTALL_HINT}")
    locks = {variant: VariantLock(hash=digest, hash_type=_HASH_TYPE) for variant, digest in hashes.items()}
    try:
        variant_path = pathlib.Path(
            kernels.install_kernel(repo_id, revision=revision, local_files_only=_offline(), variant_locks=locks)
        )
        _require_pinned_snapshot(variant_path, repo_id, revision)
        # Import the exact folder that was hash-checked rather than letting kernels pick a variant again.
        return kernels.get_local_kernel(variant_path)
    except FlashKernelError:
        raise
    except Exception as exc:
        raise FlashKernelError(repo_id, revision, f"{type(exc).__name__}: {exc}") from exc


def _pinned_variant_hashes(repo_id: str, revision: str, lock_path: pathlib.Path) -> dict[str, str]:
    def fail(cause: str) -> FlashKernelError:
        return FlashKernelError(repo_id, revision, f"{lock_path}: {cause}")

    try:
        entries = json.loads(lock_path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise fail("lock file does not exist") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise fail(f"unreadable lock file ({exc})") from exc
    if not isinstance(entries, list):
        raise fail("malformed lock: expected a JSON list of kernel entries")
    matches: list[dict[str, str]] = []
    for entry in entries:
        variants = _entry_variants(entry)
        if variants is None:
            raise fail(f"malformed lock entry {str(entry)[:200]}")
        if entry["repo_id"] == repo_id:
            if entry["sha"] != revision:
                raise fail(f"lock pins {repo_id}@{entry['sha']}, this code requires {revision}")
            matches.append(variants)
    if len(matches) != 1:
        raise fail(f"expected exactly one lock entry for {repo_id}, found {len(matches)}")
    return matches[0]


def _entry_variants(entry: object) -> dict[str, str] | None:
    """The entry's variant -> hash map, or None when the entry is not a kernels 0.15 lock entry."""
    if not isinstance(entry, dict) or not isinstance(entry.get("repo_id"), str):
        return None
    if not isinstance(entry.get("sha"), str) or not isinstance(entry.get("variants"), dict):
        return None
    out: dict[str, str] = {}
    for variant, lock in entry["variants"].items():
        if not isinstance(lock, dict) or set(lock) - {"hash", "hash_type"}:
            return None
        digest = lock.get("hash")
        if not isinstance(digest, str) or not re.fullmatch(r"sha256-[0-9a-f]{64}", digest):
            return None
        if lock.get("hash_type", _HASH_TYPE) != _HASH_TYPE:
            return None
        out[variant] = digest
    return out


def _require_pinned_snapshot(variant_path: pathlib.Path, repo_id: str, revision: str) -> None:
    # kernels follows a kernel-status.toml redirect when online, which could land on another repo or branch.
    expected = ("kernels--" + repo_id.replace("/", "--"), "snapshots", revision, "build")
    if variant_path.parts[-5:-1] != expected:
        raise FlashKernelError(repo_id, revision, f"kernels resolved {variant_path}, not the pinned snapshot")


def _offline() -> bool:
    return any(
        os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _version_tuple(version: str) -> tuple[int, int, int]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        return (0, 0, 0)
    return (int(match[1]), int(match[2]), int(match[3] or 0))


def check_flash_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.dtype:
    """Reject inputs the flash path cannot run, before any kernel is fetched; return the compute dtype.

    q is (batch, heads, seq, head_dim); attention_mask, when given, is (batch, seq).
    """
    devices = {"q": q.device, "k": k.device, "v": v.device}
    seen = ", ".join(f"{name} on {device}" for name, device in devices.items())
    if any(device.type != "cuda" for device in devices.values()):
        raise ValueError(f"FlashAttention needs CUDA tensors for q, k, v; got {seen}")
    if len(set(devices.values())) != 1:
        raise ValueError(f"FlashAttention needs q, k, v on one CUDA device; got {seen}")

    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) != 1:
        raise ValueError(f"FlashAttention needs one dtype for q, k, v; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    if not (q.dtype == torch.bfloat16 or (q.dtype == torch.float32 and autocast == torch.bfloat16)):
        raise ValueError(
            f"FlashAttention runs in bfloat16; got {q.dtype} with cuda autocast "
            f"{autocast or 'off'}; expected bfloat16 tensors, or float32 under "
            "torch.autocast('cuda', dtype=torch.bfloat16)"
        )

    if attention_mask is not None:
        if q.dim() != 4:
            raise ValueError(f"FlashAttention expects q as (batch, heads, seq, head_dim); got {tuple(q.shape)}")
        expected = (q.shape[0], q.shape[2])
        if tuple(attention_mask.shape) != expected:
            raise ValueError(
                f"attention_mask must be 2-D (batch, seq) = {expected} for q {tuple(q.shape)}; "
                f"got {tuple(attention_mask.shape)}"
            )
        if attention_mask.device != q.device:
            raise ValueError(f"attention_mask must be on {q.device} with q; got {attention_mask.device}")
    # Both accepted cases compute in bfloat16: flash kernels take no float32 inputs.
    return torch.bfloat16


def flash_varlen_forward(
    kernel: types.ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """Attention over packed (total_tokens, heads, head_dim) segments; k/v may have fewer heads (GQA) and
    other segment lengths (causal is then bottom-right aligned per segment, as FlashAttention defines it)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            "flash_varlen_forward expects packed (total_tokens, heads, head_dim) q, k, v; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    # Checked without reading values so the hot path never forces a device sync.
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor; got {cu.dtype} {tuple(cu.shape)}")
    out = kernel.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale, causal=causal
    )
    # Some flash-attn3 builds return (out, softmax_lse).
    if isinstance(out, tuple):
        out = out[0]
    return out
