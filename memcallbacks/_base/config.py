"""The monitor's configuration: one frozen, keyword-only dataclass shared by every adapter."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["MonitorConfig", "resolve_config", "check_config_names"]


def _fail(field: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"MonitorConfig.{field}={value!r} is invalid: {fix}")


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """Everything the memory monitor can be told. Every adapter accepts these names as keyword arguments."""

    log_every_n_steps: int | None = None
    """Log ``memory/...`` metrics every N optimizer steps. ``None`` follows the framework
    (Lightning's ``Trainer(log_every_n_steps=...)``; 50 elsewhere). ``history`` keeps a row for
    every sampled step (see ``sample_every_n_steps``), logged or not."""

    sample_every_n_steps: int | None = None
    """Measure per-phase peaks on every N-th optimizer step (and always on logged steps); other
    steps are only watched (one cheap memory read for leak detection) and leave no row. ``None``:
    the monitor measures its own cost and the step time and picks the interval that keeps it
    within ``overhead_budget`` (every step on a GPU with steps of a few ms; every few dozen steps
    for a tiny model on CPU, where each peak read is a system call)."""

    overhead_budget: float = 0.01
    """The monitor's own time allowed, as a fraction of step time, when it chooses the sampling
    interval (``sample_every_n_steps=None``), and the intervals of its memory reads for growth
    detection (every step for the first 48 steps, then as the budget allows) and of its lingering
    checks (docs/findings.md, "Which steps do what"). The chosen intervals and the achieved
    overhead are in ``report.json`` (``summary.cadence``), the text report and the logged
    ``memory/overhead`` key."""

    cpu_mmap_threshold: int | None = None
    """CPU on glibc only: fix malloc's mmap threshold (``mallopt(M_MMAP_THRESHOLD)``) to this many
    bytes when the monitor starts. glibc keeps freed blocks below its (adaptive, up to 32 MiB)
    threshold in the heap, so the resident set - and hence CPU peaks - stop moving once the heap
    has grown; with e.g. ``1 << 20`` every tensor of 1 MiB or more goes back to the OS when freed
    and per-phase RSS peaks follow tensor lifetimes. Free heap chunks left from before are given
    back (``malloc_trim``) at every phase boundary of sampled steps, so tensors placed in them show
    too (a few µs per boundary when nothing is free). Costs page faults on every large allocation
    and cannot be undone within the process. ``None`` leaves malloc alone."""

    output_dir: str | None = None
    """Folder for ``history.csv``, ``report.json`` and ``memory.png``. ``None``: a ``memcallbacks``
    folder inside the trainer's log dir (Lightning), the Trainer's ``output_dir`` (Transformers) or
    the accelerator's ``project_dir`` (Accelerate), else ``./memcallbacks_output`` (plain loops)."""

    write_files: bool = True
    """Write the output files at the end of fit (and on an OOM). ``False`` keeps everything in memory."""

    plot: bool = True
    """Write ``memory.png`` (needs matplotlib; skipped with one warning when it is missing)."""

    console_summary: bool = True
    """At the end of a run, rank zero shows the verdict (no problem found, or one line per problem)
    and the files' folder on the console: through ``rank_zero_info`` under Lightning, ``print``
    elsewhere. ``False``: nothing is printed."""

    log_to_trackers: bool = True
    """Give the experiment trackers the run already has (TensorBoard, W&B, MLflow, found among the
    framework's loggers) a memory dashboard, the findings, and at the end the report, history, plot
    and snapshots (docs/metrics.md, "Where it appears"). Never creates a tracker or logs in.
    ``False``: metrics only, through the framework's logging, as before."""

    log_validation: bool = True
    """Record (and log) memory during validation, test and predict loops, separately from training rows."""

    reduce_across_ranks: bool = True
    """Under torch.distributed, log the max over ranks (and the rank that holds it), in one collective
    per logged step. ``False`` logs each rank's own numbers from rank zero only."""

    max_history_rows: int = 200_000
    """Upper bound on rows kept in ``history`` (and written to disk). Past it, older rows are
    thinned to every other row, so memory and disk stay bounded on very long runs."""

    detect_leaks: bool = True
    """Look for leaks: ``"lingering"`` (the previous step's batch or loss graph still alive when
    the next step starts; checked after each of the first 20 steps, then after every 4th sampled
    step) and ``"growth"`` (the step-start baseline rising step over step; read every step for the
    first 48 steps, then at the budget's interval). Findings name their holders."""

    watch_host: bool = True
    """Watch the host beside the device (docs/host.md): at the steps that read memory, Python-object
    memory, the process's private resident memory and the DataLoader workers' private memory, with
    their own growth test (``"host_growth"``, ``"worker_growth"``), a host census naming the type and
    holder after suspicion, the ``memory/host_*`` keys and the per-rank comparison's host figures.
    ``False`` turns the whole host channel off (to measure its cost; ``report.json`` ``host`` is
    ``null``)."""

    growth_warmup_steps: int = 4
    """Watched steps ignored by the growth test at the start (the first optimizer steps allocate
    optimizer state)."""

    growth_min_bytes_per_step: int = 64 << 10
    """Slowest growth reported, in bytes per optimizer step."""

    growth_min_total_bytes: int = 4 << 20
    """Least total growth reported, in bytes."""

    lingering_min_bytes: int = 1 << 20
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

    unexplained_margin_bytes: int = 256 << 20
    """Unexplained bytes (baseline minus expected model states minus the current batch) tolerated
    before an ``"unexplained"`` finding."""

    preflight: bool = False
    """Before the first step runs, predict its memory per phase on fake tensors
    (:func:`memcallbacks.preflight.predict` with the run's model, optimizer, precision and first
    batch), log the predicted peaks, warn when they exceed ``capacity_bytes`` (naming the phase,
    the biggest holders and the largest batch size that fits), and compare every sampled
    steady-state step's measured peaks with the prediction (a ``"preflight"`` finding past
    ``preflight_tolerance``). A step that cannot run on fake tensors is one warning; training goes
    on. See docs/preflight.md, "In the monitor"."""

    capacity_bytes: int | None = None
    """Bytes the pre-flight's predicted peak is checked against. ``None``: the device's capacity
    (CUDA: total memory; CPU: host RAM)."""

    preflight_tolerance: float = 0.25
    """A sampled step's measured phase peak more than this fraction (plus 8 MiB) above the
    pre-flight's prediction is a ``"preflight"`` finding, with the gap in bytes."""

    auto_snapshot: bool = False
    """Capture memory snapshots automatically when something goes wrong: a step's peak above
    ``snapshot_capacity_fraction`` of the device (or ``snapshot_peak_bytes``), new allocator
    retries, a new finding, an out-of-memory error, or every ``snapshot_every_n_steps``. CUDA
    dumps allocator history (memory_viz ``.pickle``); CPU profiles the next ``snapshot_steps``
    steps into the same format. Files go to ``<output_dir>/snapshots`` with an offline HTML/PNG
    summary. See docs/snapshots.md."""

    snapshot_policy: str = "armed"
    """CUDA allocator history: ``"always"`` records from the start (costs a little on every
    allocation), ``"armed"`` starts recording when a step's peak passes 80% of the threshold or a
    trigger fires, ``"off"`` never records (an OOM still dumps the allocator's segments)."""

    snapshot_capacity_fraction: float | None = 0.9
    """Trigger when a step's peak passes this fraction of device capacity (``None``: off)."""

    snapshot_peak_bytes: int | None = None
    """Trigger when a step's peak passes this many bytes (``None``: off). Needs ``auto_snapshot=True``."""

    snapshot_on_alloc_retries: bool = True
    """Trigger when the CUDA allocator had to flush its cache and retry (fragmentation)."""

    snapshot_on_findings: bool = True
    """Trigger on each new finding of leak detection."""

    snapshot_every_n_steps: int | None = None
    """Also trigger every N steps (``None``: off). Needs ``auto_snapshot=True``."""

    snapshot_steps: int = 3
    """Steps captured after a trigger when no history was recording (CUDA ``"armed"``, and CPU)."""

    max_snapshots: int = 5
    """At most this many snapshots per run (per rank)."""

    max_snapshot_bytes: int = 2 << 30
    """At most this many bytes of snapshot files per run (per rank)."""

    snapshot_max_entries: int = 100_000
    """Trace entries kept (CUDA ring buffer, CPU capture)."""

    prefix: str = "memory"
    """First component of every logged key (``memory/allocated_GiB``)."""

    strict: bool = False
    """Re-raise exceptions raised inside the monitor instead of logging them and disabling the
    monitor. For tests; a production run should never die because of its monitor."""

    def __post_init__(self) -> None:
        # one ValueError naming the field, the value and the fix, before any training starts
        self._normalise_numbers()
        self._check_cadence_and_files()
        self._check_leak_detection()
        self._check_snapshots()
        self._check_preflight_and_prefix()

    def _normalise_numbers(self) -> None:
        """Integer fields take any whole number (``np.int64(10)``, ``10.0``) as a Python int; a
        fraction is refused here, with its own message. Float fields take any real number."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None or isinstance(value, (bool, int)) or isinstance(value, (str, bytes)):
                continue  # None, plain ints and the types the checks below refuse by name
            if isinstance(value, numbers.Integral):
                object.__setattr__(self, name, int(value))
            elif isinstance(value, numbers.Real):
                number = float(value)
                if not (math.isfinite(number) and number.is_integer()):
                    raise _fail(name, value, f"it must be a whole number; pass an integer such as {max(1, math.floor(number)) if math.isfinite(number) else 10}.")
                object.__setattr__(self, name, int(number))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
                object.__setattr__(self, name, float(value))

    def _check_cadence_and_files(self) -> None:
        n = self.log_every_n_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise _fail("log_every_n_steps", n, "pass a positive integer, or None to follow the framework's setting.")
        n = self.sample_every_n_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise _fail("sample_every_n_steps", n, "pass a positive integer (1 = every step), or None to choose per device.")
        b = self.overhead_budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b <= 1:
            raise _fail("overhead_budget", b, "pass a fraction of step time in (0, 1], e.g. 0.01 for 1%.")
        t = self.cpu_mmap_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 4096 <= t <= 1 << 30):
            raise _fail("cpu_mmap_threshold", t, "pass a byte count between 4096 and 2**30 (e.g. 1 << 20), or None to leave malloc alone.")
        if self.output_dir is not None and not isinstance(self.output_dir, (str, os.PathLike)):
            raise _fail("output_dir", self.output_dir, "pass a folder path (str or os.PathLike) or None.")
        if self.output_dir is not None:
            object.__setattr__(self, "output_dir", os.fspath(self.output_dir))
            if not str(self.output_dir).strip():
                raise _fail("output_dir", self.output_dir, "pass a folder path, or None for the default folder.")
        for name in ("write_files", "plot", "console_summary", "log_to_trackers", "log_validation", "reduce_across_ranks", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "pass True or False.")

    def _check_leak_detection(self) -> None:
        rows = self.max_history_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 100:
            raise _fail("max_history_rows", rows, "pass an integer of at least 100.")
        for name in ("detect_leaks", "watch_host", "gc_disable_automatic", "estimate_model_states"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "pass True or False.")
        for name, least in (
            ("growth_warmup_steps", 0),
            ("growth_min_bytes_per_step", 1),
            ("growth_min_total_bytes", 1),
            ("lingering_min_bytes", 0),
            ("unexplained_margin_bytes", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise _fail(name, value, f"pass an integer of at least {least}.")
        budget = self.census_time_budget_s
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 600:
            raise _fail("census_time_budget_s", budget, "pass a number of seconds in (0, 600], e.g. 2.0.")
        g = self.gc_every_n_steps
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise _fail("gc_every_n_steps", g, "pass a positive integer (e.g. 100), or None to leave garbage collection to Python.")
        if self.gc_disable_automatic and g is None:
            raise _fail("gc_disable_automatic", True, "it needs gc_every_n_steps set; otherwise nothing would ever collect cycles.")

    def _check_snapshots(self) -> None:
        for name in ("auto_snapshot", "snapshot_on_alloc_retries", "snapshot_on_findings"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "pass True or False.")
        if self.snapshot_policy not in ("always", "armed", "off"):
            raise _fail("snapshot_policy", self.snapshot_policy, "pass 'always', 'armed' or 'off'.")
        frac = self.snapshot_capacity_fraction
        if frac is not None and (isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1):
            raise _fail("snapshot_capacity_fraction", frac, "pass a fraction in (0, 1], e.g. 0.9, or None to turn the capacity trigger off.")
        for name, least, allow_none in (
            ("snapshot_peak_bytes", 1, True),
            ("snapshot_every_n_steps", 1, True),
            ("snapshot_steps", 1, False),
            ("max_snapshots", 1, False),
            ("max_snapshot_bytes", 1 << 20, False),
            ("snapshot_max_entries", 1000, False),
        ):
            value = getattr(self, name)
            if value is None and allow_none:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise _fail(name, value, f"pass an integer of at least {least}" + (", or None." if allow_none else "."))
        for name in ("snapshot_every_n_steps", "snapshot_peak_bytes"):
            if getattr(self, name) is not None and not self.auto_snapshot:
                raise _fail(name, getattr(self, name), "it is a snapshot trigger and does nothing without auto_snapshot=True; "
                            f"set auto_snapshot=True, or leave {name} at None.")

    def _check_preflight_and_prefix(self) -> None:
        if not isinstance(self.preflight, bool):
            raise _fail("preflight", self.preflight, "pass True or False.")
        cap = self.capacity_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1 << 20):
            raise _fail("capacity_bytes", cap, "pass a byte count of at least 2**20 (e.g. 80 * 2**30), or None for the device's capacity.")
        tol = self.preflight_tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol <= 10:
            raise _fail("preflight_tolerance", tol, "pass a fraction in [0, 10], e.g. 0.25 for 25% above the prediction.")
        if self.auto_snapshot and not self.write_files:
            raise _fail("auto_snapshot", True, "snapshots are files: keep write_files=True (and an output_dir), or set auto_snapshot=False.")
        if not isinstance(self.prefix, str) or not self.prefix.strip("/") or self.prefix != self.prefix.strip("/ "):
            raise _fail("prefix", self.prefix, "pass a non-empty name without leading/trailing '/' or spaces, e.g. 'memory'.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = frozenset(f.name for f in dataclasses.fields(MonitorConfig))
# annotations are strings here (from __future__ import annotations)
_INT_FIELDS = tuple(f.name for f in dataclasses.fields(MonitorConfig) if f.type in ("int", "int | None"))
_FLOAT_FIELDS = tuple(f.name for f in dataclasses.fields(MonitorConfig) if f.type in ("float", "float | None"))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MonitorConfig)}


def check_config_names(overrides: Mapping[str, Any], owner: str) -> None:
    """Raise a TypeError naming every keyword that is not a MonitorConfig field, and the valid ones."""
    unknown = sorted(set(overrides) - _FIELDS)
    if unknown:
        raise TypeError(
            f"{owner}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
            f"valid names are the fields of MonitorConfig: {', '.join(sorted(_FIELDS))}."
        )


def resolve_config(config: MonitorConfig | Mapping[str, Any] | None, overrides: Mapping[str, Any], owner: str) -> MonitorConfig:
    """Merge ``config=`` and keyword arguments into one validated :class:`MonitorConfig`."""
    check_config_names(overrides, owner)
    if config is None:
        return MonitorConfig(**overrides)
    if isinstance(config, Mapping):
        return resolve_config(None, {**config, **overrides}, owner)
    if not isinstance(config, MonitorConfig):
        raise TypeError(f"{owner}(config={config!r}) must be a MonitorConfig, a dict of its fields, or None.")
    # every keyword given wins over config=, also one equal to its default. LightningCLI
    # (jsonargparse) passes every field, the ones not in its YAML at their defaults: only there
    # do keywords at their default leave config's values alone
    changed = dict(overrides)
    if set(overrides) == _FIELDS:
        changed = {k: v for k, v in overrides.items() if not _same(v, _DEFAULTS[k])}
    return dataclasses.replace(config, **changed) if changed else config


def _same(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default
