"""``MonitorConfig``'s option groups (leaks, snapshots, advanced settings) and their checks.

Every config class and every monitor derives from :class:`KeywordCheck`, which refuses an unknown
keyword with the closest valid name; each group checks its own fields when it is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from memcallbacks._base.units import parse_size

__all__ = [
    "LeakOptions", "SnapshotOptions", "AdvancedOptions", "GROUPS", "FLAT_NAMES", "KeywordCheck", "refuse_unknown", "keyword_names",
    "normalise", "check_bools", "check_int", "invalid",
]


def invalid(owner: str, field: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"{owner}.{field}={value!r} is invalid: {fix}")


class KeywordCheck:
    """Base of the config classes and the monitors: an unknown keyword is refused naming the closest
    valid names (Python's own TypeError names none), and ``_keywords`` keeps the keywords a caller
    wrote, so that ``config=`` gives way to exactly those."""

    _keywords: frozenset[str] = frozenset()

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if not keyword_names(cls).issuperset(kwargs):
            refuse_unknown(kwargs, cls.__name__, keyword_names(cls))
        self = super().__new__(cls)
        object.__setattr__(self, "_keywords", frozenset(kwargs))
        return self


@functools.cache
def keyword_names(cls: type) -> frozenset[str]:
    """The keywords ``cls(...)`` takes: a dataclass's fields, else the first ``__init__`` in the MRO
    that names its keywords (a subclass's ``__init__(*args, **kwargs)`` passes them on)."""
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls) if f.init)
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            params = inspect.signature(vars(klass)["__init__"]).parameters.values()
            if all(p.kind is not p.VAR_KEYWORD for p in params):
                return frozenset(p.name for p in params if p.kind is not p.VAR_POSITIONAL) - {"self"}
    return frozenset()


def normalise(owner: str, obj: Any) -> dict[str, Any]:
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
                raise invalid(owner, f.name, value, f"it must be a whole number; pass an integer such as {example}.")
        elif kind.startswith("float") and isinstance(value, numbers.Real) and not isinstance(value, (int, float)):
            object.__setattr__(obj, f.name, float(value))
    return written


def check_bools(owner: str, obj: Any, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise invalid(owner, name, getattr(obj, name), "pass True or False.")


def check_int(owner: str, obj: Any, name: str, least: int, fix: str = "", *, none: bool = False,
               written: dict[str, Any] | None = None) -> None:
    value = getattr(obj, name)
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise invalid(owner, name, (written or {}).get(name, value), fix or f"pass an integer of at least {least}" + (", or None." if none else "."))


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
        written = normalise(owner, self)
        check_bools(owner, self, "gc_disable_automatic", "estimate_model_states")
        for name, least in (("growth_warmup_steps", 0), ("growth_min_bytes_per_step", 1), ("growth_min_total_bytes", 1),
                            ("lingering_min_bytes", 0), ("unexplained_margin_bytes", 0)):
            check_int(owner, self, name, least, written=written)
        if not _is_fraction(self.census_time_budget_s, 0, 600):
            raise invalid(owner, "census_time_budget_s", self.census_time_budget_s, "pass a number of seconds in (0, 600], e.g. 2.0.")
        check_int(owner, self, "gc_every_n_steps", 1, "pass a positive integer (e.g. 100), or None to leave garbage "
                   "collection to Python.", none=True)
        if self.gc_disable_automatic and self.gc_every_n_steps is None:
            raise invalid(owner, "gc_disable_automatic", True, "it needs gc_every_n_steps set; otherwise nothing would ever collect cycles.")


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
        written = normalise(owner, self)
        check_bools(owner, self, "on_alloc_retries", "on_findings")
        if self.policy not in ("always", "armed", "off"):
            raise invalid(owner, "policy", self.policy, "pass 'always', 'armed' or 'off'.")
        frac = self.capacity_fraction
        if frac is not None and not _is_fraction(frac, 0, 1):
            raise invalid(owner, "capacity_fraction", frac, "pass a fraction in (0, 1], e.g. 0.9, or None to turn the capacity trigger off.")
        for name, least, none in (("peak_bytes", 1, True), ("every_n_steps", 1, True), ("steps", 1, False),
                                  ("max_snapshots", 1, False), ("max_bytes", 1 << 20, False), ("max_entries", 1000, False)):
            check_int(owner, self, name, least, none=none, written=written)


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
    left from before are given back (``malloc_trim``) once, at the first sampled step.
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
        written = normalise(owner, self)
        check_bools(owner, self, "log_validation", "log_to_trackers", "reduce_across_ranks", "strict")
        if not _is_fraction(self.overhead_budget, 0, 1):
            raise invalid(owner, "overhead_budget", self.overhead_budget, "pass a fraction of step time in (0, 1], e.g. 0.01 for 1%.")
        check_int(owner, self, "cpu_mmap_threshold", 4096, "pass a byte count between 4096 and 2**30 (e.g. '1 MiB'), or None "
                   "to leave malloc alone.", none=True, written=written)
        if self.cpu_mmap_threshold is not None and self.cpu_mmap_threshold > 1 << 30:
            raise invalid(owner, "cpu_mmap_threshold", written.get("cpu_mmap_threshold", self.cpu_mmap_threshold), "pass a byte count between 4096 and 2**30 (e.g. '1 MiB').")
        if not _is_fraction(self.preflight_tolerance, 0, 10, low_open=False):
            raise invalid(owner, "preflight_tolerance", self.preflight_tolerance, "pass a fraction in [0, 10], e.g. 0.25 for 25% above the prediction.")
        if not isinstance(self.prefix, str) or not self.prefix.strip("/") or self.prefix != self.prefix.strip("/ "):
            raise invalid(owner, "prefix", self.prefix, "pass a non-empty name without leading/trailing '/' or spaces, e.g. 'memory'.")
        check_int(owner, self, "max_history_rows", 100)


GROUPS = {"leaks": LeakOptions, "snapshot": SnapshotOptions, "advanced": AdvancedOptions}


_SNAPSHOT_NAMES = {
    "policy": "snapshot_policy", "capacity_fraction": "snapshot_capacity_fraction", "peak_bytes": "snapshot_peak_bytes",
    "on_alloc_retries": "snapshot_on_alloc_retries", "on_findings": "snapshot_on_findings",
    "every_n_steps": "snapshot_every_n_steps", "steps": "snapshot_steps", "max_snapshots": "max_snapshots",
    "max_bytes": "max_snapshot_bytes", "max_entries": "snapshot_max_entries",
}

FLAT_NAMES: dict[str, tuple[str, str]] = {
    _SNAPSHOT_NAMES.get(f.name, f.name) if group == "snapshot" else f.name: (group, f.name)
    for group, cls in GROUPS.items() for f in dataclasses.fields(cls)
}
"""The flat name of each group's field (the runtime's, and the names before grouping) -> ``(group, field)``."""



def refuse_unknown(overrides: Mapping[str, Any], owner: str, valid: frozenset[str]) -> None:
    """Raise a TypeError for every keyword that is not in ``valid``, with the closest valid name,
    or for a group's field given at the top level, the group."""
    unknown = sorted(set(overrides) - valid)
    if not unknown:
        return
    hints = [_hint(name, valid, top=bool(valid & set(GROUPS))) for name in unknown]
    raise TypeError(f"{owner}() got unexpected keyword argument(s): {'; '.join(hints)}. Every setting is in docs/configuration.md.")


def _hint(name: str, valid: frozenset[str], *, top: bool) -> str:
    """``'log_evry_n_steps'`` -> ``'log_evry_n_steps' (did you mean 'log_every_n_steps'?)``; at the top
    level a group's field is named with its group (``leaks=LeakOptions(growth_warmup_steps=...)``)."""
    grouped = {}
    if top:
        grouped = {field: f"{group}={GROUPS[group].__name__}({field}=...)" for group, field in FLAT_NAMES.values()}
        grouped.update({flat: f"{group}={GROUPS[group].__name__}({field}=...)" for flat, (group, field) in FLAT_NAMES.items()})
        if name in grouped:
            return f"{name!r} (it belongs to a group: pass {grouped[name]})"
    names = sorted(valid | set(grouped))
    # a name cut short ('log_every') is completed first; difflib weighs the missing end as errors
    close = [min((n for n in names if n.startswith(name)), key=len)] if any(n.startswith(name) for n in names) else \
        difflib.get_close_matches(name, names, n=1)
    if close:
        return f"{name!r} (did you mean {' or '.join(grouped.get(c, repr(c)) for c in close)}?)"
    return f"{name!r} (valid names: {', '.join(sorted(valid))})"
