"""CPU contract for fastplms.flash: input checks, lock handling and the pinned-kernel load path.

Anything that reaches kernels runs in a fresh interpreter, because kernels and huggingface_hub read the
cache location and offline mode from the environment once, at import time.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fastplms import flash

REPO_ROOT = Path(__file__).resolve().parents[1]
FA2_REPO, FA2_SHA = flash.FLASH_PINS["flash_attention_2"]
FA2_PIN = f"{FA2_REPO}@{FA2_SHA}"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    memo = flash._load_pinned  # held directly: some tests replace the attribute
    memo.cache_clear()
    yield cache
    memo.cache_clear()


# ---------------------------------------------------------------- check_flash_inputs


class _FakeCuda(torch.Tensor):
    """A CPU tensor reporting a CUDA device, so the later checks can be reached without a GPU."""

    fake_device = torch.device("cuda", 0)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.fake_device


def _cuda(t: torch.Tensor, index: int = 0) -> torch.Tensor:
    fake = torch.Tensor._make_subclass(_FakeCuda, t)
    fake.fake_device = torch.device("cuda", index)
    return fake


def _qkv(dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(2, 4, 5, 8, dtype=dtype)


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
GOOD_MASK = torch.ones(2, 5, dtype=torch.bool)

# Each case is invalid in several ways; the error must be the first failing check.
ORDER_CASES = {
    "cpu_fp16_bad_mask": (
        lambda: (_qkv(FP16), _qkv(FP16), _qkv(FP16), torch.ones(3)),
        r"needs CUDA tensors for q, k, v; got q on cpu, k on cpu, v on cpu",
    ),
    "one_cpu_input": (
        lambda: (_cuda(_qkv(FP16)), _qkv(BF16), _cuda(_qkv(BF16)), None),
        r"needs CUDA tensors .*k on cpu",
    ),
    "two_cuda_devices": (
        lambda: (_cuda(_qkv(FP16)), _cuda(_qkv(BF16), 1), _cuda(_qkv(BF16)), torch.ones(3)),
        r"on one CUDA device; got q on cuda:0, k on cuda:1, v on cuda:0",
    ),
    "mixed_dtypes": (
        lambda: (_cuda(_qkv(BF16)), _cuda(_qkv(FP16)), _cuda(_qkv(BF16)), torch.ones(3)),
        r"one dtype for q, k, v; got q torch.bfloat16, k torch.float16",
    ),
    "fp16": (
        lambda: tuple(_cuda(_qkv(FP16)) for _ in range(3)) + (torch.ones(3),),
        r"runs in bfloat16; got torch.float16 with cuda autocast off",
    ),
    "fp32_without_autocast": (
        lambda: tuple(_cuda(_qkv(FP32)) for _ in range(3)) + (torch.ones(3),),
        r"runs in bfloat16; got torch.float32 with cuda autocast off",
    ),
    "mask_3d": (
        lambda: tuple(_cuda(_qkv(BF16)) for _ in range(3)) + (_cuda(torch.ones(2, 5, 1)),),
        r"attention_mask must be 2-D \(batch, seq\) = \(2, 5\) .* got \(2, 5, 1\)",
    ),
    "mask_wrong_seq": (
        lambda: tuple(_cuda(_qkv(BF16)) for _ in range(3)) + (_cuda(torch.ones(2, 4)),),
        r"= \(2, 5\) .* got \(2, 4\)",
    ),
    "mask_on_cpu": (
        lambda: tuple(_cuda(_qkv(BF16)) for _ in range(3)) + (GOOD_MASK,),
        r"attention_mask must be on cuda:0 with q; got cpu",
    ),
}


@pytest.fixture
def no_kernel_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Input checks must finish before any kernel import or download: make both impossible."""
    monkeypatch.setitem(sys.modules, "kernels", None)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("check_flash_inputs tried to load a kernel")

    monkeypatch.setattr(flash, "load_flash_kernel", forbidden)
    monkeypatch.setattr(flash, "_load_pinned", forbidden)


@pytest.mark.parametrize("case", sorted(ORDER_CASES))
def test_check_flash_inputs_reports_first_failing_check(case: str, no_kernel_loading: None) -> None:
    build, pattern = ORDER_CASES[case]
    q, k, v, mask = build()
    with pytest.raises(ValueError, match=pattern):
        flash.check_flash_inputs(q, k, v, mask)


def _with_cuda_autocast(dtype: torch.dtype) -> torch.dtype:
    # The context manager refuses to enable cuda autocast without a GPU; the state setters do not.
    enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        q = _cuda(_qkv(FP32))
        return flash.check_flash_inputs(q, q, q, _cuda(GOOD_MASK))
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous)


def test_check_flash_inputs_accepts_bf16_and_fp32_under_bf16_autocast(no_kernel_loading: None) -> None:
    q = _cuda(_qkv(BF16))
    gqa_kv = _cuda(torch.zeros(2, 2, 5, 8, dtype=BF16))
    assert flash.check_flash_inputs(q, gqa_kv, gqa_kv) == torch.bfloat16
    assert flash.check_flash_inputs(q, q, q, _cuda(GOOD_MASK)) == torch.bfloat16
    assert _with_cuda_autocast(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match=r"got torch.float32 with cuda autocast torch.float16"):
        _with_cuda_autocast(torch.float16)


# ---------------------------------------------------------------- flash_varlen_forward


class _RecordingKernel:
    def __init__(self, result: object) -> None:
        self.result = result
        self.calls: list[tuple[tuple[object, ...], dict[str, object]]] = []

    def flash_attn_varlen_func(self, *args: object, **kwargs: object) -> object:
        self.calls.append((args, kwargs))
        return self.result


def test_flash_varlen_forward_passes_pinned_signature_and_unwraps_tuples() -> None:
    q, kv = torch.randn(7, 4, 8), torch.randn(7, 2, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out, lse = torch.randn(7, 4, 8), torch.randn(4, 7)
    for result in (out, (out, lse)):
        kernel = _RecordingKernel(result)
        got = flash.flash_varlen_forward(kernel, q, kv, kv, cu, cu, 4, 4, scale=0.25, causal=False)  # type: ignore[arg-type]
        assert got is out
        ((args, kwargs),) = kernel.calls
        assert args[:3] == (q, kv, kv) and args[3] is cu and args[4] is cu and args[5:] == (4, 4)
        assert kwargs == {"softmax_scale": 0.25, "causal": False}


def test_flash_varlen_forward_rejects_bad_layouts() -> None:
    kernel = _RecordingKernel(None)
    q = torch.randn(7, 4, 8)
    with pytest.raises(ValueError, match="int32"):
        flash.flash_varlen_forward(
            kernel, q, q, q, torch.tensor([0, 7]), torch.tensor([0, 7]), 7, 7, scale=1.0, causal=False
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="packed"):
        cu = torch.tensor([0, 7], dtype=torch.int32)
        flash.flash_varlen_forward(kernel, q[None], q, q, cu, cu, 7, 7, scale=1.0, causal=False)  # type: ignore[arg-type]
    assert kernel.calls == []


# ---------------------------------------------------------------- the lock file


def test_repo_lock_pins_exactly_the_two_revisions() -> None:
    entries = json.loads((REPO_ROOT / "kernels.lock").read_text())
    assert {(e["repo_id"], e["sha"]) for e in entries} == set(flash.FLASH_PINS.values())
    assert len(entries) == 2
    for entry in entries:
        assert entry["variants"], entry["repo_id"]
        for lock in entry["variants"].values():
            assert lock["hash_type"] == "git_lfs_concat"
            assert lock["hash"].startswith("sha256-") and len(lock["hash"]) == 71
    assert flash.default_lockfile() == REPO_ROOT / "kernels.lock"


def test_unknown_implementation_lists_both() -> None:
    with pytest.raises(ValueError, match="flash_attention_2.*flash_attention_3"):
        flash.load_flash_kernel("sdpa")


def _write_lock(path: Path, entries: object) -> Path:
    path.write_text(json.dumps(entries) if not isinstance(entries, str) else entries)
    return path


def _repo_lock_entries() -> list[dict]:
    return json.loads((REPO_ROOT / "kernels.lock").read_text())


def test_missing_lock_file(tmp_path: Path) -> None:
    with pytest.raises(flash.FlashKernelError, match=rf"{FA2_PIN} unavailable: .*lock file does not exist"):
        flash.load_flash_kernel("flash_attention_2", tmp_path / "absent.lock")


def test_no_lock_found_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flash, "default_lockfile", lambda: None)
    with pytest.raises(flash.FlashKernelError, match=rf"{FA2_PIN} unavailable: no kernels.lock found"):
        flash.load_flash_kernel("flash_attention_2")


ZERO_HASH = "sha256-" + "0" * 64
MALFORMED = {
    "not_json": "{nope",
    "not_a_list": {"repo_id": FA2_REPO},
    "missing_fields": [{"repo_id": FA2_REPO}],
    "bad_hash": [{"repo_id": FA2_REPO, "sha": FA2_SHA, "variants": {"v": {"hash": "md5-00"}}}],
    "unknown_hash_type": [
        {"repo_id": FA2_REPO, "sha": FA2_SHA, "variants": {"v": {"hash": ZERO_HASH, "hash_type": "x"}}}
    ],
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_lock(name: str, tmp_path: Path) -> None:
    lock = _write_lock(tmp_path / "kernels.lock", MALFORMED[name])
    with pytest.raises(flash.FlashKernelError, match=rf"{FA2_PIN} unavailable: .*(malformed|unreadable)"):
        flash.load_flash_kernel("flash_attention_2", lock)


def test_lock_without_entry_for_pinned_repo(tmp_path: Path) -> None:
    entries = [e for e in _repo_lock_entries() if e["repo_id"] != FA2_REPO]
    lock = _write_lock(tmp_path / "kernels.lock", entries)
    with pytest.raises(flash.FlashKernelError, match=rf"{FA2_PIN} unavailable: .*found 0"):
        flash.load_flash_kernel("flash_attention_2", lock)


def test_lock_with_other_sha_is_refused(tmp_path: Path) -> None:
    entries = _repo_lock_entries()
    other = "0123456789abcdef0123456789abcdef01234567"
    for entry in entries:
        if entry["repo_id"] == FA2_REPO:
            entry["sha"] = other
    lock = _write_lock(tmp_path / "kernels.lock", entries)
    pattern = rf"{FA2_PIN} unavailable: .*lock pins {FA2_REPO}@{other}"
    with pytest.raises(flash.FlashKernelError, match=pattern):
        flash.load_flash_kernel("flash_attention_2", lock)


def test_missing_kernels_package_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kernels", None)
    with pytest.raises(flash.FlashKernelError) as info:
        flash.load_flash_kernel("flash_attention_2", REPO_ROOT / "kernels.lock")
    assert FA2_PIN in str(info.value)
    assert 'pip install "kernels>=0.15.2,<0.16"' in str(info.value)
    assert isinstance(info.value.__cause__, ImportError)


def test_error_survives_pickling() -> None:
    err = pickle.loads(pickle.dumps(flash.FlashKernelError(FA2_REPO, FA2_SHA, "because")))
    assert str(err) == f"FlashAttention kernel {FA2_PIN} unavailable: because"


@pytest.mark.parametrize(
    ("env", "offline"),
    [
        ({}, False),
        ({"HF_HUB_OFFLINE": "1"}, True),
        ({"TRANSFORMERS_OFFLINE": "yes"}, True),
        ({"HF_HUB_OFFLINE": "0"}, False),
    ],
)
def test_offline_switch(env: dict[str, str], offline: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert flash._offline() is offline


# ---------------------------------------------------------------- loads that reach kernels (subprocess)

# One fresh interpreter serves every scenario below (importing torch costs seconds). It first proves that
# importing the module and failing an input check pull in nothing from kernels, then attempts each load.
_SCENARIO_SCRIPT = """
import json, sys
import torch
from fastplms import flash
t = torch.zeros(1, 1, 1, 8, dtype=torch.float16)
try:
    flash.check_flash_inputs(t, t, t)
except ValueError:
    pass
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("kernels", "kernels_data"))
results = {"kernels_modules": loaded}
for name, implementation, lock in json.loads(sys.argv[1]):
    try:
        first = flash.load_flash_kernel(implementation, lock)
        second = flash.load_flash_kernel(implementation, lock)
        results[name] = {"ok": True, "file": first.__file__, "planted": getattr(first, "PLANTED", None),
                         "memoized": first is second}
    except flash.FlashKernelError as exc:
        results[name] = {"ok": False, "msg": str(exc), "cause": repr(exc.__cause__)}
print(json.dumps(results))
"""


def _this_machine_cpu_variant() -> str:
    if platform.system() != "Linux":
        pytest.skip("planted variants are named for Linux builds")
    major, minor = torch.__version__.split(".")[:2]
    abi = "cxx11" if torch.compiled_with_cxx11_abi() else "cxx98"
    return f"torch{major}{minor}-{abi}-cpu-{platform.machine()}-linux"


PLANTED_INIT = b'PLANTED = "fastplms-test-kernel"\n'
PLANTED_METADATA = json.dumps(
    {
        "id": "_flash_attn2_fastplms_planted",
        "name": "flash-attn2",
        "version": 1,
        "license": "MIT",
        "python-depends": [],
        "backend": {"type": "cpu"},
    }
).encode()


def _plant_snapshot(cache: Path, repo_id: str, sha: str, variant: str) -> str:
    """Lay out the HF cache for one kernel variant (symlinks into git blobs); return its lock hash."""
    storage = cache / ("kernels--" + repo_id.replace("/", "--"))
    blobs = storage / "blobs"
    variant_dir = storage / "snapshots" / sha / "build" / variant
    blobs.mkdir(parents=True, exist_ok=True)
    variant_dir.mkdir(parents=True)
    digest = hashlib.sha256()
    files = {"__init__.py": PLANTED_INIT, "metadata.json": PLANTED_METADATA}
    for name in sorted(files, key=str.encode):
        data = files[name]
        blob_id = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (blobs / blob_id).write_bytes(data)
        (variant_dir / name).symlink_to(os.path.relpath(blobs / blob_id, variant_dir))
        # The Hub-side lock recipe: path bytes, then the raw git blob id.
        digest.update(name.encode())
        digest.update(bytes.fromhex(blob_id))
    return f"sha256-{digest.hexdigest()}"


@pytest.fixture(scope="module")
def fresh_interpreter(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Plant a flash-attn2 snapshot (none for flash-attn3) in a private offline cache; run the scenarios."""
    root = tmp_path_factory.mktemp("fresh")
    cache, variant = root / "hf-cache", _this_machine_cpu_variant()
    planted_hash = _plant_snapshot(cache, FA2_REPO, FA2_SHA, variant)
    own_lock = _write_lock(
        root / "kernels.lock",
        [
            {
                "repo_id": FA2_REPO,
                "sha": FA2_SHA,
                "variants": {variant: {"hash": planted_hash, "hash_type": "git_lfs_concat"}},
            }
        ],
    )
    repo_lock = str(REPO_ROOT / "kernels.lock")
    scenarios = [
        ["no_snapshot", "flash_attention_3", repo_lock],
        ["wrong_hash", "flash_attention_2", repo_lock],
        ["own_lock", "flash_attention_2", str(own_lock)],
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_KERNELS", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HUB_OFFLINE="1", KERNELS_CACHE=str(cache), HF_HUB_CACHE=str(cache))
    env["HF_HOME"] = str(root / "home")
    done = subprocess.run(
        [sys.executable, "-c", _SCENARIO_SCRIPT, json.dumps(scenarios)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    results.update(variant=variant, planted_hash=planted_hash)
    return results


def test_module_import_and_input_checks_never_import_kernels(fresh_interpreter: dict) -> None:
    assert fresh_interpreter["kernels_modules"] == []


def test_offline_without_snapshot_names_the_cause(fresh_interpreter: dict) -> None:
    result = fresh_interpreter["no_snapshot"]
    repo_id, sha = flash.FLASH_PINS["flash_attention_3"]
    assert not result["ok"]
    assert f"{repo_id}@{sha}" in result["msg"]
    assert "Cannot find a local snapshot" in result["msg"]
    assert "FileNotFoundError" in result["cause"]


def test_planted_snapshot_with_wrong_hash_is_refused(fresh_interpreter: dict) -> None:
    locked = {e["repo_id"]: e for e in _repo_lock_entries()}[FA2_REPO]["variants"]
    variant = fresh_interpreter["variant"]
    result = fresh_interpreter["wrong_hash"]
    assert not result["ok"]
    assert FA2_PIN in result["msg"]
    if variant in locked:
        assert locked[variant]["hash"] != fresh_interpreter["planted_hash"]
        assert f"hash {locked[variant]['hash']}" in result["msg"]
    else:
        assert "No lock found for build variant" in result["msg"]


def test_planted_snapshot_matching_its_lock_loads(fresh_interpreter: dict) -> None:
    result = fresh_interpreter["own_lock"]
    assert result["ok"], result
    assert result["planted"] == "fastplms-test-kernel"
    assert result["memoized"]
    assert f"snapshots/{FA2_SHA}/build/{fresh_interpreter['variant']}" in result["file"]


def test_only_the_pinned_snapshot_is_accepted(tmp_path: Path) -> None:
    # kernels follows kernel-status.toml redirects online; the resolved folder must still be the pin's.
    storage = tmp_path / ("kernels--" + FA2_REPO.replace("/", "--")) / "snapshots"
    flash._require_pinned_snapshot(storage / FA2_SHA / "build" / "v", FA2_REPO, FA2_SHA)
    moved = [
        storage / ("f" * 40) / "build" / "v",
        tmp_path / "kernels--kernels-community--other" / "snapshots" / FA2_SHA / "build" / "v",
    ]
    for path in moved:
        with pytest.raises(flash.FlashKernelError, match=rf"{FA2_PIN} unavailable: kernels resolved"):
            flash._require_pinned_snapshot(path, FA2_REPO, FA2_SHA)
