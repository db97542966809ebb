"""The experiment trackers a run already has (TensorBoard, W&B, MLflow): found among the framework's
loggers, and given a memory dashboard, the findings, the report, the plot and the snapshots.

Adapters hand :class:`Trackers` a function that lists the user's own logger objects (Lightning's
``trainer.loggers``, Accelerate's ``accelerator.trackers``, the Transformers Trainer's
callbacks); objects are recognised by class name, so nothing here imports tensorboard, wandb or
mlflow until the user's own tracker exists. Nothing creates a tracker or logs in. A tracker that
fails is warned about once, with the traceback, and left alone for the rest of the run.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Iterable

from memcallbacks._base.findings import Finding
from memcallbacks.trackers._base import Dashboard, RunOutputs, Tracker

log = logging.getLogger(__name__)

__all__ = ["Trackers", "Dashboard", "RunOutputs", "Tracker", "recognise"]


def _tb() -> Any:
    from memcallbacks.trackers.tensorboard import TensorBoardTracker

    return TensorBoardTracker


def _wandb() -> Any:
    from memcallbacks.trackers.wandb import WandbTracker

    return WandbTracker


def _mlflow() -> Any:
    from memcallbacks.trackers.mlflow import MlflowTracker

    return MlflowTracker


def recognise(obj: Any) -> Tracker | None:
    """The tracker behind one of the user's logger objects, or None for anything else. Each tracker
    module is imported only for an object it drives (a run with a CSV logger imports none: ~4 ms
    that fell on the first logged step)."""
    names = set(map(operator.attrgetter("__name__"), type(obj).__mro__))  # its class's and every base's
    source = type(obj).__name__
    # Lightning (lightning.pytorch and pytorch_lightning): the experiment of a logger exists on rank zero
    if "TensorBoardLogger" in names:
        return _tb()(lambda: obj.experiment, source=source, separator=getattr(obj, "group_separator", "/"))
    if "WandbLogger" in names:
        return _wandb()(lambda: obj.experiment, step_metric="trainer/global_step", source=source,
                        separator=getattr(obj, "group_separator", "/"))
    if "MLFlowLogger" in names:
        return _mlflow()(lambda: (obj.experiment, obj.run_id), source=source)
    # Accelerate: accelerator.trackers, after accelerator.init_trackers(...)
    if "TensorBoardTracker" in names and hasattr(obj, "writer"):
        return _tb()(lambda: obj.writer, source=source)
    if "WandBTracker" in names:
        return _wandb()(lambda: obj.run, source=source)  # accelerator.log(step=...) sets W&B's own step
    if "MLflowTracker" in names:
        mlflow = _mlflow()
        return mlflow(lambda: mlflow.fluent(obj.active_run), source=source)
    # Transformers: report_to callbacks; the Trainer prefixes training keys with "train/"
    if "TensorBoardCallback" in names:
        return _tb()(lambda: obj.tb_writer, key_prefix="train/", source=source)
    if "WandbCallback" in names:
        return _wandb()(lambda: obj._wandb.run if obj._initialized else None, key_prefix="train/", step_metric="train/global_step", source=source)
    if "MLflowCallback" in names:
        mlflow = _mlflow()
        return mlflow(lambda: mlflow.fluent(obj._ml_flow.active_run()) if obj._initialized else None, source=source)
    return None



def shown_key(finding: Finding) -> str:
    """A finding is shown again when its state changes (a growth settled or re-opened)."""
    return f"{finding.key}|{finding.label}|{finding.details.get('reopened', 0)}"


class Trackers:
    """Every recognised tracker of one run (rank zero), driven by :class:`~memcallbacks._runtime.session.Session`."""

    def __init__(self, source: Callable[[], Iterable[Any]], *, owner: str = "memcallbacks", logger: logging.Logger | None = None) -> None:
        self.source = source
        self.looked: list[Any] | None = None
        """The logger objects at the last look (None: not looked yet)."""
        self.waiting = False
        """A tracker is not set up yet, or has findings it did not show yet: the next on_log has work."""
        self.told = -1
        """The findings' version (``FindingLog.version``) the last :meth:`on_log` was given (-1: none)."""
        self._seen: set[int] = set()
        self._trackers: list[Tracker] = []
        self._failed: set[int] = set()
        self.owner = owner
        self.log = logger or log

    @property
    def trackers(self) -> list[Tracker]:
        self._refresh()
        return list(self._trackers)

    def _refresh(self) -> None:
        """Pick up trackers created since the last look (``init_trackers`` after the monitor)."""
        try:
            objects = list(self.source() or [])
        except Exception:
            self.log.debug("%s: could not list the run's loggers", self.owner, exc_info=True)
            return
        self.looked = objects
        for obj in objects:
            if id(obj) in self._seen:
                continue
            self._seen.add(id(obj))
            tracker = recognise(obj)
            if tracker is not None:
                self._trackers.append(tracker)

    def _call(self, tracker: Tracker, what: str, fn: Callable[[], Any]) -> Any:
        if id(tracker) in self._failed:
            return None
        try:
            return fn()
        except Exception as exc:
            self._failed.add(id(tracker))
            self.log.warning(
                "%s: could not %s through the %s (%s: %s); training goes on, and this tracker gets nothing more "
                "from the monitor. The files in output_dir are unaffected.",
                self.owner, what, tracker.source or tracker.name, type(exc).__name__, exc, exc_info=True,
            )
            return None

    def look(self, version: int) -> None:
        """At the run's start: pick up the trackers there are. A run with none then asks at each logged step
        only whether there is news (a logger added); one with trackers sets them up at its first logged step."""
        self._refresh()  # never raises: a source that fails is said at debug level
        self.told = version
        self.waiting = self.waiting or any(not t.started for t in self._trackers)

    def has_news(self, version: int) -> bool:
        """Whether a logged step has work for :meth:`on_log`: a logger was added, the findings changed
        since they were told (``version``, ``FindingLog.version``), or a tracker is still to set up or to
        show findings."""
        try:
            return self.waiting or version != self.told or self.looked != list(self.source() or [])
        except Exception:
            return True  # on_log's own look says why, at debug level

    def on_log(self, findings: list[Finding], dashboard: Dashboard, *, version: int = -1) -> None:
        """On a logged step: set up dashboards not set up yet, and show findings not shown yet.
        ``version``: the findings' (``FindingLog.version``), kept in :attr:`told`."""
        self._refresh()
        self.told = version
        waiting = False
        for tracker in self._trackers:
            if not tracker.started:
                tracker.started = bool(self._call(tracker, "set up the memory dashboard", lambda t=tracker: t.start(dashboard)))
            new = [f for f in findings if shown_key(f) not in tracker.shown]
            if new and tracker.started:
                if self._call(tracker, "show the memory findings", lambda t=tracker, n=new: t.findings(n, dashboard)):
                    tracker.shown.update(shown_key(f) for f in new)
                    new = []
            waiting = waiting or not tracker.started or bool(new)
        self.waiting = waiting

    def finish(self, outputs: RunOutputs, dashboard: Dashboard) -> None:
        """At the end of the run: dashboards and findings not shown yet, then the files."""
        self.on_log(outputs.findings, dashboard)
        for tracker in self._trackers:
            if tracker.started:
                self._call(tracker, "attach the memory report and snapshots", lambda t=tracker: t.finish(outputs))
