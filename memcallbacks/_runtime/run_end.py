"""How a session ends: exceptions recorded as events, the report, and the run's files and trackers.

One composed part of :class:`~memcallbacks._runtime.session.Session` (``session.ending``), which
delegates to it: every method here runs at the end of a run or while an exception unwinds, and
never raises.
"""

from __future__ import annotations

import json
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Protocol

from memcallbacks._base import distributed as _distributed
from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.findings import Finding
from memcallbacks._base.cpu import own_time
from memcallbacks._base.units import format_bytes
from memcallbacks._runtime import end_write
from memcallbacks._runtime.end_write import run_writer, wait_for_every_rank
from memcallbacks._runtime.checks import StepChecks
from memcallbacks._runtime.finding_sink import FindingSink
from memcallbacks._runtime.guard import safe_str
from memcallbacks._runtime.sampling import MemoryEngine
from memcallbacks._runtime.schedule import DENSE_READ_STEPS, Schedule
from memcallbacks._base.columns import COLUMNS, EVAL_COLUMNS
from memcallbacks._files.journal import start_fields
from memcallbacks._files.outputs import REPORT_VERSION, json_safe, write_outputs
from memcallbacks._files.report_shape import row_peak, shape_report
from memcallbacks._files.verdict import ConsoleVerdict, console_channel, console_lines
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
    failed: bool
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
    def history_frame(self) -> Any: ...
    def summary(self) -> dict[str, Any]: ...
    def fail(self, exc: BaseException, where: str) -> None: ...
    def finish(self, *, gather: bool) -> dict[str, str]: ...
    def stop(self) -> None: ...


class RunEnd:
    """The end of a run, for one session, read through the parts :class:`EndingSession` names."""

    def __init__(self, session: EndingSession) -> None:
        self.session = session
        self.oom: tuple[BaseException, dict[str, Any]] | None = None  # explained when the run's last row is closed
        self.text: str | None = None  # the text report the writer process made at the run's end (format_report())
        self.console = ConsoleVerdict()  # the verdict the console showed at the run's end: said once
        self.end_wall0: float | None = None  # time.time() when the run's end began (finish)
        self.uncaught: weakref.WeakMethod[Any] | None = None  # the adapter's failing path (on_uncaught)
        self.prepare()

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, uncaught=None)  # a weak reference: the adapter gives it again where it runs

    def ends_with(self, handler: Callable[[BaseException], Any]) -> None:
        """``handler(exc)`` (a bound method, held weakly) ends the adapter's run at an exception nobody caught (the
        plain loop's ``__exit__`` path); without one, :meth:`on_uncaught` ends the session itself."""
        self.uncaught = weakref.WeakMethod(handler)

    def on_uncaught(self, exc: BaseException) -> None:
        """``exc`` reached ``sys.excepthook`` (its traceback printed) while the run was open, or a test's body raised it
        (the pytest plugin): the adapter's failing path, or the exception recorded, the files written without a
        collective and everything undone."""
        handler = self.uncaught() if self.uncaught is not None else None
        if handler is not None:
            handler(exc)
            return
        s = self.session
        try:
            self.record_exception(exc, s.current_step)
            s.finish(gather=False)
        finally:
            s.stop()

    def open_journal(self) -> None:
        """The journal's start record (journal.py), where the run writes files: what the run is, on what, under
        which limits. Never fatal."""
        s = self.session
        engine = s.engine
        self.text = None
        folder = s.output_dir
        if folder is None or s.failed:
            return
        try:
            fields = start_fields(framework=s.framework, owner=s.owner, rank=engine.rank, world_size=engine.world_size,
                                  device=dict(engine.device_info), capacity=engine.capacity, config=s.config.to_dict(),
                                  columns=COLUMNS, eval_columns=EVAL_COLUMNS, max_history_rows=s.config.max_history_rows)
            s.schedule.journal.open(folder, fields, rank=engine.rank, world_size=engine.world_size, rows=len(engine.rows),
                                    state=self.journal_state)
            kept = s.sink.kept
            s.schedule.journal.note_findings(kept.findings, kept.version)  # a restored state's findings
        except Exception as exc:
            s.schedule.journal.close()
            s.log.warning("%s: could not start the run's journal in %s (%s); the files are still written at the end.",
                          s.owner, folder, exc)

    def journal_state(self) -> tuple[list[list[Any]], list[list[Any]], int]:
        """What a compacted journal holds besides its findings and events: the rows, evaluation rows and the step."""
        s = self.session
        return s.engine.rows, s.engine.eval_rows, s.current_step

    def format_report(self) -> str:
        """The report as text: after the run's end, the writer process's (nothing imported here); else made now."""
        if self.text is not None:
            return self.text
        from memcallbacks._files.report import format_report

        s = self.session
        return format_report(self.report(), s.history_frame())

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
        s.schedule.journal.event(event)  # synced: a run killed while it unwinds keeps it
        if not oom:
            return
        if s.snap is not None:
            s.snap.on_exception(exc, step)
        self.oom = (exc, event)

    @staticmethod
    def prepare() -> None:
        """Import what explaining an OOM runs (the pre-flight's fake steps, the explanation's record) now, when the
        monitor is built: at the OOM itself an import may find no memory left (a module is tens of KiB to map). Cached
        after the first monitor of the process (about 30 ms, measured on the 2-core test machine)."""
        import memcallbacks.oom.record  # noqa: F401
        import memcallbacks.preflight  # noqa: F401  # predict, max_batch_size and the fake step's modules
        import torch.utils.checkpoint  # noqa: F401  # the checkpointing remedy's replay

    def _explain_oom(self, exc: BaseException, event: dict[str, Any]) -> None:
        """The OOM explained (memcallbacks/oom): logged, ``oom.json``, and an ``"oom"`` finding for the report and trackers."""
        from memcallbacks._runtime.preflight_check import fake_steps  # imported with the session (checks.py)
        from memcallbacks.oom.record import record_oom  # imported by prepare()

        s, checks = self.session, self.session.checks
        held = checks.watch.attribution if checks.watch is not None and checks.watch.attribution.model is not None else checks.state  # model, optimizer
        peaks = s.engine.max_allocated, s.engine.max_reserved  # the explanation's own memory is not the run's
        read = s.schedule.last_read  # the watch reads steps the history does not sample: the floor up to the failure
        read_now = (s.current_step - (s.current_count - read[0]), read[1]) if read is not None and read[0] <= s.current_count else None
        with fake_steps():  # the remedies' fake optimizer steps are not this run's
            finding = record_oom(exc, event, engine=s.engine, model=held.model, optimizer=held.optimizer, precision=checks.state.precision,
                                 findings=s.findings, capacity=s.config.capacity_bytes,
                                 output_dir=s.output_dir if s.config.write_files else None,
                                 snapshots=s.snap.records if s.snap is not None else [], log=s.log, owner=s.owner, read_now=read_now)
        s.engine.max_allocated, s.engine.max_reserved = peaks
        if event.get("oom_file"):  # listed with the run's other files (report.json's "files", the text report)
            s.files["oom"] = event["oom_file"]
        if finding is not None:
            s.add_finding(finding)
        else:
            s.log.error("%s: out of memory at step %d on rank %d; writing the memory report before the error propagates.",
                        s.owner, event["step"], s.engine.rank)

    def report(self) -> dict[str, Any]:
        """What ``report.json`` holds: version, config, summary, findings, events and files."""
        from memcallbacks._base.version import __version__

        s = self.session
        summary = dict(s.summary(), cadence=s.schedule.summary(), rank_figures=self.rank_figures())
        peak = row_peak(s.engine.rows)  # the run's peak from the rows themselves: no history frame (pandas) needed
        if peak is not None:
            summary["peak"] = peak
        journal = s.schedule.journal
        return shape_report({
            "version": REPORT_VERSION,
            "memcallbacks_version": __version__,
            "framework": s.framework,
            "config": s.config.to_dict(),
            "summary": summary,
            "findings": s.sink.to_list(),
            "events": list(s.events),
            **s.checks.report(),  # model_states, preflight, gc, host
            "snapshots": list(s.snap.records) if s.snap is not None else [],
            "files": dict(s.files),
            "run": {"id": journal.run_id or None, "started_at": journal.start.get("time"), "ended_at": round(time.time(), 3)},
        }, s.output_dir)

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
        s.schedule.end_started()  # the end's own time is a part of its own (report.json has it up to the report)
        self.end_wall0 = time.time()  # ...and the wall time it takes, a writer process's included (report.json's end_wall_s)
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
            s.schedule.end_finished(done=True)
        if gather:  # no rank's fit() returns while another rank's files are still being written
            wait_for_every_rank(s.engine.world_size, s.owner)
        return files

    def _finish(self, gather: bool) -> dict[str, str]:
        s = self.session
        engine = s.engine
        try:
            self._close_open_step()
            if self.oom is not None:  # after the last row: the explanation's own memory is no step's
                oom, self.oom = self.oom, None
                self._explain_oom(*oom)
            self._finish_watch()
            if s.snap is not None:
                s.snap.stop()  # writes a capture cut short by the end of training
            kept = s.sink.kept
            s.schedule.journal.note_findings(kept.findings, kept.version)  # the last findings (an OOM's explanation) first, synced
            report = self.report()
            distributed = engine.world_size > 1 and _distributed.is_distributed()
            # one collective: every rank's summary, its findings rank zero has not heard of, and its snapshot files for rank zero's trackers
            payload = snapshot_payload(report["snapshots"], engine.rank) if s.config.log_to_trackers and engine.rank > 0 else None
            news = s.sink.news_for_rank_zero(engine.rank) if gather and distributed else []
            gathered = _distributed.gather_objects((report["summary"], payload, news), engine.device) if gather and distributed else None
            summaries = [g[0] for g in gathered] if gathered is not None else None
            if summaries is not None and engine.rank == 0:  # one rank's host or device memory standing apart
                s.sink.receive_from_ranks(engine.rank, [g[2] for g in gathered], s.current_step)  # type: ignore[union-attr]
                self._rank_imbalance(summaries)
                report["findings"] = s.sink.to_list()
            if not (s.config.write_files and s.output_dir is not None):
                self._to_trackers(report, gathered)
                self._announce(report)
                return {}
            if self.recorded_nothing():
                s.schedule.journal.remove()
                s.log.warning("%s: this run recorded no training step and no evaluation loop; the files in %s are left "
                              "as they were.", s.owner, s.output_dir)
                return s.files
            s.files, written = self._write(report, summaries)
            if summaries is not None and engine.rank == 0:
                report = dict(report, files=s.files, ranks=summaries)
            self._to_trackers(report, gathered, written)
            self._announce(dict(report, files=s.files), written)
        except OSError as exc:  # a full disk, a folder removed: the previous set stays whole
            s.log.error("%s: could not write the memory files to %s (%s); the files there are left as they were.%s",
                        s.owner, s.output_dir, exc.strerror or exc, self._journal_note())
        except Exception as exc:  # MemoryError, an ImportError at an OOM (no memory left to map a module), ...
            self._write_failed(exc)
        return s.files

    def _close_open_step(self) -> None:
        """The step open when the run ends: its row closed, and into the journal when it is kept."""
        engine = self.session.engine
        if engine.in_step and engine.enabled:
            row = engine.end_step()
            if row is not None and engine.kept is row:
                self.session.schedule.journal.row(row)

    def _journal_note(self) -> str:
        """Where the run's record is when its files could not be written: its journal, if it is there."""
        path = self.session.schedule.journal.path
        if path is None or not path.exists():
            return ""
        return f" The run's journal {path.name} keeps its record: memcallbacks report {path.parent}"

    def _write_failed(self, exc: Exception) -> None:
        """The files could not be written (an import or an allocation failing at an OOM, say): said plainly, at the
        run's end. The traceback goes to the debug log: logged at error level it would print the user's error again,
        as this one's context."""
        s = self.session
        if s.config.strict and not s.events:
            raise exc
        s.failed = True
        left = address_space_left()
        room = f"; {format_bytes(left)} of address space is left under the process's limit (RLIMIT_AS)" if left is not None else ""
        oom = next((e.get("oom_file") for e in s.events if e.get("oom_file")), None)
        kept = f"; {oom} holds the out-of-memory explanation" if oom else ""
        ending = "; the run's own error propagates unchanged" if s.events else ""
        s.log.error("%s: could not write the memory files to %s (%s: %s)%s%s%s.%s", s.owner, s.output_dir, type(exc).__name__,
                    safe_str(exc, 300), room, kept, ending, self._journal_note())
        s.log.debug("%s: the memory files' write failed", s.owner, exc_info=exc)

    def _write(self, report: dict[str, Any], summaries: list[Any] | None) -> tuple[dict[str, str], dict[str, Any] | None]:
        """This rank's files as one set, built by the writer process from the journal (end_write.py), or here
        when it cannot: ``(files, the writer's result or None)``."""
        s = self.session
        engine = s.engine
        title = self._title(report)
        ranks = summaries if summaries is not None and engine.rank == 0 else None
        path = s.schedule.journal.end(self.payload(report, ranks, title), step=s.current_step) if end_write.WRITER else None
        result = run_writer(path, owner=s.owner) if path is not None else None
        if result is not None:
            self.text = result.get("text")
            return result["files"], result
        files = write_outputs(s.output_dir, rank=engine.rank, world_size=engine.world_size, history=s.history_frame(),  # type: ignore[arg-type]
                              eval_history=engine.eval_frame(), report=report, plot=s.config.plot and self._room_to_draw(),
                              title=title, ranks=ranks, end_started=self.end_wall0)
        s.schedule.journal.remove()
        return files, None

    def _title(self, report: dict[str, Any]) -> str:
        s = self.session
        title = s.title or f"{s.framework} on {report['summary'].get('device', {}).get('device', '?')}"
        return title + (f", rank {s.engine.rank}" if s.engine.world_size > 1 else "")

    def payload(self, report: dict[str, Any], ranks: list[Any] | None, title: str) -> dict[str, Any]:
        """The ``end`` record's plain data: what the writer process builds the file set from (writer_process.py).
        The history rows go only where the journal's row records do not replay into them exactly."""
        s = self.session
        engine = s.engine
        rows = engine.rows
        steps = [row[0] for row in rows]
        return {
            "folder": str(s.output_dir), "cwd": os.getcwd(), "rank": engine.rank, "world_size": engine.world_size,
            "report": json_safe(report), "ranks": json_safe(ranks) if ranks is not None else None,
            "plot": bool(s.config.plot), "title": title, "device_kind": engine.device_info.get("kind", "cpu"),
            "max_history_rows": s.config.max_history_rows, "rows": None if s.schedule.journal.rows_exact else rows,
            "rows_check": [len(rows), steps[0] if steps else None, steps[-1] if steps else None, sum(steps)],
            "eval_rows": engine.eval_rows, "predicted": s.checks.preflight.column_spec(),
            "console": engine.rank == 0 and bool(getattr(s.config, "console_summary", True)),
            "end_started": self.end_wall0,
        }

    def abandon(self) -> Path | None:
        """A plain monitor dropped without ``close()``: its journal ends (``clean`` false) with the run's plain data
        so far, for the writer process to build the file set from at the interpreter's exit. Imports nothing, never
        raises; returns the journal's path (None when there is none to leave)."""
        s = self.session
        if s.schedule.journal.fd < 0:
            return None
        try:
            if self.recorded_nothing():
                s.schedule.journal.remove()
                return None
            self._close_open_step()
            report = self.report()
            report["run"]["ended"] = "dropped without close()"
            return s.schedule.journal.end(self.payload(report, None, self._title(report)), step=s.current_step, clean=False)
        except Exception:
            s.log.debug("could not end the journal of a dropped monitor", exc_info=True)
            s.schedule.journal.close()
            return None

    def _room_to_draw(self) -> bool:
        """Whether the process has the address space to draw ``memory.png`` (said in the log when not)."""
        left = address_space_left()
        if left is None or left >= PLOT_ROOM_BYTES:
            return True
        s = self.session
        s.log.warning("%s: memory.png is not drawn: %s of address space is left under the process's limit (RLIMIT_AS), and "
                      "drawing needs about %s. The other files are written.", s.owner, format_bytes(left), format_bytes(PLOT_ROOM_BYTES))
        return False

    def _announce(self, report: dict[str, Any], written: dict[str, Any] | None = None) -> None:
        """Rank zero: the verdict and the files' folder on the console, through the adapter's channel (the writer's
        lines where it made them; else made here, from the report alone: no history frame)."""
        s = self.session
        if s.engine.rank != 0 or not getattr(s.config, "console_summary", True):
            return
        try:
            show = console_channel(s.framework)
            lines = written.get("console") if written is not None else None
            for line in self.console.to_show(lines if lines is not None else console_lines(report)):  # said once (a fit, then test())
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

    def _to_trackers(self, report: dict[str, Any], gathered: list[Any] | None, written: dict[str, Any] | None = None) -> None:
        """Rank zero, after the files are written: the report (as written: read back), plot and every rank's snapshots
        to the trackers, with the text report (the writer's where it made it)."""
        s = self.session
        if s.trackers is None or not s.config.log_to_trackers or s.engine.rank != 0:
            return
        snapshots = [dict(r, rank=0) for r in report.get("snapshots", [])]
        snapshots += receive_snapshots([g[1] for g in gathered or []], s.output_dir)
        path = s.files.get("combined_report") or s.files.get("report")
        try:
            with open(path) as fh:  # type: ignore[arg-type]
                report = json.load(fh)
        except (TypeError, OSError, ValueError):  # no file (write_files=False, a writer still at work): the report as made
            pass
        text = written.get("text") if written is not None else None
        outputs = RunOutputs(s.config.prefix, report, dict(s.files), snapshots, list(s.findings), text if text is not None else self.format_report())
        s.trackers.finish(outputs, s.dashboard)
