"""MLflow: the report, history, plot and snapshots as artifacts of the active run, findings as tags."""

from __future__ import annotations

import logging
import re
from typing import Any

from memcallbacks._base.findings import Finding
from memcallbacks.trackers._base import Dashboard, RunOutputs, Tracker, finding_text, joined_keys

log = logging.getLogger(__name__)

__all__ = ["MlflowTracker", "TAG_VALUE_LIMIT"]

TAG_VALUE_LIMIT = 5000  # MLflow stores tag values up to 5000 characters in every backend since 1.x


def _tag(prefix: str, finding: Finding | str) -> str:
    key = finding if isinstance(finding, str) else finding.key
    return f"{prefix}/finding/" + re.sub(r"[^\w.\- /:]", "_", key)  # MLflow's tag-name alphabet


class MlflowTracker(Tracker):
    """An MLflow run the user started; the handle is ``(MlflowClient, run_id)``."""

    name = "MLflow run"

    @staticmethod
    def fluent(run: Any) -> tuple[Any, str] | None:
        """``(client, run_id)`` for a run started through ``mlflow.start_run`` (the tracking URI it uses)."""
        if run is None:
            return None
        from mlflow.tracking import MlflowClient

        return MlflowClient(), run.info.run_id

    def handle(self) -> tuple[Any, str] | None:
        found = self.resolve()
        if not found or not isinstance(found, tuple) or found[1] is None or not hasattr(found[0], "log_artifact"):
            return None  # Lightning's DummyExperiment on other ranks, or no active run
        return found

    def start(self, dashboard: Dashboard) -> bool:
        return self.handle() is not None

    def findings(self, findings: list[Finding], dashboard: Dashboard) -> bool:
        handle = self.handle()
        if handle is None:
            return False
        client, run_id = handle
        for finding in findings:
            client.set_tag(run_id, _tag(dashboard.prefix, finding), finding_text(finding, TAG_VALUE_LIMIT))
        return True

    def finish(self, outputs: RunOutputs) -> None:
        handle = self.handle()
        if handle is None:
            return
        client, run_id = handle
        p = outputs.prefix
        for finding in outputs.findings:  # the final state of each (a growth finding keeps growing)
            client.set_tag(run_id, _tag(p, finding), finding_text(finding, TAG_VALUE_LIMIT))
        for key in joined_keys(outputs.findings, self.shown):  # shown live, now one cause with another: one tag per cause
            client.delete_tag(run_id, _tag(p, key))
        client.set_tag(run_id, f"{p}/findings", str(len(outputs.findings)))
        for path in outputs.run_files():
            client.log_artifact(run_id, str(path), artifact_path="memcallbacks")
        for _rank, _kind, path in outputs.snapshot_files():
            client.log_artifact(run_id, str(path), artifact_path="memcallbacks/snapshots")
