"""The estimate wing's public face: what docs/theory.md and the README import, ``__all__`` in every module, one strategy-name mapping."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest
from torch import nn

import memcallbacks.estimate as wing
from memcallbacks.estimate import STRATEGIES, estimate
from memcallbacks.estimate.layers import detect_strategy
from memcallbacks.estimate.tables import canonical_strategy

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(m.name for m in pkgutil.iter_modules(wing.__path__))


def _documented_imports() -> set[str]:
    """Names the docs and the README import from ``memcallbacks.estimate``."""
    names: set[str] = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for found in re.findall(r"from memcallbacks\.estimate import ([\w, ]+)", doc.read_text()):
            names.update(n.strip() for n in found.split(","))
    return names


def test_every_name_the_docs_import_is_public() -> None:
    documented = _documented_imports()
    assert {"estimate", "estimate_for", "measure_model_states", "compare", "GB"} <= documented  # docs/theory.md
    assert documented <= set(wing.__all__)
    for name in wing.__all__:
        assert getattr(wing, name) is not None


@pytest.mark.parametrize("module", MODULES)
def test_every_module_lists_what_it_exports(module: str) -> None:
    mod = importlib.import_module(f"memcallbacks.estimate.{module}")
    assert isinstance(mod.__all__, list)
    for name in mod.__all__:
        assert hasattr(mod, name), f"memcallbacks.estimate.{module}.__all__ names {name!r}, which it does not define"


def test_one_strategy_mapping_for_arguments_and_detection() -> None:
    assert [canonical_strategy(s) for s in STRATEGIES] == list(STRATEGIES)
    assert canonical_strategy(" Deepspeed_Stage_3 ") == "zero3"
    # the names detection passes in are the class names of torch's wrappers
    assert [canonical_strategy(n) for n in ("DistributedDataParallel", "FullyShardedDataParallel", "FSDPModule")] == [
        "ddp",
        "fsdp",
        "fsdp2",
    ]
    assert detect_strategy(nn.Linear(2, 2)) == "single"
    with pytest.raises(ValueError, match=r"^estimate_grid\(\): strategy='fsdp3' is not one of 'single'"):
        canonical_strategy("fsdp3", "estimate_grid")
    ddp = estimate(num_params=1e6, strategy="DistributedDataParallel", world_size=2)
    assert ddp.strategy == "ddp" and ddp == estimate(num_params=1e6, strategy="ddp", world_size=2)
