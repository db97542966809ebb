"""Weights & Biases: memory keys on the optimizer-step axis; at the end plot, report, snapshots."""

from __future__ import annotations

import logging
import re
from typing import Any

from memcallbacks._base.findings import Finding
from memcallbacks.trackers._base import Dashboard, RunOutputs, Tracker, finding_text, flat_summary, joined_keys

log = logging.getLogger(__name__)

__all__ = ["WandbTracker", "HTML_LIMIT_BYTES"]

HTML_LIMIT_BYTES = 4 * 2**20
"""A snapshot page up to this size is logged as ``wandb.Html``; every snapshot file also goes into the run's artifact."""


def _artifact_name(prefix: str, run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{prefix}-memcallbacks-{run_id}")


class WandbTracker(Tracker):
    """A ``wandb`` Run the user started (WandbLogger, Accelerate's tracker, the Trainer's WandbCallback)."""

    name = "W&B run"

    def handle(self) -> Any:
        run = self.resolve()
        # Lightning's DummyExperiment has no define_metric; a finished run refuses further calls
        return run if run is not None and hasattr(run, "define_metric") and hasattr(run, "summary") else None

    def start(self, dashboard: Dashboard) -> bool:
        run = self.handle()
        if run is None:
            return False
        keys = f"{self.key_prefix}{dashboard.prefix}/*".replace("/", self.separator)
        if self.step_metric:
            run.define_metric(self.step_metric)
            run.define_metric(keys, step_metric=self.step_metric, step_sync=True, summary="max")
        else:  # Accelerate logs with step=: W&B's own step already is the optimizer step
            run.define_metric(keys, summary="max")
        return True

    def findings(self, findings: list[Finding], dashboard: Dashboard) -> bool:
        run = self.handle()
        if run is None:
            return False
        run.summary.update({f"{dashboard.prefix}/finding/{f.key}": finding_text(f) for f in findings})
        return True

    def finish(self, outputs: RunOutputs) -> None:
        import wandb

        run = self.handle()
        if run is None:
            return
        p = outputs.prefix
        summary = flat_summary(outputs.report.get("summary", {}), p)
        summary[f"{p}/report/findings"] = len(outputs.findings)
        summary.update({f"{p}/finding/{f.key}": finding_text(f) for f in outputs.findings})
        for key, cause in joined_keys(outputs.findings, self.shown).items():  # shown live, now one cause with another
            summary[f"{p}/finding/{key}"] = f"one cause with {cause}: see {p}/finding/{cause}"
        run.summary.update(summary)
        media: dict[str, Any] = {}
        if "plot" in outputs.files:
            media[f"{p}/plot"] = wandb.Image(outputs.files["plot"], caption="memory.png: per-phase peaks over optimizer steps")
        if outputs.findings:
            rows = [[f.kind, int(f.first_step or f.step), int(f.step), f.bytes, f.message] for f in outputs.findings]
            media[f"{p}/findings_table"] = wandb.Table(columns=["kind", "first_step", "step", "bytes", "message"], data=rows)
        for rank, kind, path in outputs.snapshot_files():
            if kind == "html" and path.stat().st_size <= HTML_LIMIT_BYTES:
                media[f"{p}/snapshot_pages/{path.stem.replace('.', '_')}"] = wandb.Html(str(path), inject=False)
        if media:
            run.log(media)
        files = outputs.run_files() + [path for _, _, path in outputs.snapshot_files()]
        if files:
            artifact = wandb.Artifact(_artifact_name(p, str(run.id)), type="memcallbacks", description="memcallbacks report, history, plot and snapshots")
            for path in files:
                folder = "snapshots" if path.parent.name == "snapshots" else ""
                artifact.add_file(str(path), name=f"{folder}/{path.name}" if folder else path.name)
            run.log_artifact(artifact)
