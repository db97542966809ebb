"""Every name the README and the docs tell users to import works from the path they give,
and every public module declares ``__all__``."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import memcallbacks

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FROM_IMPORT = re.compile(r"^[ \t]*(?:>>>[ \t]*)?from[ \t]+(memcallbacks[\w.]*)[ \t]+import[ \t]+(\([\w\s,]+\)|[\w \t,]+)", re.M)
PLAIN_IMPORT = re.compile(r"^\s*(?:>>>\s*)?import\s+(memcallbacks[\w.]*)", re.M)
DOTTED = re.compile(r"`(memcallbacks(?:\.[a-z_]\w*)+)(?:\(\))?`")


def _documented() -> list[tuple[str, str, str | None]]:
    found: set[tuple[str, str, str | None]] = set()
    for doc in DOCS:
        text = doc.read_text()
        for module, names in FROM_IMPORT.findall(text):
            for name in (n.strip() for n in names.strip("()").replace("\n", ",").split(",")):
                if name and name != "as":
                    found.add((doc.name, module, name.split(" as ")[0].strip()))
        for module in PLAIN_IMPORT.findall(text):
            found.add((doc.name, module, None))
    return sorted(found, key=lambda x: (x[0], x[1], x[2] or ""))


DOCUMENTED = _documented()


def test_the_docs_name_imports():
    assert len(DOCUMENTED) >= 10, DOCUMENTED  # the parser still finds the docs' import lines


@pytest.mark.parametrize(("doc", "module", "name"), DOCUMENTED, ids=[f"{d}:{m}.{n or ''}" for d, m, n in DOCUMENTED])
def test_documented_import_works(doc, module, name):
    mod = importlib.import_module(module)
    if name is not None:
        assert hasattr(mod, name), f"{doc} tells users `from {module} import {name}`, which fails."
        if not module.split(".")[-1].startswith("_") and not any(p.startswith("_") for p in module.split(".")):
            public = getattr(mod, "__all__", None)
            assert public is None or name in public or name[0].isupper() or module == "memcallbacks", (
                f"{doc}: {module}.{name} is documented but not in {module}.__all__"
            )


def test_documented_dotted_paths_resolve():
    """`memcallbacks.snapshot.load_snapshot`-style references in the docs resolve to a module or attribute."""
    missing = []
    for doc in DOCS:
        for dotted in set(DOTTED.findall(doc.read_text())):
            parts = dotted.split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                try:
                    for attr in parts[cut:]:
                        obj = getattr(obj, attr)
                except AttributeError:
                    missing.append(f"{doc.name}: {dotted}")
                break
            else:
                missing.append(f"{doc.name}: {dotted}")
    assert not missing, "documented paths that do not resolve:\n" + "\n".join(missing)


def test_docs_send_users_to_no_private_module():
    private = []
    for doc in DOCS:
        if doc.name == "architecture.md":  # the maintainers' map names private modules on purpose
            continue
        for module, _ in FROM_IMPORT.findall(doc.read_text()):
            if any(part.startswith("_") for part in module.split(".")):
                private.append(f"{doc.name}: from {module} import ...")
    assert not private, "user docs import from private modules:\n" + "\n".join(private)


PUBLIC_PACKAGES = ["memcallbacks.leaks", "memcallbacks.snapshot", "memcallbacks.estimate", "memcallbacks.cli"]


@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_every_module_of_a_wing_declares_all(package):
    pkg = importlib.import_module(package)
    names = [package] + [f"{package}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
    lacking = [name for name in names if not hasattr(importlib.import_module(name), "__all__")]
    assert not lacking, f"modules without __all__: {lacking}"


def test_top_level_all_resolves():
    for name in memcallbacks.__all__:
        if name in ("MemoryMonitor",):
            pytest.importorskip("lightning")
        if name in ("AccelerateMemoryMonitor",):
            pytest.importorskip("accelerate")
        if name in ("MemoryMonitorCallback",):
            pytest.importorskip("transformers")
        assert getattr(memcallbacks, name) is not None
