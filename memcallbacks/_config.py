"""The monitor's configuration: one frozen, keyword-only dataclass shared by every adapter."""

from __future__ import annotations

import dataclasses
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
    (Lightning's ``Trainer(log_every_n_steps=...)``; 50 elsewhere). Rows of ``history`` are kept
    for every step regardless."""

    sample_every_n_steps: int | None = None
    """Measure per-phase peaks on every N-th optimizer step (and always on logged steps); other
    steps cost nothing and leave no row. ``None`` picks per device: every step on CUDA and other
    accelerators (one allocator-stats call per phase boundary), and the logging interval on CPU,
    where each peak read is a system call (~15-35 µs on a busy VM) and the heap census
    (``mallinfo2``) can cost 30-100 µs."""

    cpu_mmap_threshold: int | None = None
    """CPU on glibc only: fix malloc's mmap threshold (``mallopt(M_MMAP_THRESHOLD)``) to this many
    bytes when the monitor starts. glibc keeps freed blocks below its (adaptive, up to 32 MiB)
    threshold in the heap, so the resident set - and hence CPU peaks - stop moving once the heap
    has grown; with e.g. ``1 << 20`` every tensor of 1 MiB or more goes back to the OS when freed
    and per-phase RSS peaks follow tensor lifetimes. Costs page faults on every large allocation and
    cannot be undone within the process. ``None`` leaves malloc alone."""

    output_dir: str | None = None
    """Folder for ``history.csv``, ``report.json`` and ``memory.png``. ``None``: a ``memcallbacks``
    folder inside the trainer's log dir (Lightning), or ``./memcallbacks`` for plain loops."""

    write_files: bool = True
    """Write the output files at the end of fit (and on an OOM). ``False`` keeps everything in memory."""

    plot: bool = True
    """Write ``memory.png`` (needs matplotlib; skipped with one info message when it is missing)."""

    log_validation: bool = True
    """Record (and log) memory during validation, test and predict loops, separately from training rows."""

    reduce_across_ranks: bool = True
    """Under torch.distributed, log the max over ranks (and the rank that holds it), in one collective
    per logged step. ``False`` logs each rank's own numbers from rank zero only."""

    max_history_rows: int = 200_000
    """Upper bound on rows kept in ``history`` (and written to disk). Past it, older rows are
    thinned to every other row, so memory and disk stay bounded on very long runs."""

    prefix: str = "memory"
    """First component of every logged key (``memory/allocated(GiB)``)."""

    strict: bool = False
    """Re-raise exceptions raised inside the monitor instead of logging them and disabling the
    monitor. For tests; a production run should never die because of its monitor."""

    def __post_init__(self) -> None:
        n = self.log_every_n_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise _fail("log_every_n_steps", n, "pass a positive integer, or None to follow the framework's setting.")
        n = self.sample_every_n_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise _fail("sample_every_n_steps", n, "pass a positive integer (1 = every step), or None to choose per device.")
        t = self.cpu_mmap_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 4096 <= t <= 1 << 30):
            raise _fail("cpu_mmap_threshold", t, "pass a byte count between 4096 and 2**30 (e.g. 1 << 20), or None to leave malloc alone.")
        if self.output_dir is not None and not isinstance(self.output_dir, (str, os.PathLike)):
            raise _fail("output_dir", self.output_dir, "pass a folder path (str or os.PathLike) or None.")
        if self.output_dir is not None:
            object.__setattr__(self, "output_dir", os.fspath(self.output_dir))
        for name in ("write_files", "plot", "log_validation", "reduce_across_ranks", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "pass True or False.")
        rows = self.max_history_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 100:
            raise _fail("max_history_rows", rows, "pass an integer of at least 100.")
        if not isinstance(self.prefix, str) or not self.prefix.strip("/") or self.prefix != self.prefix.strip("/ "):
            raise _fail("prefix", self.prefix, "pass a non-empty name without leading/trailing '/' or spaces, e.g. 'memory'.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = frozenset(f.name for f in dataclasses.fields(MonitorConfig))
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
    # keywords left at their default do not override config: LightningCLI passes every field
    changed = {k: v for k, v in overrides.items() if v != _DEFAULTS[k]}
    return dataclasses.replace(config, **changed) if changed else config
