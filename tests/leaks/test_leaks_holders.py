"""The leaks wing's public face, the roots rule for the package's own frames, and holder formatting."""

from __future__ import annotations

import importlib
import os
import pkgutil

import pytest
import torch
from torch import nn

import memcallbacks
import memcallbacks.leaks
from memcallbacks.leaks import Census, find_holders, take_census
from memcallbacks.leaks.census import format_top_holders

MiB = 1024 * 1024
BUDGET = 30.0

pytestmark = pytest.mark.usefixtures("one_thread")


def test_public_face_and_every_module_lists_what_it_exports():
    assert sorted(memcallbacks.leaks.__all__) == ["Census", "find_holders", "take_census"]
    for info in pkgutil.iter_modules(memcallbacks.leaks.__path__):
        module = importlib.import_module(f"memcallbacks.leaks.{info.name}")
        assert module.__all__, info.name
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, (info.name, missing)


def test_frames_running_memcallbacks_code_are_not_roots():
    """A holder is named from the user's frame, not from the monitor code (session, adapters) that asked."""
    package_file = os.path.join(os.path.dirname(memcallbacks.__file__), "_runtime", "a_caller.py")
    namespace = {"find_holders": find_holders}
    exec(compile("def ask(held):\n    return find_holders(held, time_budget_s=30.0)\n", package_file, "exec"), namespace)
    kept = [torch.zeros(256 * 1024)]
    paths = [p.path for p in namespace["ask"](kept).paths]
    assert paths and paths[0].startswith("test_frames_running_memcallbacks_code_are_not_roots() local kept[0]"), paths


class _Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cache = [torch.zeros(64 * 1024) for _ in range(40)]  # 40 x 256 KiB


def test_format_top_holders_names_holder_count_and_size():
    model = _Cached()
    census = take_census(model=model, time_budget_s=BUDGET)
    assert isinstance(census, Census)
    lines = format_top_holders(census, 1)
    assert lines == ["_Cached.cache (40 tensors, 10.0 MiB)"], lines
    assert len(format_top_holders(census, 5)) <= 6
