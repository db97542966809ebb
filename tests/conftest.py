"""Shared pytest setup: ``helpers`` importable, the ``cuda`` marker skipped without a GPU, offline loggers.

Fixtures a test module opts into with ``pytestmark = pytest.mark.usefixtures(...)``: ``one_thread``,
``collected_heap``, ``returned_heap``, ``fresh_accelerate_state``; ``cuda_limited`` for the CUDA tests."""

from __future__ import annotations

import gc
import logging
import os
import sys
from typing import Any, Iterator

import pytest

# One intra-op thread in every process a test starts (examples, CLI commands, drivers): with two
# workers on two cores, a second OpenMP thread per process only waits for a core, spinning (the
# Accelerate example's CPU time: 16.5 s with two threads beside a busy process, 6.4 s with one)
os.environ.setdefault("OMP_NUM_THREADS", "1")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# helpers.py here, and the test modules other tests build on (tests/<wing>/test_*.py import each other by name)
for _folder in [TESTS_DIR] + sorted(os.path.join(TESTS_DIR, d) for d in os.listdir(TESTS_DIR) if d not in ("data", "scripts", "__pycache__")):
    if os.path.isdir(_folder) and _folder not in sys.path:
        sys.path.insert(0, _folder)


def pytest_configure(config: pytest.Config) -> None:
    # Lightning's advice about workers, logging intervals and loops is noise for 4-step fits.
    for message in (
        "does not have many workers",
        "smaller than the logging interval",
        "isinstance\\(treespec, LeafSpec\\)",
        "You passed in a `val_dataloader` but have no `validation_step`",
    ):
        config.addinivalue_line("filterwarnings", f"ignore:.*{message}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    # Tests that compare the process's RSS with tensor sizes run first. Later in a long session,
    # earlier tests' leftovers (threads with their malloc arenas, resident free heap) add to the RSS
    # of a step: in one full CI run every backward peak of tests/preflight/test_preflight_monitor.py read
    # +14 MiB over what the same test measures alone (and over the prediction).
    items[:] = [i for i in items if i.get_closest_marker("rss_sensitive")] + [i for i in items if not i.get_closest_marker("rss_sensitive")]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_and_offline(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No network for any logger, no stray files outside tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    # MLflow 3 refuses the file store unless told; the tests want a plain folder they can read.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("GIT_PYTHON_REFRESH", "quiet")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for the whole module: tiny models on a shared 2-core box, where intra-op
    threads only add contention."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def collected_heap() -> None:
    """Earlier tests' trainers and models wait in reference cycles for the collector; without this
    the census would also see (and spend its time budget searching for) their tensors."""
    gc.collect()


@pytest.fixture
def returned_heap() -> None:
    """Free heap goes back to the OS (``gc.collect`` then glibc's ``malloc_trim(0)``): earlier tests
    leave large free blocks in the heap, still resident, and a new tensor that lands in one raises no
    RSS; after this it faults fresh pages in. A no-op off glibc."""
    gc.collect()
    from memcallbacks._base.cpu import load_malloc_trim

    trim = load_malloc_trim()
    if trim is not None:
        trim()


@pytest.fixture
def fresh_accelerate_state() -> Iterator[Any]:
    """Accelerate keeps process-wide singletons (a ``transformers.Trainer`` builds an Accelerator too);
    every test starts from a clean one.

    One intra-op thread: on a busy 2-core machine, OpenMP threads spinning against other processes
    make these tiny steps 10x slower."""
    import torch
    from accelerate.state import AcceleratorState, GradientState

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.set_num_threads(threads)


@pytest.fixture
def cuda_limited() -> Iterator[None]:
    """GPU 0 limited to ``helpers.CUDA_LIMIT`` by a per-process memory fraction for the test, then given back."""
    import torch
    from helpers import CUDA_LIMIT

    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(CUDA_LIMIT / total, 0)
    yield
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    torch.cuda.empty_cache()
