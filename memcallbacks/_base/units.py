"""Byte units and the one byte formatter every report, finding and table uses."""

from __future__ import annotations

import math

__all__ = ["KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "UNITS", "format_bytes", "format_delta"]

KiB = 2**10
MiB = 2**20
GiB = 2**30
"""One gibibyte, 2**30 bytes (the unit torch and DeepSpeed print as "GB")."""
TiB = 2**40
KB = 10**3
MB = 10**6
GB = 10**9
"""One gigabyte, 10**9 bytes (the unit GPU vendors use for device capacity)."""

UNITS = {"bytes": 1, "B": 1, "KB": KB, "KiB": KiB, "MB": MB, "MiB": MiB, "GB": GB, "GiB": GiB}
"""Unit names accepted by the CLI and ``compare(unit=...)``."""

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: int | float | None, *, missing: str = "-") -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units with one decimal; None or NaN -> ``missing``."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return missing
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    for unit in _BINARY:
        if value < 1024.0 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.1f} {unit}"
        value /= 1024.0
    raise AssertionError("unreachable")


def format_delta(n: int | float | None, *, missing: str = "-") -> str:
    """A signed change: ``+1.5 KiB``, ``-208.0 KiB``, ``+0 B``."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return missing
    text = format_bytes(n)
    return text if text.startswith("-") else "+" + text
