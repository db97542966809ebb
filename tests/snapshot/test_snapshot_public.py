"""The snapshot wing's public line: what docs/snapshots.md tells users to import works from that path."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import memcallbacks
import memcallbacks.snapshot as snapshot
from memcallbacks.snapshot import Allocation

DOC = Path(__file__).resolve().parents[2] / "docs" / "snapshots.md"


def test_documented_imports_work() -> None:
    imports = re.findall(r"^from (memcallbacks[\w.]*) import (.+)$", DOC.read_text(), flags=re.M)
    assert imports, "docs/snapshots.md shows no import line"
    for module, names in imports:
        loaded = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(loaded, name), f"docs/snapshots.md: `from {module} import {name}` fails"


def test_every_documented_call_is_public() -> None:
    table = DOC.read_text().split("## For the monitor: the Python API", 1)[1].split("## The test data", 1)[0]
    called = set(re.findall(r"`([A-Za-z_]+)\(", table)) | set(re.findall(r"\b([A-Z][A-Z_]+_FILE)\b", table))
    called -= {name for name in dir(snapshot.CpuCapture) if not name.startswith("_")}  # its methods: start(), step(), ...
    assert called >= {"start_recording", "dump_snapshot", "CpuCapture", "load_snapshot", "render_snapshot", "SNAPSHOT_FILE"}
    assert called <= set(snapshot.__all__), sorted(called - set(snapshot.__all__))
    assert all(hasattr(snapshot, name) for name in snapshot.__all__)


def test_every_module_in_the_wing_declares_all() -> None:
    for info in pkgutil.iter_modules(snapshot.__path__):
        module = importlib.import_module(f"memcallbacks.snapshot.{info.name}")
        assert isinstance(getattr(module, "__all__", None), list), f"memcallbacks.snapshot.{info.name} has no __all__"
        assert all(hasattr(module, name) for name in module.__all__), info.name


def test_site_skips_frames_in_every_wing_of_the_package() -> None:
    """An allocation made inside the monitor (any wing, absolute or profiler-trimmed path) is named by the user's line."""
    package = Path(memcallbacks.__file__).parent
    user = {"filename": "/home/me/train.py", "line": 42, "name": "train_step"}
    for inner in (str(package / "_runtime" / "session.py"), str(package / "monitor.py"), "memcallbacks/leaks/census.py"):
        alloc = Allocation(0x1000, 64, ({"filename": inner, "line": 7, "name": "sample"}, user), index=0)
        assert alloc.site == "train.py:42 in train_step", inner
    own = Allocation(0x1000, 64, ({"filename": "/home/me/memcallbacks_demo/run.py", "line": 3, "name": "main"},), index=0)
    assert own.site == "run.py:3 in main"
