"""The ``train_memory`` marker's limits: size strings parsed and checked once, before the test."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from memcallbacks._base.config import check_config_names
from memcallbacks._base.units import parse_size

__all__ = ["Limits", "PHASE_NAMES"]

PHASE_NAMES = ("forward", "backward", "optimizer", "other", "step")
"""Phases a limit can name: the monitor's four phases, and ``step`` (the peak over the whole step)."""

FAIL_ON = ("advice", "settled")


def parse_fail_on(value: Any, name: str) -> tuple[str, ...]:
    """``"advice"``, ``["advice", "settled"]`` or ``()`` as a checked tuple."""
    items = (value,) if isinstance(value, str) else value
    try:
        items = tuple(items)
    except TypeError:
        items = (value,)
    bad = [v for v in items if v not in FAIL_ON]
    if bad:
        raise ValueError(f"{name}={value!r} has {', '.join(map(repr, bad))}; use any of {FAIL_ON}, e.g. "
                         "fail_on=('advice',) to fail on a lingering output kept one step, or () for open problems only.")
    return items


@dataclass(frozen=True)
class Limits:
    """What a ``train_memory`` test must stay within. Built by :meth:`from_marker` or :meth:`build`."""

    max_leak: int = 0
    """Bytes of tensor memory alive after the last step beyond what was alive after ``warmup`` steps."""
    max_peak: int | None = None
    """Bytes: no phase of any step may peak above it."""
    warmup: int = 2
    """Optimizer steps before the leak baseline is taken (optimizer state and lazy buffers appear there)."""
    phases: dict[str, int] = field(default_factory=dict)
    """Per-phase peak limits in bytes, keys from :data:`PHASE_NAMES`."""
    config: dict[str, Any] = field(default_factory=dict)
    """Further ``MonitorConfig`` fields for the monitors the plugin attaches (e.g. ``gc_every_n_steps``)."""
    fail_on: tuple[str, ...] | None = None
    """Findings that fail the test besides open problems: ``"advice"`` (a lingering output kept one step),
    ``"settled"`` (growth that stopped). None: the ``train_memory_fail_on`` ini value (default: neither)."""

    @classmethod
    def build(
        cls,
        max_leak: Any = "0 B",
        max_peak: Any = None,
        warmup: Any = 2,
        phases: Mapping[str, Any] | None = None,
        fail_on: Any = None,
        **config: Any,
    ) -> "Limits":
        where = "train_memory"
        leak = parse_size(max_leak, f"{where}(max_leak)")
        peak = None if max_peak is None else parse_size(max_peak, f"{where}(max_peak)")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"{where}(warmup={warmup!r}) must be a positive number of optimizer steps, e.g. warmup=2.")
        if phases is None:
            phases = {}
        if not isinstance(phases, Mapping):
            raise ValueError(f"{where}(phases={phases!r}) must be a dict such as {{'backward': '2 GiB'}}.")
        unknown = sorted(set(phases) - set(PHASE_NAMES))
        if unknown:
            raise ValueError(f"{where}(phases=...) has unknown phase(s) {', '.join(map(repr, unknown))}; use {', '.join(PHASE_NAMES)}.")
        parsed = {k: parse_size(v, f"{where}(phases[{k!r}])") for k, v in phases.items()}
        try:
            check_config_names(config, where)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        return cls(max_leak=leak, max_peak=peak, warmup=warmup, phases=parsed, config=dict(config),
                   fail_on=None if fail_on is None else parse_fail_on(fail_on, f"{where}(fail_on)"))

    @classmethod
    def from_marker(cls, marker: Any) -> "Limits":
        """From ``@pytest.mark.train_memory(...)`` (keywords, or max_leak as the one positional argument)."""
        args, kwargs = tuple(marker.args), dict(marker.kwargs)
        if len(args) > 1:
            raise ValueError(f"train_memory takes at most one positional argument (max_leak), got {args!r}; pass the rest by keyword.")
        if args:
            if "max_leak" in kwargs:
                raise ValueError("train_memory got max_leak twice (positionally and by keyword); pass it once.")
            kwargs["max_leak"] = args[0]
        return cls.build(**kwargs)

    def replace(self, **changes: Any) -> "Limits":
        """These limits with some arguments given again (as :meth:`build` takes them)."""
        current: dict[str, Any] = {"max_leak": self.max_leak, "max_peak": self.max_peak, "warmup": self.warmup,
                                   "phases": dict(self.phases), "fail_on": self.fail_on}
        current.update(self.config)
        current.update(changes)
        return Limits.build(**current)

    def peak_limits(self) -> dict[str, int]:
        """``{phase: bytes}``: ``max_peak`` for every phase, overridden per phase by ``phases``."""
        out = {name: self.max_peak for name in PHASE_NAMES if self.max_peak is not None}
        out.update(self.phases)
        return out  # type: ignore[return-value]
