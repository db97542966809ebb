"""The logged keys by name: every one a run can log, the short default list, and ``log_keys``.

Names are written without the prefix (``peak_forward_GiB`` is logged as ``memory/peak_forward_GiB``);
docs/metrics.md has the table, and tests/docs checks it against these lists and a real run.
"""

from __future__ import annotations

import difflib
from typing import Any

__all__ = ["TRAINING_KEYS", "EVAL_KEYS", "ALL_KEYS", "DEFAULT_KEYS", "CPU_DEFAULT_KEYS", "OPTION_KEYS", "WHEN_FORECAST",
           "MIN_OVER_RANKS", "check_log_keys", "logged_keys"]

TRAINING_KEYS = (
    "allocated_GiB", "reserved_GiB", "peak_forward_GiB", "peak_backward_GiB", "peak_optimizer_GiB", "peak_step_GiB",
    "peak_forward_above_start_GiB", "peak_backward_above_start_GiB", "peak_optimizer_above_start_GiB",
    "peak_step_above_start_GiB",
    "peak_reserved_GiB", "max_allocated_GiB", "host_rss_GiB", "monitor_time_ms", "alloc_retries", "ooms",
    "inactive_split_GiB", "findings", "overhead", "capacity_GiB", "expected_GiB", "unexplained_GiB", "snapshots",
    "host_python_GiB", "host_private_GiB", "host_workers_GiB", "gc_time_ms", "gc_collected", "gc_freed_GiB",
    "predicted_peak_forward_GiB", "predicted_peak_backward_GiB", "predicted_peak_optimizer_GiB", "predicted_peak_GiB",
    "preflight_error_GiB", "peak_step_rank", "allocated_rank", "runs_out_in_steps",
)
"""Every key a training step can log."""

EVAL_KEYS = tuple(f"{stage}/{name}" for stage in ("val", "test", "predict")
                  for name in ("allocated_GiB", "peak_step_GiB", "peak_reserved_GiB", "peak_step_rank"))
"""Every key the end of a validation, test or predict loop can log."""

ALL_KEYS = TRAINING_KEYS + EVAL_KEYS

DEFAULT_KEYS = (
    "peak_forward_GiB", "peak_backward_GiB", "peak_optimizer_GiB", "reserved_GiB", "allocated_GiB", "findings",
    "host_rss_GiB", "runs_out_in_steps", "val/peak_step_GiB", "test/peak_step_GiB", "predict/peak_step_GiB",
)
"""What a person reads (``log_keys="default"``): the per-phase peaks, reserved and the step-start floor
(``allocated``) at step start, the open findings and the host's resident memory; an evaluation
loop's peak at its end. Seven keys on a training step, one on an evaluation loop's; and, only while a
growth finding forecasts when memory runs out, the steps left (:data:`WHEN_FORECAST`)."""

WHEN_FORECAST = ("runs_out_in_steps",)
"""Default keys logged only while a forecast stands (empty otherwise: not a column of a healthy run)."""

MIN_OVER_RANKS = ("runs_out_in_steps",)
"""Keys whose ranks' values meet as a minimum, not a maximum: the rank that runs out first."""

CPU_DEFAULT_KEYS = tuple(name.replace("_GiB", "_above_start_GiB") if name.startswith("peak_") and "/" not in name else name
                         for name in DEFAULT_KEYS)
"""The default list on CPU: each phase's rise above the step's start in place of its peak. There the
peaks are the resident set's high-water mark, often one number for the three phases (glibc keeps
freed blocks), while what each phase rose above the resident memory at the step's start differs."""

OPTION_KEYS = {
    "preflight": ("predicted_peak_forward_GiB", "predicted_peak_backward_GiB", "predicted_peak_optimizer_GiB",
                  "predicted_peak_GiB", "preflight_error_GiB"),
    "auto_snapshot": ("snapshots",),
    "gc_every_n_steps": ("gc_time_ms", "gc_collected", "gc_freed_GiB"),
}
"""The keys an option adds to the default list when it is turned on (a user who asks for the
pre-flight sees its prediction)."""

_WORDS = ("default", "all")


def check_log_keys(value: Any, owner: str) -> str | tuple[str, ...]:
    """``"default"``, ``"all"``, or a list of key names (``"default"`` among them stands for the
    default list) as a tuple; a ValueError naming the bad name and its closest valid ones otherwise."""
    if isinstance(value, str) and value in _WORDS:
        return value
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise ValueError(f"{owner}.log_keys={value!r} is invalid: pass 'default' (the short list), 'all', "
                         "or a list of key names such as ['default', 'peak_step_GiB'] (docs/metrics.md lists them).")
    names = tuple(value)
    for name in names:
        if name == "default":
            continue
        if not isinstance(name, str) or name not in ALL_KEYS:
            close = difflib.get_close_matches(str(name), ALL_KEYS, n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            raise ValueError(f"{owner}.log_keys has {name!r}, which is not a logged key; {hint}Names are written "
                             "without the prefix, e.g. 'peak_step_GiB' or 'val/peak_step_GiB'; docs/metrics.md lists every key.")
    return names


def logged_keys(log_keys: str | tuple[str, ...], prefix: str, options: dict[str, bool], cpu: bool = False) -> frozenset[str] | None:
    """The full keys (prefix included) a run hands its loggers; None: every key. ``options``: which
    of :data:`OPTION_KEYS`' options are on; ``cpu``: the device's peaks are the resident set's
    high-water mark (``"default"`` is then :data:`CPU_DEFAULT_KEYS`)."""
    if log_keys == "all":
        return None
    names = set(log_keys) - {"default"} if not isinstance(log_keys, str) else set()
    if log_keys == "default" or "default" in log_keys:
        names.update(CPU_DEFAULT_KEYS if cpu else DEFAULT_KEYS)
        for option, keys in OPTION_KEYS.items():
            if options.get(option):
                names.update(keys)
    return frozenset(f"{prefix}/{name}" for name in names)
