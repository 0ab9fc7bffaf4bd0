"""The tree says what ships: the top-level modules of src/fastplms/ are exactly the artifacts' runtime.

The runtime set is derived, never listed: the import closure of every family's entry points (the
modules its manifest's AutoClasses name, plus its adapter's tokenizer module). Everything else lives in
subpackages, which never ship, and which the generic builder, verifier and parity driver keep free of
family names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import fastplms
from fastplms.artifact.build import runtime_closure
from fastplms.families import adapter_for, entry_modules
from fastplms.manifest import load_all

SRC = Path(fastplms.__file__).resolve().parent
FAMILIES = load_all(resolve=False)
TOP_LEVEL = {p.stem for p in SRC.glob("*.py") if p.name != "__init__.py"}
SUBPACKAGES = {p.parent.name for p in SRC.glob("*/__init__.py")}
# Family-neutral by design: what every family goes through.
GENERIC = ["artifact/build.py", "artifact/verify.py", "artifact/snapshot.py", "parity/driver.py"]
GENERIC += ["families/__init__.py", "families/adapter.py"]


def test_top_level_modules_are_exactly_the_runtime_closure_of_every_family():
    shipped: set[str] = set()
    for family in FAMILIES.values():
        shipped |= set(runtime_closure(entry_modules(family, adapter_for(family))))
    assert sorted(TOP_LEVEL - shipped) == [], "top-level modules no artifact ships: move them into a subpackage"
    assert sorted(shipped - TOP_LEVEL) == []


def test_the_source_package_has_its_subpackages():
    assert {"artifact", "cli", "convert", "families", "manifest", "oracles", "parity"} <= SUBPACKAGES
    assert "build" not in SUBPACKAGES  # git-ignored as a build output


@pytest.mark.parametrize("module", sorted(TOP_LEVEL))
def test_runtime_modules_import_no_subpackage(module):
    tree = ast.parse((SRC / f"{module}.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            assert node.level == 1 and node.module, f"{module}.py: only 'from .sibling import ...' is allowed"
            assert node.module.split(".")[0] not in SUBPACKAGES, f"{module}.py imports subpackage {node.module}"
            assert node.module in TOP_LEVEL, f"{module}.py imports .{node.module}, not a top-level module"
        elif isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] != "fastplms", f"{module}.py imports {node.module}"
        elif isinstance(node, ast.Import):
            assert all(a.name.split(".")[0] != "fastplms" for a in node.names), f"{module}.py imports fastplms"


def _family_words() -> set[str]:
    words = set()
    for family in FAMILIES.values():
        words |= {family.id, family.architecture, family.name, family.upstream.repo}
        # "transformers" is also the library every module uses; the other source kinds are family layouts.
        words |= {s.kind for c in family.checkpoints for s in c.sources if s.kind != "transformers"}
    return words


@pytest.mark.parametrize("path", GENERIC)
def test_generic_modules_name_no_family(path):
    text = (SRC / path).read_text(encoding="utf-8")
    for word in sorted(_family_words()):
        found = re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text, re.IGNORECASE)
        assert found is None, f"{path} names {word!r}: family knowledge belongs in families/<architecture>.py"


def test_every_family_has_an_adapter_whose_pretrained_class_it_advertises():
    for family in FAMILIES.values():
        adapter = adapter_for(family)
        assert adapter.pretrained_auto_class in family.auto_classes, family.id
        if adapter.tokenizer is not None:
            assert adapter.tokenizer.module in TOP_LEVEL and adapter.tokenizer.check, family.id
