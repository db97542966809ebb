"""Byte units, the one byte formatter every report and finding uses, sizes ("80 GiB"), durations."""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "UNITS", "format_bytes", "format_delta", "parse_size", "parse_threshold",
           "ordinal", "format_duration"]

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

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: int | float | None, *, missing: str = "-") -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units with one decimal; None or NaN -> ``missing``."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return missing
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    for unit in _BINARY:
        if value < 1024.0 or unit == "EiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.1f} {unit}"
        value /= 1024.0
    raise AssertionError("unreachable")


def format_delta(n: int | float | None, *, missing: str = "-") -> str:
    """A signed change: ``+1.5 KiB``, ``-208.0 KiB``, ``+0 B``."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return missing
    text = format_bytes(n)
    return text if text.startswith("-") else "+" + text


_SIZE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def _named(name: str, value: Any) -> str:
    """``("train_memory(max_leak)", "4 pc")`` -> ``"train_memory(max_leak='4 pc')"``."""
    return f"{name[:-1]}={value!r})" if name.endswith(")") else f"{name}={value!r}"


def parse_size(value: Any, name: str) -> int:
    """``"4 MiB"`` -> 4194304; an int is bytes. Raise ValueError naming ``name`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{_named(name, value)} is not a size; pass bytes as an int or a string such as '4 MiB', '2 GiB' or '0 B'.")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{_named(name, value)} is negative; pass 0 or more bytes, e.g. '0 B' or '4 MiB'.")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else ""
        if match and unit in _SIZE_UNITS or match and unit == "":
            return int(round(float(match.group(1)) * _SIZE_UNITS.get(unit, 1)))
    raise ValueError(
        f"{_named(name, value)} is not a size; pass bytes as an int or a string such as '4 MiB', '2 GiB' or '0 B' "
        "(units: B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB in powers of ten)."
    )


def parse_threshold(text: str, name: str, *, percent: bool = True, size: bool = True) -> tuple[float, bool]:
    """A limit given on a command line: ``"5%"`` -> ``(0.05, True)``, ``"64 MiB"`` -> ``(67108864, False)``.
    A number without a unit is refused (``5`` is not 5 bytes), the error naming ``name`` and the fix;
    ``percent`` / ``size``: which of the two the option takes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(%|[A-Za-z]*)\s*", str(text))
    number, unit = (match.group(1), match.group(2)) if match else ("", "")
    fixes = ([f"{float(number) * 100:g}%" if number and float(number) < 1 and not size else f"{number or 5}%"] if percent else [])
    fixes += [f"{number or 64} MiB"] if size else []
    kinds = " or ".join(k for k, on in (("a percentage", percent), ("a size", size)) if on)
    if match and unit == "":
        raise ValueError(f"{name} {text!r} has no unit; pass {' or '.join(fixes)} ({kinds}).")
    if match and unit == "%" and percent:
        return float(number) / 100.0, True
    if match and unit.lower() in _SIZE_UNITS and size:
        return float(number) * _SIZE_UNITS[unit.lower()], False
    raise ValueError(f"{name} {text!r} is not {kinds}; pass e.g. {' or '.join(fixes)}.")


def ordinal(n: int) -> str:
    """``2`` -> ``"2nd"``, ``11`` -> ``"11th"``, ``23`` -> ``"23rd"``: "every 2nd step"."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def format_duration(seconds: float | None, *, missing: str = "-") -> str:
    """``25.4`` -> ``"25 s"``, ``200`` -> ``"3.3 min"``, ``9000`` -> ``"2.5 h"``, ``400000`` -> ``"4.6 days"``."""
    if seconds is None or not math.isfinite(seconds):
        return missing
    if seconds < 0.1:
        return "<0.1 s"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
