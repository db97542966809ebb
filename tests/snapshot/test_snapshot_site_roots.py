"""Which frames are the monitor's or torch's own: decided by the real package roots, not by a folder's name."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch

import memcallbacks
from memcallbacks.snapshot import CpuCapture, summarize_snapshot
from memcallbacks.snapshot.sites import Allocation

MIB = 2**20

USER_CODE = '''
import torch

kept = []


def train_step(x):
    kept.append(torch.empty(2 * 2**20, dtype=torch.uint8))  # the planted allocation, 2 MiB
    return (x * 2).sum()
'''


def _user_module(root: Path, monkeypatch: pytest.MonkeyPatch):
    """A user's package inside a virtual environment that lives in a folder named ``torch``."""
    site = root / "torch" / "venv" / "lib" / "python3.11" / "site-packages"
    (site / "userlib_in_torch_folder").mkdir(parents=True)
    (site / "userlib_in_torch_folder" / "__init__.py").write_text("")
    path = site / "userlib_in_torch_folder" / "train.py"
    path.write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(site))
    return importlib.import_module("userlib_in_torch_folder.train"), path


def test_a_venv_inside_a_folder_named_torch_is_user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module, path = _user_module(tmp_path, monkeypatch)
    capture = CpuCapture(steps=1, census=False, record_shapes=False)
    capture.start(step=0)
    module.train_step(torch.ones(16))
    assert capture.step()
    (device,) = summarize_snapshot(capture.snapshot).devices
    planted = [r for r in device.stayed_alive if r.bytes >= 2 * MIB]
    assert planted, [(r.site, r.bytes) for r in device.stayed_alive]
    assert planted[0].site.startswith("train.py:") and planted[0].site.endswith(" in train_step")
    # the profiler trims a file to its sys.path entry: "userlib_in_torch_folder/train.py" (CUDA snapshots keep the
    # absolute path, the case the next test covers)
    assert planted[0].site_file.split(":")[0] in (str(path), "userlib_in_torch_folder/train.py")


def test_frames_in_the_real_roots_and_installed_or_trimmed_packages_are_internal() -> None:
    user = {"filename": "/work/torch/venv/lib/python3.11/site-packages/userlib/train.py", "line": 8, "name": "train_step"}
    torch_dir = Path(torch.__file__).parent
    package = Path(memcallbacks.__file__).parent
    internal = (
        str(torch_dir / "nn" / "modules" / "linear.py"),  # this process's torch
        str(package / "snapshot" / "record.py"),  # this process's memcallbacks
        "/opt/conda/lib/python3.11/site-packages/torch/nn/modules/module.py",  # another machine's torch (a loaded snapshot)
        "/usr/lib/python3/dist-packages/memcallbacks/monitor.py",
        "torch/nn/modules/linear.py",  # trimmed by the profiler
    )
    for inner in internal:
        alloc = Allocation(0x1000, 64, ({"filename": inner, "line": 7, "name": "inner"}, user), index=0)
        assert alloc.site == "train.py:8 in train_step", inner
    # folders that are only named like the packages are user code
    for outside in ("/work/torch/train.py", "/home/me/memcallbacks/train.py", "/srv/torch/venv/bin/run.py"):
        alloc = Allocation(0x1000, 64, ({"filename": outside, "line": 3, "name": "main"}, user), index=0)
        assert alloc.site == f"{os.path.basename(outside)}:3 in main", outside
