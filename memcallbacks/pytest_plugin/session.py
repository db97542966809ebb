"""One ``train_memory`` test: the monitors it attached, what they measured, and the failure text."""

from __future__ import annotations

import dataclasses
import logging
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from memcallbacks._base.units import format_bytes
from memcallbacks._runtime.guard import session_of
from memcallbacks.pytest_plugin.limits import PHASE_NAMES, Limits
from memcallbacks.pytest_plugin.probe import Probe, host_growth_bytes
from memcallbacks.pytest_plugin.timeline import Timeline

log = logging.getLogger(__name__)

__all__ = ["Failure", "TrainMemory"]

_WIDTH = 100


def merged_config(base: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``base``'s MonitorConfig fields with ``changes`` on top; a group (``leaks=...``) merges field by
    field, so the plugin's leak thresholds stay unless the test names them."""
    out = dict(base)
    for name, value in changes.items():
        if isinstance(out.get(name), dict) and dataclasses.is_dataclass(value):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if getattr(value, f.name) != f.default}
        out[name] = {**out[name], **value} if isinstance(out.get(name), dict) and isinstance(value, Mapping) else value
    return out


@dataclass
class Failure:
    """One reason a test fails: a summary line, holder chains, and what to do."""

    summary: str
    holders: list[str] = field(default_factory=list)
    fix: str = ""

    def render(self) -> str:
        lines = [self.summary]
        lines += [f"    held by: {h}" for h in self.holders]
        if self.fix:
            lines += textwrap.wrap(self.fix, _WIDTH, initial_indent="    fix: ", subsequent_indent="         ")
        return "\n".join(lines)


HOST_FIX = (
    "Something keeps Python objects from every step: a dict or list on a module, a callback or the model that gets "
    "entries every step (a per-step record, a memo cache with no bound such as `functools.lru_cache(maxsize=None)` on "
    "unique inputs). Bound it (`collections.deque(maxlen=...)`, `lru_cache(maxsize=...)`), clear it every epoch, or keep "
    "summaries instead of objects; the holders name what grew (docs/findings.md, host_growth)."
)
"""The fix line of a failing ``host_growth`` finding (its message is the census's account of what grew)."""

LINGERING_FLOOR = 4096
"""Lingering references below this many bytes do not fail a test (see monitor_config)."""


class TrainMemory:
    """The ``train_memory`` fixture: limits, the monitors attached in this test, and their verdict.

    Example::

        def test_loop(train_memory):
            train_memory.limits(max_leak="1 MiB")
            for x, y in train_memory.track(model, optimizer, batches):
                loss = F.mse_loss(model(x), y)
                loss.backward(); optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, limits: Limits, output_dir: Path) -> None:
        self._limits = limits
        self.output_dir = output_dir
        self.timeline = Timeline()
        self.probes: list[Probe] = []
        self.closers: list[Callable[[], None]] = []
        self.left_open: list[Callable[[], None]] = []  # track() monitors whose loop was left early: closed by the plugin
        self.tracked: tuple[Any, Any] | None = None  # the last track() loop's model and optimizer (an OOM's explanation)
        self._patches: Any = None
        self._started = False
        self._evaluated: list[Failure] | None = None

    # ------------------------------------------------------------------ set-up
    def limits(self, limits: Limits | None = None, **kwargs: Any) -> Limits:
        """Replace the marker's limits (all or some): ``train_memory.limits(max_leak="1 MiB")``. Returns them."""
        if limits is not None and kwargs:
            raise TypeError("train_memory.limits() takes a Limits object or keyword arguments, not both.")
        if self.probes:
            raise RuntimeError("train_memory.limits() must be called before training starts: a monitor is already attached.")
        self._limits = limits if limits is not None else self._limits.replace(**kwargs)
        return self._limits

    @property
    def current_limits(self) -> Limits:
        return self._limits

    def monitor_config(self) -> dict[str, Any]:
        """MonitorConfig fields for every monitor the plugin creates: every step sampled and checked."""
        folder = self.output_dir / f"monitor{len(self.probes)}"
        config: dict[str, Any] = {
            "sample_every_n_steps": 1,
            "output_dir": str(folder),
            "plot": False,
            "console_summary": False,  # the plugin reports through pytest, not the console
            "leaks": {
                "estimate_model_states": False,
                "growth_warmup_steps": self._limits.warmup,
                # a loop variable still holding the last step's scalar loss (4 B) is not a failure: lingering
                # counts from LINGERING_FLOOR bytes (a kept graph or batch is far above it)
                "lingering_min_bytes": max(self._limits.max_leak, LINGERING_FLOOR),
            },
        }
        config = merged_config(config, self._limits.config)
        return config

    def start(self) -> None:
        """Install the constructor wrappers and the profiler (once)."""
        if self._started:
            return
        from memcallbacks.pytest_plugin.attach import Patches

        self._started = True
        self.timeline.start()
        self._patches = Patches(self)
        self._patches.install()

    def probe(
        self, core: Any, *, name: str, bookkeeping: Callable[[], list[Any]] | None = None,
        census_every_step: bool = False, last_step: Callable[[], bool] | None = None,
    ) -> Probe:
        probe = Probe(
            core, self.timeline, warmup=self._limits.warmup, max_leak=self._limits.max_leak,
            bookkeeping=bookkeeping, census_every_step=census_every_step, last_step=last_step, name=name,
        )
        self.probes.append(probe)
        return probe

    def track(self, model: Any, optimizer: Any, batches: Iterable[Any], **config: Any) -> Iterator[Any]:
        """Watch a hand-written loop: yields the batches, marking a step boundary before each."""
        from memcallbacks.monitor import Monitor

        self.start()
        monitor = Monitor(model, optimizer, **merged_config(self.monitor_config(), config))
        self.probe(session_of(monitor), name="train_memory.track()")
        self.closers.append(monitor.close)
        self.tracked = (model, optimizer)
        try:
            yield from monitor.track(batches)
        except GeneratorExit:  # the loop body raised (the plugin records the error, then closes it) or broke out
            self.left_open.append(monitor.close)
            raise
        monitor.close()  # the end census sees the test's locals: the loop has just ended

    def close_loops(self) -> None:
        """Close the ``track()`` monitors whose loop the test left early (``break``), before the verdict."""
        left, self.left_open = self.left_open, []
        for close in left:
            close()

    def stop(self) -> None:
        """Close what the test left open, remove the wrappers, stop the profiler. Safe to call twice."""
        for probe in self.probes:
            if probe.census_every_step:
                probe.frozen = True  # a loop the test left open ends here, after its locals are gone
        self.close_monitors()
        for probe in self.probes:
            probe.cycles.release()
        if self._patches is not None:
            self._patches.remove()
        self.timeline.stop()

    def close_monitors(self) -> None:
        """Close the monitors the test's loops opened (their files written); each once."""
        closers, self.closers = self.closers, []
        for close in closers:
            try:
                close()
            except Exception:
                log.warning("train_memory: closing a monitor failed", exc_info=True)

    # ------------------------------------------------------------------ verdict
    def phase_peaks(self) -> tuple[dict[str, int], str]:
        """The largest peak per phase over every monitor of the test, and where the numbers come from."""
        peaks: dict[str, int] = {}
        sources = []
        for probe in self.probes:
            found, source = probe.phase_peaks()
            sources.append(source)
            for phase, value in found.items():
                peaks[phase] = max(peaks.get(phase, value), value)
        return peaks, (sources[0] if len(set(sources)) == 1 else "; ".join(sorted(set(sources))))

    def phase_rises(self) -> dict[str, int]:
        """The most each phase rose above its step's start, over every monitor of the test (same source as the peaks)."""
        rises: dict[str, int] = {}
        for probe in self.probes:
            for phase, value in probe.phase_rises().items():
                rises[phase] = max(rises.get(phase, value), value)
        return rises

    def failures(self) -> list[Failure]:
        if self._evaluated is None:
            self.stop()
            self._evaluated = self._findings() + self._leaks() + self._peaks()
        return self._evaluated

    def _findings(self) -> list[Failure]:
        out = []
        for probe in self.probes:
            found = [f for f in probe.findings() if fails_the_test(f, self._limits.fail_on or ())]
            # settled growth and advice are left out above: reported in the monitor's files, not a failure
            if probe.device_kind == "cpu" and any(f.kind == "host_growth" for f in found):
                # on CPU the heap is the device: its growth, when its censuses found no tensor that grew,
                # is the same Python-object leak the host failure names (one leak, one failure)
                found = [f for f in found if not (f.kind == "growth" and (f.details or {}).get("tensors_grew") is not True
                                                  and (f.details or {}).get("evidence") != "graph_chain")]
            for finding in found:
                if finding.kind == "host_growth":  # named by the plugin's own host census where it ran (probe.py)
                    holders = probe.host_holders()
                    settled = not fails_the_test(finding, ())  # failing only because fail_on names "settled"
                    out.append(Failure(_host_summary(finding, probe.host_types()),
                                       list(finding.holders) if holders is None else holders,
                                       finding.message if settled else HOST_FIX))
                    continue
                out.append(Failure(_finding_summary(finding), list(finding.holders), finding.message))
        return out

    def _leaks(self) -> list[Failure]:
        out = []
        limit = self._limits.max_leak
        for probe in self.probes:
            leak = probe.leak
            if leak is None or leak.leaked <= limit:
                continue
            new = leak.new_bytes
            parts = (f"; that is {format_bytes(new)} in tensors allocated after warm-up (the holders below) less "
                     f"{format_bytes(new - leak.leaked)} of warm-up tensors freed"
                     if new is not None and format_bytes(new) != format_bytes(leak.leaked) else "")
            out.append(Failure(
                f"leaked {format_bytes(leak.leaked)} over {leak.steps} step{'s' if leak.steps != 1 else ''} "
                f"(limit {format_bytes(limit)}): tensor memory alive after the last step ({format_bytes(leak.final_bytes)}) "
                f"against after warm-up step {self._limits.warmup} ({format_bytes(leak.warmup_bytes)}), params, grads, "
                f"optimizer state and the current batch left out{parts} [{probe.name}]",
                leak.holders,
                "Something keeps tensors from step to step: a list or dict on the model or a global that gets a "
                "tensor per step, a running total without `.detach()`, or outputs stored on `self`. Store "
                "`.item()` or `.detach().cpu()` values, bound or clear the cache; the holders name what grew.",
            ))
        return out

    def _peaks(self) -> list[Failure]:
        limits = self._limits.peak_limits()
        if not limits:
            return []
        peaks, source = self.phase_peaks()
        out = []
        for phase in PHASE_NAMES:
            limit, value = limits.get(phase), peaks.get(phase)
            if limit is None or value is None or value <= limit:
                continue
            out.append(Failure(
                f"peak {phase} {format_bytes(value)} over limit {format_bytes(limit)} (measured as {source})",
                fix=f"Find what {phase} keeps alive at its peak (a memory snapshot: MemoryMonitor(auto_snapshot=True), "
                "docs/snapshots.md), or raise the limit if the model grew on purpose.",
            ))
        return out

    def report(self, nodeid: str) -> str:
        failures = self.failures()
        head = f"train_memory: {nodeid} failed {len(failures)} memory check{'s' if len(failures) != 1 else ''}"
        blocks = [f.render() for f in failures]
        tail = f"monitor files: {self.output_dir}"
        return "\n\n".join([head, *blocks, tail])


def fails_the_test(finding: Any, fail_on: tuple[str, ...]) -> bool:
    """An open problem always fails; settled growth and advice only when ``fail_on`` names them.

    A host growth that settled (``details["open"] is False``: a cache that filled, then stayed
    flat; docs/findings.md, "Host memory") is settled growth, as a device growth whose state is
    ``"settled"``."""
    if finding.state == "settled" or (finding.kind == "host_growth" and (finding.details or {}).get("open") is False):
        return "settled" in fail_on
    return finding.severity != "advice" or "advice" in fail_on


def _finding_summary(finding: Any) -> str:
    """One line for a failing finding; a cause that several detectors saw says so (``; one cause: lingering at step 1,
    growth at step 4``)."""
    seen = getattr(finding, "evidence", None) or []
    text = _kind_summary(finding)
    if len(seen) > 1:
        text += "; one cause: " + ", ".join(f"{e.get('kind')} at step {e.get('step')}" for e in seen)
    return text


def _kind_summary(finding: Any) -> str:
    details = finding.details or {}
    if finding.kind == "lingering":
        start = details.get("from_step", finding.step - 1)
        label = "lingering, advice" if finding.severity == "advice" else "lingering"
        return f"step {finding.step} kept {format_bytes(finding.bytes)} of step {start} alive ({label})"
    if finding.kind == "growth" and details.get("evidence") == "graph_chain":
        alive = details.get("graph_steps_alive") or []
        steps = ", ".join(str(s) for s in alive)
        return (f"the autograd graphs of steps {steps} were alive together at step {alive[-1] + 1 if alive else finding.step}, "
                f"{format_bytes(finding.bytes)} of tensors in them (growth, graph chain)")
    if finding.kind == "growth":
        rate = details.get("rate_bytes_per_step")
        per_step = f", {format_bytes(rate)}/step" if rate else ""
        return f"memory at step start grew by {format_bytes(finding.bytes)} up to step {finding.step}{per_step} (growth)"
    if finding.kind == "host_growth":
        return _host_summary(finding)
    return f"gc.collect() freed {format_bytes(finding.bytes)} of tensors held in reference cycles at step {finding.step} (cycle)"


def _host_summary(finding: Any, types: list[tuple[str, int]] | None = None) -> str:
    """``Python objects on the host grew by 12.5 MiB from step 10 to step 60, 256.0 KiB/step (host growth):
    Spec +25,600, tuple +25,600`` - the types from a host census (``types``: the plugin's own), when one ran."""
    details = finding.details or {}
    if types is None:
        types = [(t.get("type"), t.get("count")) for t in details.get("types") or [] if isinstance(t, dict)]
    types = [(str(n), int(c)) for n, c in types if c and c > 0]
    rate = details.get("rate_bytes_per_step")
    since = details.get("since_step", finding.first_step)
    per_step = f", {format_bytes(rate)}/step" if rate else ""
    label = "host growth, settled" if details.get("open") is False or finding.state == "settled" else "host growth"
    text = (f"Python objects on the host grew by {format_bytes(host_growth_bytes(finding))} from step {since} to step "
            f"{finding.step}{per_step} ({label})")
    if types:
        text += ": " + ", ".join(f"{n.rsplit('.', 1)[-1]} +{c:,}" for n, c in types[:4])
    elif not finding.holders:
        text += "; the host census did not run or named no holder (docs/host.md)"
    return text
