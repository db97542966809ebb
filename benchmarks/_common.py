"""What ``overhead.py`` and ``overhead_accelerate.py`` share: the targets, the statistics, the interleaved
repeats, the workload's layers and the environment record.

Not a script: the two scripts import it as ``_common`` (run as ``python benchmarks/<script>.py``, their own
folder is ``sys.path[0]``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import statistics
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import memcallbacks

if TYPE_CHECKING:
    from torch import nn

BARE = "bare"

# the targets for the Lightning adapter; the Accelerate adapter is held to the same
TARGET_LOG_EVERY = 50
TARGET_US_PER_STEP = 30.0
TARGET_RATIO = 1.03


# ---------------------------------------------------------------------------- results as they come
class ResultFile:
    """A JSON results file rewritten after every measurement, so a run cut short (a stage timeout, a
    Ctrl-C) leaves everything measured so far. Each write goes to a temporary file renamed over the
    target (``os.replace``), so a reader never sees half a file; ``"complete"`` is False until
    :meth:`finish`. ``path=None`` writes nothing."""

    def __init__(self, path: str | os.PathLike[str] | None, **fixed: Any) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.payload: dict[str, Any] = {**fixed, "complete": False}

    def append(self, section: str, row: dict[str, Any]) -> None:
        """Add one measurement to the list ``section`` and rewrite the file."""
        self.payload.setdefault(section, []).append(row)
        self.write()

    def update(self, **sections: Any) -> None:
        """Set whole sections and rewrite the file."""
        self.payload.update(sections)
        self.write()

    def finish(self, **sections: Any) -> None:
        """The last write: ``"complete": true``."""
        self.payload["complete"] = True
        self.update(**sections)

    def write(self) -> None:
        if self.path is None:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.payload, f, indent=1, default=str)
        os.replace(tmp, self.path)


# ---------------------------------------------------------------------------- the workload
def mlp_layers(d_in: int, hidden: int, n_classes: int = 10) -> nn.Sequential:
    """The benchmark MLP: ``d_in -> hidden -> hidden -> n_classes`` with ReLUs."""
    # here, not above: a script's --help answers before torch loads (seconds)
    from torch import nn

    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))


# ---------------------------------------------------------------------------- statistics
def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, interpolated linearly between the two nearest ranks."""
    values = sorted(values)
    pos = (len(values) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of ``values`` (the sign test's order
    statistics: the k-th smallest and k-th largest, k the largest rank whose two-sided binomial tail
    stays within ``1 - confidence``); None when there are too few values for one (n < 6 at 95%).

    This is what says whether one monitor is cheaper than another across paired repeats: the IQR of
    the differences is the noise of one repeat, this is the uncertainty of their typical value."""
    n = len(values)
    ordered = sorted(values)
    tail, k = 0.0, 0
    for i in range(n + 1):  # tail = P(Binomial(n, 1/2) <= i)
        tail += math.comb(n, i) / 2**n
        if 2 * tail > 1 - confidence:
            break
        k = i + 1
    if k == 0:
        return None
    return ordered[k - 1], ordered[n - k]


def is_logged(step: int, log_every: int) -> bool:
    """The step with ``global_step == step`` is logged (and, on CPU, sampled by the monitor) when this holds."""
    return (step + 1) % log_every == 0


def robust_mean(durations: list[float], logged: list[bool]) -> float:
    """Mean step time with each class of step (logged / not logged) at its median, weighted by its count.

    On a shared machine a step now and then loses milliseconds to another process; a median per
    class drops those, while the class weights keep the rarer, costlier logged steps in.
    """
    total = 0.0
    for flag in (True, False):
        members = [d for d, f in zip(durations, logged) if f is flag]
        if members:
            total += len(members) * statistics.median(members)
    return total / len(durations)


def robust_step_us(durations: list[float], first_step: int, log_every: int) -> float:
    """:func:`robust_mean` in µs of consecutive steps ``durations`` (seconds), the first of them ``first_step``."""
    return robust_mean(durations, [is_logged(first_step + i, log_every) for i in range(len(durations))]) * 1e6


def monitor_self_us(summary: dict[str, Any]) -> tuple[float, float]:
    """The engine's own time from a monitor's ``summary()``: µs per sampled step (it times itself on sampled
    steps only), and that spread over every step seen."""
    cost = summary.get("monitor_time_per_step_us") or {"mean": float("nan")}
    return cost["mean"], cost["mean"] * summary["steps_sampled"] / max(summary["steps_seen"], 1)


# ---------------------------------------------------------------------------- interleaved repeats
def interleaved_runs(
    run: Callable[[str, int], dict[str, Any]],
    variants: Sequence[str],
    log_settings: Sequence[int],
    repeats: int,
    order: random.Random,
    progress: Callable[[int, list[dict[str, Any]]], None],
) -> list[dict[str, Any]]:
    """``repeats`` rounds of ``run(variant, log_every)`` for every pair, in an order shuffled by ``order`` each
    round; every result gets its ``"repeat"``. After each round, ``progress(repeat, its bare runs by log setting)``."""
    runs: list[dict[str, Any]] = []
    pairs = [(v, n) for v in variants for n in log_settings]
    for repeat in range(repeats):
        order.shuffle(pairs)
        for variant, log_every in pairs:
            runs.append({**run(variant, log_every), "repeat": repeat})
        progress(repeat, sorted((r for r in runs if r["repeat"] == repeat and r["variant"] == BARE), key=lambda r: r["log_every"]))
    return runs


def paired_with_bare(runs: list[dict[str, Any]], log_settings: Sequence[int], variants: Sequence[str]) -> Iterator[tuple[int, str, list[dict[str, Any]], dict[int, dict[str, Any]]]]:
    """Per (log setting, variant) with runs: ``(log_every, variant, its runs, {repeat: bare run})``, keeping only
    the runs whose repeat has a bare run at that log setting."""
    for log_every in log_settings:
        bare = {r["repeat"]: r for r in runs if r["variant"] == BARE and r["log_every"] == log_every}
        for variant in variants:
            mine = [r for r in runs if r["variant"] == variant and r["log_every"] == log_every and r["repeat"] in bare]
            if mine:
                yield log_every, variant, mine, bare


# ---------------------------------------------------------------------------- environment
def cpu_name() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def load_average() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def base_environment(**frameworks: str) -> dict[str, Any]:
    """Versions and machine, what every run records first; ``frameworks`` (name=version) come after torch's."""
    import torch  # here, not above: see mlp_layers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        **frameworks,
        "memcallbacks": memcallbacks.__version__,
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
