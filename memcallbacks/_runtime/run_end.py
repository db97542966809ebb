"""How a session ends: exceptions recorded as events, the report, and the run's files and trackers.

A mixin of :class:`~memcallbacks._runtime.session.Session` (kept apart so each file holds one concern):
every method here runs at the end of a run or while an exception unwinds, and never raises.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from memcallbacks._base import distributed as _distributed
from memcallbacks._runtime.end_write import DETACH_WRITER, wait_for_every_rank, write_detached
from memcallbacks._runtime.guard import safe_str
from memcallbacks._files.outputs import REPORT_VERSION, write_outputs
from memcallbacks._runtime.cadence import DENSE_READ_STEPS
from memcallbacks.host.ranks import find_imbalance
from memcallbacks.trackers import RunOutputs
from memcallbacks.trackers.ranks import receive_snapshots, snapshot_payload

__all__ = ["RunEnd", "is_oom"]


def is_oom(exc: BaseException) -> bool:
    """True for torch's OutOfMemoryError, host MemoryError, and RuntimeErrors that say "out of memory"."""
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in safe_str(exc).lower()


class RunEnd:
    """The end of a run, for :class:`Session` (which provides every attribute used here)."""

    def record_exception(self, exc: BaseException, step: int) -> None:
        """Note an exception that is ending the run as an event (``"oom"`` or ``"exception"``); never raises."""
        try:
            self._record_exception(exc, step)
        except Exception as internal:
            self.log.error("%s: could not record the run's exception (internal error); the run's own exception propagates.",
                           self.owner, exc_info=internal)

    def _record_exception(self, exc: BaseException, step: int) -> None:
        engine = self.engine
        oom = is_oom(exc)
        event = {
            "kind": "oom" if oom else "exception",
            "step": int(step),
            "rank": engine.rank,
            "error": f"{type(exc).__name__}: {safe_str(exc)}",
            "max_allocated_bytes": engine.max_allocated,
            "max_reserved_bytes": engine.max_reserved,
        }
        if any(e.get("error") == event["error"] and e.get("step") == event["step"] for e in self.events):
            return  # the same exception seen by two hooks (a step context, then close)
        self.events.append(event)
        if not oom:
            return
        if self.snap is not None:
            self.snap.on_exception(exc, step)
        self.log.error(
            "%s: out of memory at step %d on rank %d; writing the memory report before the error propagates.",
            self.owner,
            event["step"],
            engine.rank,
        )

    def report(self) -> dict[str, Any]:
        """What ``report.json`` holds: version, config, summary, findings, events and files."""
        from memcallbacks._base.version import __version__

        return {
            "version": REPORT_VERSION,
            "memcallbacks_version": __version__,
            "framework": self.framework,
            "config": self.config.to_dict(),
            "summary": dict(self.engine.summary(), cadence=self.cadence.summary(), rank_figures=self.rank_figures()),
            "findings": self.sink.to_list(),
            "events": list(self.events),
            "model_states": dict(self.state.info),
            "preflight": self.preflight.report(),
            "gc": list(self.watch.gc_results) if self.watch is not None else [],
            "host": self.host.summary() if self.host is not None else None,
            "snapshots": list(self.snap.records) if self.snap is not None else [],
            "files": dict(self.files),
        }

    def recorded_nothing(self) -> bool:
        """No training step, no evaluation loop and no event since the last reset."""
        return self.engine.seen_steps == 0 and not self.engine.eval_rows and not self.events

    def _finish_watch(self) -> None:
        """Work the leak watch still owes when the run ends (a growth finding's second census)."""
        if self.watch is None or not self.engine.enabled:
            return
        t0 = time.perf_counter()
        try:
            for finding in self.watch.finish():
                self.add_finding(finding)
        except Exception:
            self.log.debug("the leak watch's last census failed", exc_info=True)
        if self.host is not None:
            for finding in self.host.finish():  # a host growth still waiting for its second census
                self.add_finding(finding)
        self.cadence.charge_other(time.perf_counter() - t0, "findings")

    def finish(self, *, gather: bool) -> dict[str, str]:
        """Close any open step and write this rank's files. ``gather`` (a collective: every rank must
        call it) also puts every rank's summary into rank zero's ``report.json``.

        A run that recorded nothing (a second ``fit`` that had no step left to run) writes no
        files: the folder keeps the previous run's set rather than an empty history."""
        # the files' imports (pandas, matplotlib) run dozens of collections: the gc watch, which
        # reads the heap around each one it measures, is for training, and training is over
        if self._observers:
            self._notify("run_finishing")
        collections = self.watch.collections if self.watch is not None else None
        if collections is not None:
            was_own, collections.own = collections.own, True
        try:
            files = self._finish(gather)
        finally:
            if collections is not None:
                collections.own = was_own
        if gather:  # no rank's fit() returns while another rank's files are still being written
            wait_for_every_rank(self.engine.world_size, self.owner)
        return files

    def _finish(self, gather: bool) -> dict[str, str]:
        engine = self.engine
        try:
            if engine.in_step and engine.enabled:
                engine.end_step()
            self.step_open = False
            self._finish_watch()
            if self.snap is not None:
                self.snap.stop()  # writes a capture cut short by the end of training
            report = self.report()
            distributed = engine.world_size > 1 and _distributed.is_distributed()
            # one collective: every rank's summary, and its snapshot files for rank zero's trackers
            payload = snapshot_payload(report["snapshots"], engine.rank) if self.config.log_to_trackers and engine.rank > 0 else None
            gathered = _distributed.gather_objects((report["summary"], payload), engine.device) if gather and distributed else None
            summaries = [g[0] for g in gathered] if gathered is not None else None
            if summaries is not None and engine.rank == 0:  # one rank's host or device memory standing apart
                self._rank_imbalance(summaries)
                report["findings"] = self.sink.to_list()
            if not (self.config.write_files and self.output_dir is not None):
                self._to_trackers(report, gathered)
                return {}
            if self.recorded_nothing():
                self.log.warning("%s: this run recorded no training step and no evaluation loop; the files in %s are left "
                                 "as they were.", self.owner, self.output_dir)
                return self.files
            title = self.title or f"{self.framework} on {report['summary'].get('device', {}).get('device', '?')}"
            if engine.world_size > 1:
                title += f", rank {engine.rank}"
            self.files = write_detached(  # by a writer process of its own under distributed: see end_write.py
                write_outputs,
                self.output_dir,
                rank=engine.rank,
                world_size=engine.world_size,
                history=self.history_frame(),
                eval_history=engine.eval_frame(),
                report=report,
                plot=self.config.plot,
                title=title,
                ranks=summaries if summaries is not None and engine.rank == 0 else None,
                detach=distributed and DETACH_WRITER,
                owner=self.owner,
            )
            if summaries is not None and engine.rank == 0:
                report = dict(report, files=self.files, ranks=summaries)
            self._to_trackers(report, gathered)
        except OSError as exc:  # a full disk, a folder removed: the previous set stays whole
            self.log.error("%s: could not write the memory files to %s (%s); the files there are left as they were.",
                           self.owner, self.output_dir, exc.strerror or exc)
        except Exception as exc:
            engine.fail(exc, "writing outputs")
        return self.files

    def rank_figures(self) -> dict[str, float]:
        """This rank's figures for the per-rank comparison (host: docs/host.md; device: the run's peak)."""
        figures: dict[str, float] = {}
        if self.device_kind != "cpu":  # on CPU the device is the host: one figure, one finding
            figures["device_peak_allocated_bytes"] = float(self.engine.max_allocated)
        if self.host is not None:
            figures.update(self.host.growth.figures())
            figures.update(self.host.workers.figures())
        return figures

    def _rank_imbalance(self, summaries: list[Any]) -> None:
        if self.engine.seen_steps < DENSE_READ_STEPS:
            return  # a short run's figures are its warm-up (imports, loggers, rank zero's first files), not a rank apart
        try:
            figures = [s.get("rank_figures") if isinstance(s, dict) else None for s in summaries]
            for finding in find_imbalance(figures, step=self.current_step):
                self.add_finding(finding)
        except Exception:
            self.log.debug("the per-rank comparison failed", exc_info=True)

    def _to_trackers(self, report: dict[str, Any], gathered: list[Any] | None) -> None:
        """Rank zero, after the files are written: the report, plot and every rank's snapshots to the trackers."""
        if self.trackers is None or not self.config.log_to_trackers or self.engine.rank != 0:
            return
        snapshots = [dict(r, rank=0) for r in report.get("snapshots", [])]
        snapshots += receive_snapshots([g[1] for g in gathered or []], self.output_dir)
        outputs = RunOutputs(
            self.config.prefix, report, dict(self.files), snapshots, list(self.findings), self.format_report()
        )
        self.trackers.finish(outputs, self.dashboard)
