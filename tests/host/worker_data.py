"""The copy-on-access Dataset the DataLoader-worker tests and ``benchmarks/worker_reads.py`` train on.

Imported by name: by the in-process tests (this folder is on the tests' path, ``tests/conftest.py``) and
by the scripts they and the benchmark run in processes of their own (``PYTHONPATH`` names this folder)."""

from __future__ import annotations

import os

import torch

FOLDER = os.path.dirname(os.path.abspath(__file__))
"""This folder, for a child process's ``PYTHONPATH``."""


class Records(torch.utils.data.Dataset):
    """A Python list of dicts: every item read writes its objects' reference counts (copy on access)."""

    def __init__(self, n: int) -> None:
        self.items = [{"id": i, "x": float(i), "label": f"item-{i}"} for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        d = self.items[i]
        return torch.tensor([d["x"], float(d["id"])]).repeat(32)  # 64 values: the tests' MLP input
