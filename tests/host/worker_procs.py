"""A run's DataLoader workers read from outside it: the child processes of a pid and their command lines.

Shared by ``tests/scenarios/test_imagenet_workers.py`` and ``benchmarks/worker_uss.py``, which start a training
script and read its workers' USS from another process (a forked worker's command line is its parent's: a child
whose command line differs is something else, such as the end-of-run writer). Imported by name (this folder is on
the tests' path, ``tests/conftest.py``; the benchmark puts it on its own)."""

from __future__ import annotations

import os

__all__ = ["children", "cmdline"]


def cmdline(pid: int) -> bytes | None:
    """``/proc/<pid>/cmdline`` (None: the process is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s children, from each of its threads' ``/proc/<pid>/task/<tid>/children``."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out
