"""What every tracker is handed: the dashboard while training, the run's outputs at the end."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from memcallbacks._base.findings import Finding, evidence_lines, step_text

__all__ = ["Dashboard", "RunOutputs", "Tracker", "finding_text", "flat_summary", "joined_keys"]


@dataclass(frozen=True)
class Dashboard:
    """What the charts show: the monitor's key prefix, whether a capacity line is logged, and the
    keys handed to loggers (``log_keys``; None: every key)."""

    prefix: str
    capacity: bool = False
    keys: frozenset[str] | None = None

    def logs(self, name: str) -> bool:
        """Whether key ``name`` (without the prefix) reaches the loggers."""
        return self.keys is None or f"{self.prefix}/{name}" in self.keys


@dataclass
class RunOutputs:
    """The end of a run: the files written on this (rank-zero) process and every rank's snapshots."""

    prefix: str
    report: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    """One entry per snapshot: ``rank``, ``trigger``, ``step``, ``files`` (kind -> local path)."""
    findings: list[Finding] = field(default_factory=list)
    report_text: str = ""

    def snapshot_files(self) -> list[tuple[int, str, Path]]:
        """``(rank, kind, path)`` of every snapshot file present on this machine."""
        out = []
        for record in self.snapshots:
            for kind, path in (record.get("files") or {}).items():
                if Path(path).is_file():
                    out.append((int(record.get("rank", 0)), kind, Path(path)))
        return out

    def run_files(self) -> list[Path]:
        """report, history, eval history and plot, as written (the ones present); under
        torch.distributed also rank zero's ``report.json`` with every rank's summary."""
        kinds = ("combined_report", "report", "history", "eval_history", "plot")
        return [Path(self.files[k]) for k in kinds if k in self.files and Path(self.files[k]).is_file()]


def finding_text(finding: Finding, limit: int = 4000) -> str:
    """``[kind] step N: message`` (``[growth, settled]``, ``[lingering, advice]``) plus the holders, cut to ``limit`` characters."""
    text = f"[{finding.label}] {step_text(finding.to_steps())}: {finding.message}"
    if finding.holders:
        text += "\n" + "\n".join(f"held by: {h}" for h in finding.holders[:5])
    seen = evidence_lines(finding.to_dict())  # one cause that several detectors saw
    if seen:
        text += "\n" + "\n".join(seen)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def joined_keys(findings: list[Finding], shown: set[str]) -> dict[str, str]:
    """``{key: cause_key}`` for the findings a tracker showed (``shown``, by ``shown_key``) that are now part of
    another finding (one cause, several detectors: its evidence names them), so that the tracker says so where it
    showed them instead of counting them as another problem."""
    current = {f.key for f in findings}
    causes = {e.get("key"): f.key for f in findings for e in f.evidence if e.get("key") != f.key}
    return {k: causes[k] for k in {s.split("|", 1)[0] for s in shown} - current if k in causes}


def flat_summary(summary: dict[str, Any], prefix: str) -> dict[str, float | int | str]:
    """The report's summary as flat ``prefix/report/<name>`` scalars (nested dicts joined with '/')."""
    out: dict[str, float | int | str] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}/{k}")
        elif isinstance(value, bool):
            out[key] = int(value)
        elif isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
            out[key] = value
        elif isinstance(value, str):
            out[key] = value

    walk(summary, f"{prefix}/report")
    return out


class Tracker:
    """One tracker the run already has. ``resolve`` returns its live handle (a SummaryWriter, a
    wandb Run, ...) or None while the framework has not created it yet; nothing here creates one."""

    name = "tracker"

    def __init__(self, resolve: Callable[[], Any], *, key_prefix: str = "", step_metric: str | None = None, source: str = "",
                 separator: str = "/") -> None:
        self.resolve = resolve
        self.key_prefix = key_prefix  # what the framework puts before our keys (Transformers: "train/")
        self.separator = separator  # what joins our keys' parts in this logger (Lightning's logger.group_separator)
        self.step_metric = step_metric
        self.source = source  # the user's object, for messages
        self.started = False
        self.shown: set[str] = set()  # the findings this tracker has shown, by shown_key (a settled growth is shown again)

    def handle(self) -> Any:
        return self.resolve()

    def start(self, dashboard: Dashboard) -> bool:
        """Set up the dashboard once; return False while the handle does not exist yet."""
        return True

    def findings(self, findings: list[Finding], dashboard: Dashboard) -> bool:
        """Show new findings as they come; return False while the handle does not exist yet."""
        return True

    def finish(self, outputs: RunOutputs) -> None:
        """Attach the run's report, plot and snapshots."""
