"""How a session ends: exceptions recorded as events, the report, and the run's files and trackers.

One composed part of :class:`~memcallbacks._runtime.session.Session` (``session.ending``), which
delegates to it: every method here runs at the end of a run or while an exception unwinds, and
never raises.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from memcallbacks._base import distributed as _distributed
from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.findings import Finding
from memcallbacks._base.cpu import own_time
from memcallbacks._base.units import format_bytes
from memcallbacks._runtime import end_write
from memcallbacks._runtime.end_write import wait_for_every_rank, write_detached
from memcallbacks._runtime.checks import StepChecks
from memcallbacks._runtime.finding_sink import FindingSink
from memcallbacks._runtime.guard import safe_str
from memcallbacks._runtime.sampling import MemoryEngine
from memcallbacks._runtime.schedule import DENSE_READ_STEPS, Schedule
from memcallbacks._files.outputs import REPORT_VERSION, write_outputs
from memcallbacks._files.report_shape import shape_report
from memcallbacks._files.verdict import console_channel, console_lines
from memcallbacks.host.ranks import find_imbalance
from memcallbacks.oom import is_oom
from memcallbacks.oom.accounting import address_space_left
from memcallbacks.trackers import RunOutputs
from memcallbacks.trackers.ranks import receive_snapshots, snapshot_payload

__all__ = ["RunEnd", "EndingSession", "is_oom", "PLOT_ROOM_BYTES"]

#: Address space that drawing ``memory.png`` needs: 40-70 MiB measured (matplotlib's import, one figure, PNG), doubled.
#: Under an ``RLIMIT_AS`` with less left (an out-of-memory error at the limit), the plot is left out: a failed
#: allocation inside numpy's BLAS ends the process (OpenBLAS calls ``exit``), not only the drawing.
PLOT_ROOM_BYTES = 128 << 20


class EndingSession(Protocol):
    """What the run's end reads of its :class:`~memcallbacks._runtime.session.Session` (which imports this module)."""

    config: MonitorConfig
    engine: MemoryEngine
    schedule: Schedule
    checks: StepChecks
    sink: FindingSink
    log: logging.Logger
    owner: str
    framework: str
    title: str
    current_step: int
    events: list[dict[str, Any]]
    files: dict[str, str]
    output_dir: Path | None
    snap: Any
    trackers: Any

    @property
    def findings(self) -> list[Finding]: ...
    @property
    def dashboard(self) -> Any: ...
    @property
    def device_kind(self) -> str: ...
    def add_finding(self, finding: Finding) -> None: ...
    def format_report(self) -> str: ...
    def history_frame(self) -> Any: ...
    def summary(self) -> dict[str, Any]: ...
    def fail(self, exc: BaseException, where: str) -> None: ...


class RunEnd:
    """The end of a run, for one session, read through the parts :class:`EndingSession` names."""

    def __init__(self, session: EndingSession) -> None:
        self.session = session
        self.oom: tuple[BaseException, dict[str, Any]] | None = None  # explained when the run's last row is closed

    def record_exception(self, exc: BaseException, step: int) -> None:
        """Note an exception that is ending the run as an event (``"oom"`` or ``"exception"``); never raises."""
        try:
            self._record_exception(exc, step)
        except Exception as internal:
            self.session.log.error("%s: could not record the run's exception (internal error); the run's own exception propagates.",
                                   self.session.owner, exc_info=internal)

    def _record_exception(self, exc: BaseException, step: int) -> None:
        s = self.session
        engine = s.engine
        oom = is_oom(exc)
        event = {
            "kind": "oom" if oom else "exception",
            "step": int(step),
            "rank": engine.rank,
            "error": f"{type(exc).__name__}: {safe_str(exc)}",
            "max_allocated_bytes": engine.max_allocated,
            "max_reserved_bytes": engine.max_reserved,
        }
        if any(e.get("error") == event["error"] and e.get("step") == event["step"] for e in s.events):
            return  # the same exception seen by two hooks (a step context, then close)
        s.events.append(event)
        if not oom:
            return
        if s.snap is not None:
            s.snap.on_exception(exc, step)
        self.oom = (exc, event)

    def _explain_oom(self, exc: BaseException, event: dict[str, Any]) -> None:
        """The OOM explained (memcallbacks/oom): logged, ``oom.json``, and an ``"oom"`` finding for the report and trackers."""
        from memcallbacks._runtime.preflight_check import fake_steps
        from memcallbacks.oom.record import record_oom

        s, checks = self.session, self.session.checks
        held = checks.watch.attribution if checks.watch is not None and checks.watch.attribution.model is not None else checks.state  # model, optimizer
        peaks = s.engine.max_allocated, s.engine.max_reserved  # the explanation's own memory is not the run's
        with fake_steps():  # the remedies' fake optimizer steps are not this run's
            finding = record_oom(exc, event, engine=s.engine, model=held.model, optimizer=held.optimizer, precision=checks.state.precision,
                                 findings=s.findings, capacity=s.config.capacity_bytes,
                                 output_dir=s.output_dir if s.config.write_files else None,
                                 snapshots=s.snap.records if s.snap is not None else [], log=s.log, owner=s.owner)
        s.engine.max_allocated, s.engine.max_reserved = peaks
        if finding is not None:
            s.add_finding(finding)
        else:
            s.log.error("%s: out of memory at step %d on rank %d; writing the memory report before the error propagates.",
                        s.owner, event["step"], s.engine.rank)

    def report(self) -> dict[str, Any]:
        """What ``report.json`` holds: version, config, summary, findings, events and files."""
        from memcallbacks._base.version import __version__

        s = self.session
        return shape_report({
            "version": REPORT_VERSION,
            "memcallbacks_version": __version__,
            "framework": s.framework,
            "config": s.config.to_dict(),
            "summary": dict(s.summary(), cadence=s.schedule.summary(), rank_figures=self.rank_figures()),
            "findings": s.sink.to_list(),
            "events": list(s.events),
            **s.checks.report(),  # model_states, preflight, gc, host
            "snapshots": list(s.snap.records) if s.snap is not None else [],
            "files": dict(s.files),
        }, s.output_dir, s.history_frame())

    def recorded_nothing(self) -> bool:
        """No training step, no evaluation loop and no event since the last reset."""
        s = self.session
        return s.engine.seen_steps == 0 and not s.engine.eval_rows and not s.events

    def _finish_watch(self) -> None:
        """Work the leak watch still owes when the run ends (a growth finding's second census)."""
        s = self.session
        watch, host = s.checks.watch, s.checks.host
        if watch is None or not s.engine.enabled:
            return
        t0 = own_time()
        try:
            for finding in watch.attribution.finish():  # a growth finding still waiting for its second census
                s.add_finding(finding)
        except Exception:
            s.log.debug("the leak watch's last census failed", exc_info=True)
        figures_s = 0.0
        if host is not None:
            before = host.seconds
            for finding in host.finish():  # a host growth still waiting for its second census
                s.add_finding(finding)
            figures_s = host.seconds - before  # the report's last Python-object figure: no finding work
        s.schedule.charge_other(max(0.0, own_time() - t0 - figures_s), "findings")

    def finish(self, gather: bool) -> dict[str, str]:
        """``Session.finish`` after its observers heard of it: the files, with the gc watch off."""
        s = self.session
        # the files' imports (pandas, matplotlib) run dozens of collections: the gc watch, which
        # reads the heap around each one it measures, is for training, and training is over
        watch = s.checks.watch
        collections = watch.collections if watch is not None else None
        if collections is not None:
            was_own, collections.own = collections.own, True
        try:
            files = self._finish(gather)
        finally:
            if collections is not None:
                collections.own = was_own
        if gather:  # no rank's fit() returns while another rank's files are still being written
            wait_for_every_rank(s.engine.world_size, s.owner)
        return files

    def _finish(self, gather: bool) -> dict[str, str]:
        s = self.session
        engine = s.engine
        try:
            if engine.in_step and engine.enabled:
                engine.end_step()
            if self.oom is not None:  # after the last row: the explanation's own memory is no step's
                oom, self.oom = self.oom, None
                self._explain_oom(*oom)
            self._finish_watch()
            if s.snap is not None:
                s.snap.stop()  # writes a capture cut short by the end of training
            report = self.report()
            distributed = engine.world_size > 1 and _distributed.is_distributed()
            # one collective: every rank's summary, and its snapshot files for rank zero's trackers
            payload = snapshot_payload(report["snapshots"], engine.rank) if s.config.log_to_trackers and engine.rank > 0 else None
            gathered = _distributed.gather_objects((report["summary"], payload), engine.device) if gather and distributed else None
            summaries = [g[0] for g in gathered] if gathered is not None else None
            if summaries is not None and engine.rank == 0:  # one rank's host or device memory standing apart
                self._rank_imbalance(summaries)
                report["findings"] = s.sink.to_list()
            if not (s.config.write_files and s.output_dir is not None):
                self._to_trackers(report, gathered)
                self._announce(report)
                return {}
            if self.recorded_nothing():
                s.log.warning("%s: this run recorded no training step and no evaluation loop; the files in %s are left "
                              "as they were.", s.owner, s.output_dir)
                return s.files
            s.files = self._write(report, summaries, distributed)
            if summaries is not None and engine.rank == 0:
                report = dict(report, files=s.files, ranks=summaries)
            self._to_trackers(report, gathered)
            self._announce(dict(report, files=s.files))
        except OSError as exc:  # a full disk, a folder removed: the previous set stays whole
            s.log.error("%s: could not write the memory files to %s (%s); the files there are left as they were.",
                        s.owner, s.output_dir, exc.strerror or exc)
        except Exception as exc:
            s.fail(exc, "writing outputs")
        return s.files

    def _write(self, report: dict[str, Any], summaries: list[Any] | None, distributed: bool) -> dict[str, str]:
        """This rank's files as one set (a writer process of its own under distributed: see end_write.py)."""
        s = self.session
        engine = s.engine
        title = s.title or f"{s.framework} on {report['summary'].get('device', {}).get('device', '?')}"
        if engine.world_size > 1:
            title += f", rank {engine.rank}"
        return write_detached(  # by a writer process of its own under distributed: see end_write.py
            write_outputs,
            s.output_dir,
            rank=engine.rank,
            world_size=engine.world_size,
            history=s.history_frame(),
            eval_history=engine.eval_frame(),
            report=report,
            plot=s.config.plot and self._room_to_draw(),
            title=title,
            ranks=summaries if summaries is not None and engine.rank == 0 else None,
            detach=distributed and end_write.DETACH_WRITER,
            owner=s.owner,
        )

    def _room_to_draw(self) -> bool:
        """Whether the process has the address space to draw ``memory.png`` (said in the log when not)."""
        left = address_space_left()
        if left is None or left >= PLOT_ROOM_BYTES:
            return True
        s = self.session
        s.log.warning("%s: memory.png is not drawn: %s of address space is left under the process's limit (RLIMIT_AS), and "
                      "drawing needs about %s. The other files are written.", s.owner, format_bytes(left), format_bytes(PLOT_ROOM_BYTES))
        return False

    def _announce(self, report: dict[str, Any]) -> None:
        """Rank zero: the verdict and the files' folder on the console, through the adapter's channel."""
        s = self.session
        if s.engine.rank != 0 or not getattr(s.config, "console_summary", True):
            return
        try:
            show = console_channel(s.framework)
            for line in console_lines(report, s.history_frame()):
                show(line)
        except Exception:  # a closed stream, say: the files are written, the run is not the monitor's to fail
            s.log.debug("the end-of-run console lines failed", exc_info=True)

    def rank_figures(self) -> dict[str, float]:
        """This rank's figures for the per-rank comparison (host: docs/host.md; device: the run's peak)."""
        s = self.session
        figures: dict[str, float] = {}
        if s.device_kind != "cpu":  # on CPU the device is the host: one figure, one finding
            figures["device_peak_allocated_bytes"] = float(s.engine.max_allocated)
        figures.update(s.checks.host_figures() or {})
        return figures

    def _rank_imbalance(self, summaries: list[Any]) -> None:
        s = self.session
        if s.engine.seen_steps < DENSE_READ_STEPS:
            return  # a short run's figures are its warm-up (imports, loggers, rank zero's first files), not a rank apart
        try:
            figures = [x.get("rank_figures") if isinstance(x, dict) else None for x in summaries]
            for finding in find_imbalance(figures, step=s.current_step):
                s.add_finding(finding)
        except Exception:
            s.log.debug("the per-rank comparison failed", exc_info=True)

    def _to_trackers(self, report: dict[str, Any], gathered: list[Any] | None) -> None:
        """Rank zero, after the files are written: the report, plot and every rank's snapshots to the trackers."""
        s = self.session
        if s.trackers is None or not s.config.log_to_trackers or s.engine.rank != 0:
            return
        snapshots = [dict(r, rank=0) for r in report.get("snapshots", [])]
        snapshots += receive_snapshots([g[1] for g in gathered or []], s.output_dir)
        outputs = RunOutputs(
            s.config.prefix, report, dict(s.files), snapshots, list(s.findings), s.format_report()
        )
        s.trackers.finish(outputs, s.dashboard)
