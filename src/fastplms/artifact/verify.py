"""Verify a built artifact: every file against its provenance, then a real load in a fresh process.

The load runs with HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1 and the fastplms package made
unimportable, through every AutoClass in the config's auto_map, exactly as a user would load it. What
the models are fed comes from the family's adapter: this process writes its example inputs to a
safetensors file that the fresh process reads, and, when the family ships a tokenizer, the fresh
process also loads it with AutoTokenizer and encodes the adapter's sequences.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..families import adapter_for
from ..manifest import load_all
from .build import PROVENANCE, sha256_file

# The first lines of a script run in a fresh process: a meta-path finder refuses `fastplms`, so an
# artifact can only work through its own copied runtime modules. The artifact tests reuse it.
NO_FASTPLMS = r"""
import importlib.abc, sys

class _NoFastplms(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fastplms" or name.startswith("fastplms."):
            raise ImportError("fastplms is deliberately unimportable in this fresh process")
        return None

sys.meta_path.insert(0, _NoFastplms())
"""

# Runs in the fresh process: argv = artifact, example-inputs file, JSON list of sequences for the
# tokenizer (empty: the family has none).
LOAD_SCRIPT = (
    NO_FASTPLMS
    + r"""import inspect
import json

try:
    import fastplms  # noqa: F401
    raise SystemExit("fastplms was importable; the check would prove nothing")
except ImportError:
    pass

import torch
import transformers
from safetensors.torch import load_file

artifact, inputs_file, sequences = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
inputs = load_file(inputs_file)
report = {"auto_classes": {}}
config = transformers.AutoConfig.from_pretrained(artifact, trust_remote_code=True)
report["config_class"] = type(config).__module__ + "." + type(config).__name__
if sequences:
    tok = transformers.AutoTokenizer.from_pretrained(artifact, trust_remote_code=True)
    batch = tok(sequences, padding=True, return_tensors="pt")
    shared = sorted(set(batch) & set(inputs))
    report["tokenizer"] = {
        "class": type(tok).__name__,
        "module": type(tok).__module__,
        "compared": shared,
        "matches_inputs": bool(shared) and all(torch.equal(batch[k], inputs[k]) for k in shared),
    }
for name in sorted(config.auto_map):
    if name in ("AutoConfig", "AutoTokenizer"):
        continue
    cls = getattr(transformers, name)
    model = cls.from_pretrained(artifact, trust_remote_code=True).eval()
    if "fastplms" in sys.modules:
        raise SystemExit("fastplms was imported during loading")
    # Decoder inputs (a sequence-to-sequence family's) go only to classes that take them.
    takes = inspect.signature(model.forward).parameters
    feed = {k: v for k, v in inputs.items() if not k.startswith("decoder_") or k in takes}
    with torch.no_grad():
        out = model(**feed)
    tensor = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    report["auto_classes"][name] = {
        "class": type(model).__name__, "module": type(model).__module__,
        "output_shape": list(tensor.shape), "finite": bool(torch.isfinite(tensor).all()),
    }
print("FASTPLMS-VERIFY " + json.dumps(report))
"""
)


def offline_env(modules_cache: str | Path) -> dict[str, str]:
    """The environment of a fresh process that loads artifacts as a user would, offline: this one's, plus
    HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, remote code cached in ``modules_cache``, and no PYTHONPATH."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_MODULES_CACHE": str(modules_cache),
        "PYTHONPATH": "",
    }


def check_hashes(artifact: Path) -> list[str]:
    """Problems found re-hashing `artifact` against its provenance record."""
    record_path = artifact / PROVENANCE
    if not record_path.is_file():
        return [f"{artifact} has no {PROVENANCE}; it is not a fastplms build"]
    record = json.loads(record_path.read_text())
    expected = record.get("files", {})
    present = {p.relative_to(artifact).as_posix() for p in artifact.rglob("*") if p.is_file() and p.name != PROVENANCE}
    problems = [f"missing file: {name}" for name in sorted(set(expected) - present)]
    problems += [f"file not in provenance: {name}" for name in sorted(present - set(expected))]
    problems += [
        f"hash mismatch: {name}"
        for name in sorted(set(expected) & present)
        if sha256_file(artifact / name) != expected[name]
    ]
    return problems


def load_in_fresh_process(artifact: Path, timeout: float = 900) -> dict:
    """Load the artifact through every AutoClass in a fresh offline process without fastplms."""
    from safetensors.torch import save_file

    record = json.loads((artifact / PROVENANCE).read_text())
    families = load_all(resolve=False)
    if record.get("family") not in families:
        raise RuntimeError(f"{artifact}: provenance names family {record.get('family')!r}, which has no manifest")
    adapter = adapter_for(families[record["family"]])
    sequences = list(adapter.tokenizer.check) if adapter.tokenizer is not None else []
    with tempfile.TemporaryDirectory() as modules:
        inputs_file = Path(modules) / "inputs.safetensors"
        save_file({k: v.contiguous() for k, v in adapter.example_inputs(artifact).items()}, str(inputs_file))
        proc = subprocess.run(
            [sys.executable, "-c", LOAD_SCRIPT, str(artifact.resolve()), str(inputs_file), json.dumps(sequences)],
            env=offline_env(modules),
            cwd=modules,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    for line in proc.stdout.splitlines():
        if line.startswith("FASTPLMS-VERIFY "):
            return json.loads(line.removeprefix("FASTPLMS-VERIFY "))
    raise RuntimeError(f"loading {artifact} in a fresh process failed:\n{proc.stderr[-4000:]}")


def verify(artifact: str | Path) -> tuple[list[str], dict | None]:
    """(problems, load report). No problems means the artifact is intact and loads offline."""
    artifact = Path(artifact)
    problems = check_hashes(artifact)
    if problems:
        return problems, None
    try:
        report = load_in_fresh_process(artifact)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return [str(exc)], None
    problems += [f"{name}: non-finite output" for name, r in report["auto_classes"].items() if not r["finite"]]
    tokenizer = report.get("tokenizer")
    if tokenizer is not None and not tokenizer["matches_inputs"]:
        problems.append(
            f"AutoTokenizer ({tokenizer['class']}) encodes the check sequences differently from the source tree "
            f"(compared: {', '.join(tokenizer['compared']) or 'no shared keys'})"
        )
    return problems, report
