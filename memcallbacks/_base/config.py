"""The monitor's configuration: ``MonitorConfig``, its option groups, and the flat settings the runtime reads.

A person sets the fourteen fields of :class:`MonitorConfig`; the thresholds of leak detection, the
snapshot triggers and the settings few runs change are grouped (:class:`LeakOptions`,
:class:`SnapshotOptions`, :class:`AdvancedOptions`). The runtime reads one flat :class:`Settings`
made from it (:func:`settings_of`), so a setting can move between groups without touching it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from memcallbacks._base.keys import check_log_keys, logged_keys
from memcallbacks._base.units import parse_size

__all__ = [
    "MonitorConfig", "LeakOptions", "SnapshotOptions", "AdvancedOptions", "Settings", "settings_of", "resolve_config",
    "check_config_names", "KeywordCheck", "given_fields", "FLAT_NAMES",
]


def _fail(owner: str, field: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"{owner}.{field}={value!r} is invalid: {fix}")


class KeywordCheck:
    """Base of the config classes and the monitors: an unknown keyword is refused naming the closest
    valid names (Python's own TypeError names none), and ``_keywords`` keeps the keywords a caller
    wrote, so that ``config=`` gives way to exactly those."""

    _keywords: frozenset[str] = frozenset()

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if not _parameters(cls).issuperset(kwargs):
            check_config_names(kwargs, cls.__name__, _parameters(cls))
        self = super().__new__(cls)
        object.__setattr__(self, "_keywords", frozenset(kwargs))
        return self


@functools.cache
def _parameters(cls: type) -> frozenset[str]:
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls) if f.init)
    params = inspect.signature(cls.__init__).parameters.values()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)) - {"self"}


def _normalise(owner: str, obj: Any) -> dict[str, Any]:
    """Whole numbers of any type (``np.int64(10)``, ``10.0``) as ints, sizes (``"80 GiB"``) as
    bytes in the fields that take bytes, real numbers as floats; a fraction is refused by name.
    Returns the sizes as written, for messages."""
    written = {}
    for f in dataclasses.fields(obj):
        value, kind = getattr(obj, f.name), str(f.type)  # annotations are strings here
        if value is None or isinstance(value, bool):
            continue
        if "int | str" in kind and isinstance(value, str):
            object.__setattr__(obj, f.name, parse_size(value, f"{owner}.{f.name}"))
            written[f.name] = value
        elif kind.startswith("int") and isinstance(value, numbers.Real) and not isinstance(value, int):
            number = float(value)
            if isinstance(value, numbers.Integral):
                object.__setattr__(obj, f.name, int(value))
            elif math.isfinite(number) and number.is_integer():
                object.__setattr__(obj, f.name, int(number))
            else:
                example = max(1, math.floor(number)) if math.isfinite(number) else 10
                raise _fail(owner, f.name, value, f"it must be a whole number; pass an integer such as {example}.")
        elif kind.startswith("float") and isinstance(value, numbers.Real) and not isinstance(value, (int, float)):
            object.__setattr__(obj, f.name, float(value))
    return written


def _check_bools(owner: str, obj: Any, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise _fail(owner, name, getattr(obj, name), "pass True or False.")


def _check_int(owner: str, obj: Any, name: str, least: int, fix: str = "", *, none: bool = False,
               written: dict[str, Any] | None = None) -> None:
    value = getattr(obj, name)
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise _fail(owner, name, (written or {}).get(name, value), fix or f"pass an integer of at least {least}" + (", or None." if none else "."))


def _is_fraction(value: Any, low: float, high: float, *, low_open: bool = True) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (low < value if low_open else low <= value) and value <= high


@dataclass(frozen=True, kw_only=True)
class LeakOptions(KeywordCheck):
    """Thresholds of leak detection (``detect_leaks``), periodic garbage collection and the theory check."""

    growth_warmup_steps: int = 4
    """Watched steps ignored by the growth test at the start (the first optimizer steps allocate
    optimizer state)."""

    growth_min_bytes_per_step: int | str = 64 << 10
    """Slowest growth reported, in bytes per optimizer step (a size such as ``"64 KiB"`` works)."""

    growth_min_total_bytes: int | str = 4 << 20
    """Least total growth reported, in bytes."""

    lingering_min_bytes: int | str = 1 << 20
    """Least bytes the previous step must still hold for a ``"lingering"`` finding."""

    census_time_budget_s: float = 2.0
    """Time budget of one census (the search for who holds what), taken only on a finding or on
    ``explain()``."""

    gc_every_n_steps: int | None = None
    """Run ``gc.collect()`` at the start of every N-th step, timed, with the objects collected and
    the device bytes freed logged; memory freed that way is a ``"cycle"`` finding naming the types
    in the cycle. ``None``: off (Python's own collector runs whenever it likes)."""

    gc_disable_automatic: bool = False
    """With ``gc_every_n_steps``: disable Python's automatic collection during training (as
    torchtitan does), so collections happen only at step boundaries; restored at the end."""

    estimate_model_states: bool = True
    """At the first step after the first optimizer step, compute what params, grads and optimizer
    state should take (``memcallbacks.estimate``) for the model, optimizer, precision and strategy in
    use, log ``expected`` and ``unexplained`` from then on, and raise an ``"unexplained"`` finding
    when the rest exceeds ``unexplained_margin_bytes``."""

    unexplained_margin_bytes: int | str = 256 << 20
    """Unexplained bytes (baseline minus expected model states minus the current batch) tolerated
    before an ``"unexplained"`` finding."""

    def __post_init__(self) -> None:
        owner = "LeakOptions"
        written = _normalise(owner, self)
        _check_bools(owner, self, "gc_disable_automatic", "estimate_model_states")
        for name, least in (("growth_warmup_steps", 0), ("growth_min_bytes_per_step", 1), ("growth_min_total_bytes", 1),
                            ("lingering_min_bytes", 0), ("unexplained_margin_bytes", 0)):
            _check_int(owner, self, name, least, written=written)
        if not _is_fraction(self.census_time_budget_s, 0, 600):
            raise _fail(owner, "census_time_budget_s", self.census_time_budget_s, "pass a number of seconds in (0, 600], e.g. 2.0.")
        _check_int(owner, self, "gc_every_n_steps", 1, "pass a positive integer (e.g. 100), or None to leave garbage "
                   "collection to Python.", none=True)
        if self.gc_disable_automatic and self.gc_every_n_steps is None:
            raise _fail(owner, "gc_disable_automatic", True, "it needs gc_every_n_steps set; otherwise nothing would ever collect cycles.")


@dataclass(frozen=True, kw_only=True)
class SnapshotOptions(KeywordCheck):
    """When and how much ``auto_snapshot=True`` captures (docs/snapshots.md); refused without it."""

    policy: str = "armed"
    """CUDA allocator history: ``"always"`` records from the start (costs a little on every
    allocation), ``"armed"`` starts recording when a step's peak passes 80% of the threshold or a
    trigger fires, ``"off"`` never records (an OOM still dumps the allocator's segments)."""

    capacity_fraction: float | None = 0.9
    """Trigger when a step's peak passes this fraction of device capacity (``None``: off)."""

    peak_bytes: int | str | None = None
    """Trigger when a step's peak passes this many bytes (``None``: off)."""

    on_alloc_retries: bool = True
    """Trigger when the CUDA allocator had to flush its cache and retry (fragmentation)."""

    on_findings: bool = True
    """Trigger on each new finding of leak detection."""

    every_n_steps: int | None = None
    """Also trigger every N steps (``None``: off)."""

    steps: int = 3
    """Steps captured after a trigger when no history was recording (CUDA ``"armed"``, and CPU)."""

    max_snapshots: int = 5
    """At most this many snapshots per run (per rank)."""

    max_bytes: int | str = 2 << 30
    """At most this many bytes of snapshot files per run (per rank)."""

    max_entries: int = 100_000
    """Trace entries kept (CUDA ring buffer, CPU capture)."""

    def __post_init__(self) -> None:
        owner = "SnapshotOptions"
        written = _normalise(owner, self)
        _check_bools(owner, self, "on_alloc_retries", "on_findings")
        if self.policy not in ("always", "armed", "off"):
            raise _fail(owner, "policy", self.policy, "pass 'always', 'armed' or 'off'.")
        frac = self.capacity_fraction
        if frac is not None and not _is_fraction(frac, 0, 1):
            raise _fail(owner, "capacity_fraction", frac, "pass a fraction in (0, 1], e.g. 0.9, or None to turn the capacity trigger off.")
        for name, least, none in (("peak_bytes", 1, True), ("every_n_steps", 1, True), ("steps", 1, False),
                                  ("max_snapshots", 1, False), ("max_bytes", 1 << 20, False), ("max_entries", 1000, False)):
            _check_int(owner, self, name, least, none=none, written=written)


@dataclass(frozen=True, kw_only=True)
class AdvancedOptions(KeywordCheck):
    """Settings few runs change: the overhead budget, malloc on CPU, the pre-flight's tolerance,
    the key prefix, what is logged where, the history's bound, and ``strict``."""

    overhead_budget: float = 0.01
    """The monitor's own time allowed, as a fraction of step time, when it chooses the sampling
    interval (``sample_every_n_steps=None``). Watching (growth and lingering detection) runs every
    step unless its cost alone exceeds the budget. The chosen intervals and the achieved
    overhead are in ``report.json`` (``summary.cadence``) and the text report."""

    cpu_mmap_threshold: int | str | None = None
    """CPU on glibc only: fix malloc's mmap threshold (``mallopt(M_MMAP_THRESHOLD)``) to this many
    bytes (or a size such as ``"256 KiB"``) when the monitor starts. glibc keeps freed blocks below
    its (adaptive, up to 32 MiB) threshold in the heap, so the resident set - and hence CPU peaks -
    stop moving once the heap has grown; with e.g. ``1 << 20`` every tensor of 1 MiB or more goes
    back to the OS when freed and per-phase RSS peaks follow tensor lifetimes. Free heap chunks
    left from before are given back (``malloc_trim``) at every phase boundary of sampled steps.
    Costs page faults on every large allocation and cannot be undone within the process. ``None``
    leaves malloc alone."""

    preflight_tolerance: float = 0.25
    """With ``preflight=True``: a sampled step's measured phase peak more than this fraction (plus
    8 MiB) above the pre-flight's prediction is a ``"preflight"`` finding, with the gap in bytes."""

    prefix: str = "memory"
    """First component of every logged key (``memory/allocated_GiB``)."""

    log_validation: bool = True
    """Record (and log) memory during validation, test and predict loops, separately from training rows."""

    log_to_trackers: bool = True
    """Give the experiment trackers the run already has (TensorBoard, W&B, MLflow, found among the
    framework's loggers) a memory dashboard, the findings, and at the end the report, history, plot
    and snapshots (docs/metrics.md, "Where it appears"). Never creates a tracker or logs in.
    ``False``: metrics only, through the framework's logging."""

    reduce_across_ranks: bool = True
    """Under torch.distributed, log the max over ranks (and the rank that holds it), in one collective
    per logged step. ``False`` logs each rank's own numbers from rank zero only."""

    max_history_rows: int = 200_000
    """Upper bound on rows kept in ``history`` (and written to disk). Past it, older rows are
    thinned to every other row, so memory and disk stay bounded on very long runs."""

    strict: bool = False
    """Re-raise exceptions raised inside the monitor instead of logging them and disabling the
    monitor. For tests; a production run should never die because of its monitor."""

    def __post_init__(self) -> None:
        owner = "AdvancedOptions"
        written = _normalise(owner, self)
        _check_bools(owner, self, "log_validation", "log_to_trackers", "reduce_across_ranks", "strict")
        if not _is_fraction(self.overhead_budget, 0, 1):
            raise _fail(owner, "overhead_budget", self.overhead_budget, "pass a fraction of step time in (0, 1], e.g. 0.01 for 1%.")
        _check_int(owner, self, "cpu_mmap_threshold", 4096, "pass a byte count between 4096 and 2**30 (e.g. '1 MiB'), or None "
                   "to leave malloc alone.", none=True, written=written)
        if self.cpu_mmap_threshold is not None and self.cpu_mmap_threshold > 1 << 30:
            raise _fail(owner, "cpu_mmap_threshold", written.get("cpu_mmap_threshold", self.cpu_mmap_threshold), "pass a byte count between 4096 and 2**30 (e.g. '1 MiB').")
        if not _is_fraction(self.preflight_tolerance, 0, 10, low_open=False):
            raise _fail(owner, "preflight_tolerance", self.preflight_tolerance, "pass a fraction in [0, 10], e.g. 0.25 for 25% above the prediction.")
        if not isinstance(self.prefix, str) or not self.prefix.strip("/") or self.prefix != self.prefix.strip("/ "):
            raise _fail(owner, "prefix", self.prefix, "pass a non-empty name without leading/trailing '/' or spaces, e.g. 'memory'.")
        _check_int(owner, self, "max_history_rows", 100)


_GROUPS = {"leaks": LeakOptions, "snapshot": SnapshotOptions, "advanced": AdvancedOptions}


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
    """Write ``memory.png`` (needs matplotlib)."""

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
        for name, cls in _GROUPS.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):  # a dict of the group's fields (a YAML mapping, a pytest marker)
                object.__setattr__(self, name, cls(**value))
            elif not isinstance(value, cls):
                raise _fail(owner, name, value, f"pass {cls.__name__}(...) or a dict of its fields.")
        written = _normalise(owner, self)
        object.__setattr__(self, "log_keys", check_log_keys(self.log_keys, owner))
        self._check_cadence_and_files()
        self._check_switches(written)

    def _check_cadence_and_files(self) -> None:
        owner = "MonitorConfig"
        _check_int(owner, self, "log_every_n_steps", 1, "pass a positive integer, or None to follow the framework's setting.", none=True)
        _check_int(owner, self, "sample_every_n_steps", 1, "pass a positive integer (1 = every step), or None to choose per device.", none=True)
        if self.output_dir is not None and not isinstance(self.output_dir, (str, os.PathLike)):
            raise _fail(owner, "output_dir", self.output_dir, "pass a folder path (str or os.PathLike) or None.")
        if self.output_dir is not None:
            object.__setattr__(self, "output_dir", os.fspath(self.output_dir))
            if not str(self.output_dir).strip():
                raise _fail(owner, "output_dir", self.output_dir, "pass a folder path, or None for the default folder.")
        _check_bools(owner, self, "write_files", "plot", "detect_leaks", "watch_host", "preflight", "auto_snapshot")

    def _check_switches(self, written: dict[str, Any]) -> None:
        """Settings that do nothing without their switch are refused, naming the switch."""
        owner = "MonitorConfig"
        _check_int(owner, self, "capacity_bytes", 1 << 20, "pass a byte count of at least 2**20, or a size such as '80 GiB', "
                   "or None for the device's capacity.", none=True, written=written)
        if not self.preflight:
            if self.capacity_bytes is not None:
                raise _fail(owner, "capacity_bytes", written.get("capacity_bytes", self.capacity_bytes), "the pre-flight's capacity does nothing without "
                            "preflight=True; set preflight=True, or leave capacity_bytes at None.")
            if self.advanced.preflight_tolerance != AdvancedOptions.preflight_tolerance:
                raise _fail(owner, "advanced.preflight_tolerance", self.advanced.preflight_tolerance, "it does nothing "
                            "without preflight=True; set preflight=True, or leave preflight_tolerance at 0.25.")
        changed = _changed(self.snapshot)
        if changed and not self.auto_snapshot:
            raise ValueError(f"{owner}.snapshot=SnapshotOptions({', '.join(changed)}) is invalid: snapshot settings do nothing "
                             "without auto_snapshot=True; set auto_snapshot=True, or leave snapshot at its defaults.")
        if self.auto_snapshot and not self.write_files:
            raise _fail(owner, "auto_snapshot", True, "snapshots are files: keep write_files=True (and an output_dir), or set auto_snapshot=False.")

    def to_dict(self) -> dict[str, Any]:
        """Every field, the groups as dicts of theirs (``report.json``'s ``config``)."""
        out = dataclasses.asdict(self)
        out["log_keys"] = self.log_keys if isinstance(self.log_keys, str) else list(self.log_keys)
        return out


def _changed(options: Any) -> list[str]:
    """``name=value`` of each field of ``options`` that is not at its default."""
    return [f"{f.name}={getattr(options, f.name)!r}" for f in dataclasses.fields(options) if getattr(options, f.name) != f.default]


# ---------------------------------------------------------------------- the flat settings
_SNAPSHOT_NAMES = {
    "policy": "snapshot_policy", "capacity_fraction": "snapshot_capacity_fraction", "peak_bytes": "snapshot_peak_bytes",
    "on_alloc_retries": "snapshot_on_alloc_retries", "on_findings": "snapshot_on_findings",
    "every_n_steps": "snapshot_every_n_steps", "steps": "snapshot_steps", "max_snapshots": "max_snapshots",
    "max_bytes": "max_snapshot_bytes", "max_entries": "snapshot_max_entries",
}

FLAT_NAMES: dict[str, tuple[str, str]] = {
    _SNAPSHOT_NAMES.get(f.name, f.name) if group == "snapshot" else f.name: (group, f.name)
    for group, cls in _GROUPS.items() for f in dataclasses.fields(cls)
}
"""The flat name of each group's field (the runtime's, and the names before grouping) -> ``(group, field)``."""


class Settings:
    """The resolved configuration the runtime reads, flat and read-only: every top-level field of
    :class:`MonitorConfig` and every group's field by its flat name (:data:`FLAT_NAMES`: a group's
    fields keep theirs, ``snapshot.policy`` is ``snapshot_policy``), plus ``logged_keys``: the full
    keys handed to loggers (None: every key). Made by :func:`settings_of`."""

    def __init__(self, config: MonitorConfig) -> None:
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in _GROUPS}
        values.update({flat: getattr(getattr(config, group), name) for flat, (group, name) in FLAT_NAMES.items()})
        options = {"preflight": config.preflight, "auto_snapshot": config.auto_snapshot,
                   "gc_every_n_steps": config.leaks.gc_every_n_steps is not None}
        values["logged_keys"] = logged_keys(config.log_keys, config.advanced.prefix, options)
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
def check_config_names(overrides: Mapping[str, Any], owner: str, valid: frozenset[str] | None = None) -> None:
    """Raise a TypeError for every keyword that is not in ``valid`` (default: MonitorConfig's
    fields), with the closest valid name, or where a name moved into a group, the group."""
    valid = _parameters(MonitorConfig) if valid is None else valid
    unknown = sorted(set(overrides) - valid)
    if not unknown:
        return
    hints = [_hint(name, valid, top=bool(valid & set(_GROUPS))) for name in unknown]
    raise TypeError(f"{owner}() got unexpected keyword argument(s): {'; '.join(hints)}. Every setting is in docs/configuration.md.")


def _hint(name: str, valid: frozenset[str], *, top: bool) -> str:
    """``'log_evry_n_steps'`` -> ``'log_evry_n_steps' (did you mean 'log_every_n_steps'?)``; at the top
    level a group's field is named with its group (``leaks=LeakOptions(growth_warmup_steps=...)``)."""
    grouped = {}
    if top:
        grouped = {field: f"{group}={_GROUPS[group].__name__}({field}=...)" for group, field in FLAT_NAMES.values()}
        grouped.update({flat: f"{group}={_GROUPS[group].__name__}({field}=...)" for flat, (group, field) in FLAT_NAMES.items()})
        if name in grouped:
            return f"{name!r} (it belongs to a group: pass {grouped[name]})"
    close = difflib.get_close_matches(name, sorted(valid | set(grouped)), n=1)
    if close:
        return f"{name!r} (did you mean {' or '.join(grouped.get(c, repr(c)) for c in close)}?)"
    return f"{name!r} (valid names: {', '.join(sorted(valid))})"


def given_fields(values: Mapping[str, Any], keywords: frozenset[str]) -> dict[str, Any]:
    """The MonitorConfig fields among a monitor's arguments ``values`` (its ``locals()``) that the
    caller wrote (``keywords``, :class:`KeywordCheck`)."""
    return {name: values[name] for name in keywords & _parameters(MonitorConfig)}


def resolve_config(config: MonitorConfig | Mapping[str, Any] | None, overrides: Mapping[str, Any], owner: str) -> MonitorConfig:
    """Merge ``config=`` and the keywords a caller wrote into one validated :class:`MonitorConfig`."""
    check_config_names(overrides, owner)
    if config is None:
        return MonitorConfig(**overrides)
    # every keyword written wins over config=, also one equal to its default. LightningCLI
    # (jsonargparse) writes every field, the ones not in its YAML at their defaults: only there
    # do keywords at their default leave config's values alone
    changed = dict(overrides)
    if set(overrides) == _parameters(MonitorConfig):
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
