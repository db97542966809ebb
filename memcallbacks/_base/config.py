"""The monitor's configuration: ``MonitorConfig``, and the flat settings the runtime reads.

A person sets the fields of :class:`MonitorConfig`; the thresholds of leak detection, the
snapshot triggers and the settings few runs change are grouped (:mod:`~memcallbacks._base.options`).
The runtime reads one flat :class:`Settings` made from it (:func:`settings_of`), so a setting can
move between groups without touching it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from memcallbacks._base.keys import check_log_keys, logged_keys
from memcallbacks._base.options import (
    FLAT_NAMES, GROUPS, AdvancedOptions, KeywordCheck, LeakOptions, SnapshotOptions, check_bools, check_int, invalid, keyword_names,
    normalise, refuse_unknown,
)

__all__ = ["MonitorConfig", "Settings", "settings_of", "resolve_config", "check_config_names", "given_fields"]


@dataclass(frozen=True, kw_only=True)
class MonitorConfig(KeywordCheck):
    """Everything the memory monitor can be told. Every adapter takes these names as keyword arguments."""

    log_every_n_steps: int | None = None
    """Log ``memory/...`` metrics every N optimizer steps. ``None`` follows the framework
    (Lightning's ``Trainer(log_every_n_steps=...)``, the Trainer's ``logging_steps``; 50 elsewhere).
    What is measured between logged steps is in ``history`` and the files, not the logger."""

    sample_every_n_steps: int | None = None
    """Measure per-phase peaks on every N-th optimizer step (and always on logged steps); the other
    steps are watched at most (a cheap memory read for leak detection on some of them) and leave
    no row. ``None``: the monitor measures its own cost and the step time and picks the interval
    that keeps it within ``advanced.overhead_budget``."""

    log_keys: str | Sequence[str] = "default"
    """Which keys the loggers get: ``"default"``, the short list a person reads (per-phase peaks,
    reserved, the step-start floor, findings, host memory; an evaluation loop's peak; the keys of
    ``preflight``, ``auto_snapshot`` and ``leaks.gc_every_n_steps`` when they are on), ``"all"``,
    or a list of names (``["default", "peak_step_GiB"]``); docs/metrics.md lists them."""

    output_dir: str | None = None
    """Folder for ``history.csv``, ``report.json`` and ``memory.png``. ``None``: a ``memcallbacks``
    folder inside the framework's own folder (Lightning's log dir, the Trainer's ``output_dir``,
    Accelerate's ``project_dir``), or ``./memcallbacks_output`` for plain loops."""

    write_files: bool = True
    """Write the output files at the end of fit (and on an OOM). ``False`` keeps everything in memory."""

    plot: bool = True
    """Write ``memory.png`` (needs matplotlib; skipped with one warning when it is missing)."""

    console_summary: bool = True
    """At the end of a run, rank zero shows the verdict (no problem found, or one line per problem)
    and the files' folder on the console: through ``rank_zero_info`` under Lightning, ``print``
    elsewhere. ``False``: nothing is printed."""

    detect_leaks: bool = True
    """Look for leaks: ``"lingering"`` (the previous step's batch or loss graph still alive when
    the next step starts) and ``"growth"`` (the step-start baseline rising step over step).
    Findings name their holders. Thresholds: ``leaks``."""

    watch_host: bool = True
    """Watch the host beside the device (docs/host.md): Python-object memory, the process's private
    resident memory and the DataLoader workers' private memory, with their own growth test, a
    census naming the type and holder after suspicion, and the ``memory/host_*`` keys. ``False``
    turns the whole host channel off (``report.json`` ``host`` is ``null``)."""

    preflight: bool = False
    """Before the first step runs, predict its memory per phase on fake tensors, warn when it
    exceeds ``capacity_bytes`` (naming the phase, the biggest holders and the largest batch size
    that fits), and compare every sampled steady-state step's measured peaks with the prediction
    (a ``"preflight"`` finding past ``advanced.preflight_tolerance``). See docs/preflight.md."""

    capacity_bytes: int | str | None = None
    """With ``preflight=True``: the bytes the predicted peak is checked against (an int or a size
    such as ``"80 GiB"``). ``None``: the device's capacity (CUDA: total memory; CPU: host RAM)."""

    auto_snapshot: bool = False
    """Capture memory snapshots when something goes wrong: a step's peak near the device's
    capacity, allocator retries, a new finding, an out-of-memory error (triggers: ``snapshot``).
    Files go to ``<output_dir>/snapshots`` with an offline HTML/PNG summary; docs/snapshots.md."""

    leaks: LeakOptions = LeakOptions()
    """Thresholds of leak detection, periodic garbage collection and the theory check."""

    snapshot: SnapshotOptions = SnapshotOptions()
    """Triggers and budgets of ``auto_snapshot``."""

    advanced: AdvancedOptions = AdvancedOptions()
    """Settings few runs change (overhead budget, CPU malloc, prefix, strict, ...)."""

    def __post_init__(self) -> None:
        owner = "MonitorConfig"
        for name, cls in GROUPS.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):  # a dict of the group's fields (a YAML mapping, a pytest marker)
                object.__setattr__(self, name, cls(**value))
            elif not isinstance(value, cls):
                raise invalid(owner, name, value, f"pass {cls.__name__}(...) or a dict of its fields.")
        written = normalise(owner, self)
        object.__setattr__(self, "log_keys", check_log_keys(self.log_keys, owner))
        self._check_cadence_and_files()
        self._check_switches(written)

    def _check_cadence_and_files(self) -> None:
        owner = "MonitorConfig"
        check_int(owner, self, "log_every_n_steps", 1, "pass a positive integer, or None to follow the framework's setting.", none=True)
        check_int(owner, self, "sample_every_n_steps", 1, "pass a positive integer (1 = every step), or None to choose per device.", none=True)
        if self.output_dir is not None and not isinstance(self.output_dir, (str, os.PathLike)):
            raise invalid(owner, "output_dir", self.output_dir, "pass a folder path (str or os.PathLike) or None.")
        if self.output_dir is not None:
            object.__setattr__(self, "output_dir", os.fspath(self.output_dir))
            if not str(self.output_dir).strip():
                raise invalid(owner, "output_dir", self.output_dir, "pass a folder path, or None for the default folder.")
        check_bools(owner, self, "write_files", "plot", "console_summary", "detect_leaks", "watch_host", "preflight", "auto_snapshot")

    def _check_switches(self, written: dict[str, Any]) -> None:
        """Settings that do nothing without their switch are refused, naming the switch."""
        owner = "MonitorConfig"
        check_int(owner, self, "capacity_bytes", 1 << 20, "pass a byte count of at least 2**20, or a size such as '80 GiB', "
                   "or None for the device's capacity.", none=True, written=written)
        if not self.preflight:
            if self.capacity_bytes is not None:
                raise invalid(owner, "capacity_bytes", written.get("capacity_bytes", self.capacity_bytes), "the pre-flight's "
                              "capacity does nothing without preflight=True; set preflight=True, or leave capacity_bytes at None.")
            if self.advanced.preflight_tolerance != AdvancedOptions.preflight_tolerance:
                raise invalid(owner, "advanced.preflight_tolerance", self.advanced.preflight_tolerance, "it does nothing "
                              "without preflight=True; set preflight=True, or leave preflight_tolerance at 0.25.")
        changed = _changed(self.snapshot)
        if changed and not self.auto_snapshot:
            raise ValueError(f"{owner}.snapshot=SnapshotOptions({', '.join(changed)}) is invalid: snapshot settings do nothing "
                             "without auto_snapshot=True; set auto_snapshot=True, or leave snapshot at its defaults.")
        if self.auto_snapshot and not self.write_files:
            raise invalid(owner, "auto_snapshot", True, "snapshots are files: keep write_files=True (and an output_dir), or set "
                          "auto_snapshot=False.")

    def to_dict(self) -> dict[str, Any]:
        """Every field, the groups as dicts of theirs (``report.json``'s ``config``)."""
        out = dataclasses.asdict(self)
        out["log_keys"] = self.log_keys if isinstance(self.log_keys, str) else list(self.log_keys)
        return out


def _changed(options: Any) -> list[str]:
    """``name=value`` of each field of ``options`` that is not at its default."""
    return [f"{f.name}={getattr(options, f.name)!r}" for f in dataclasses.fields(options) if getattr(options, f.name) != f.default]


class Settings:
    """The resolved configuration the runtime reads, flat and read-only: every top-level field of
    :class:`MonitorConfig` and every group's field by its flat name (:data:`FLAT_NAMES`: a group's
    fields keep theirs, ``snapshot.policy`` is ``snapshot_policy``), plus ``logged_keys``: the full
    keys handed to loggers (None: every key), and ``logged_keys_cpu``: those on CPU, where the default
    list has each phase's rise above the step's start in place of its peak. Made by :func:`settings_of`."""

    def __init__(self, config: MonitorConfig) -> None:
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in GROUPS}
        values.update({flat: getattr(getattr(config, group), name) for flat, (group, name) in FLAT_NAMES.items()})
        options = {"preflight": config.preflight, "auto_snapshot": config.auto_snapshot,
                   "gc_every_n_steps": config.leaks.gc_every_n_steps is not None}
        values["logged_keys"] = logged_keys(config.log_keys, config.advanced.prefix, options)
        values["logged_keys_cpu"] = logged_keys(config.log_keys, config.advanced.prefix, options, cpu=True)
        values["source"] = config
        self.__dict__.update(values)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Settings are read-only ({name}); build a new MonitorConfig instead.")

    def __repr__(self) -> str:
        return f"Settings({self.source!r})"

    def to_dict(self) -> dict[str, Any]:
        return self.source.to_dict()


def settings_of(config: MonitorConfig) -> Settings:
    """The flat settings the runtime reads, for ``config``."""
    return Settings(config)


# ---------------------------------------------------------------------- keywords and config=
def check_config_names(overrides: Mapping[str, Any], owner: str) -> None:
    """Raise a TypeError for every keyword that is not a MonitorConfig field, with the closest one."""
    refuse_unknown(overrides, owner, keyword_names(MonitorConfig))


def given_fields(values: Mapping[str, Any], keywords: frozenset[str]) -> dict[str, Any]:
    """The MonitorConfig fields among a monitor's arguments ``values`` (its ``locals()``) that the
    caller wrote (``keywords``, :class:`KeywordCheck`)."""
    return {name: values[name] for name in keywords & keyword_names(MonitorConfig)}


def resolve_config(config: MonitorConfig | Mapping[str, Any] | None, overrides: Mapping[str, Any], owner: str) -> MonitorConfig:
    """Merge ``config=`` and the keywords a caller wrote into one validated :class:`MonitorConfig`."""
    check_config_names(overrides, owner)
    if config is None:
        return MonitorConfig(**overrides)
    # every keyword written wins over config=, also one equal to its default. LightningCLI
    # (jsonargparse) writes every field, the ones not in its YAML at their defaults: only there
    # do keywords at their default leave config's values alone
    changed = dict(overrides)
    if set(overrides) == keyword_names(MonitorConfig):
        changed = {k: v for k, v in overrides.items() if not _same(v, _DEFAULTS[k])}
    if isinstance(config, Mapping):
        check_config_names(config, owner)
        return MonitorConfig(**{**config, **changed})
    if not isinstance(config, MonitorConfig):
        raise TypeError(f"{owner}(config={config!r}) must be a MonitorConfig, a dict of its fields, or None.")
    return dataclasses.replace(config, **changed) if changed else config


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MonitorConfig)}


def _same(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default
