"""TensorBoard: one custom-scalars layout per run (memory charts), findings in the TEXT tab."""

from __future__ import annotations

import logging
import re
from typing import Any

from memcallbacks._base.findings import Finding
from memcallbacks.trackers._base import Dashboard, RunOutputs, Tracker, finding_text

log = logging.getLogger(__name__)

__all__ = ["TensorBoardTracker", "layout", "CATEGORY"]

CATEGORY = "memcallbacks"
"""Title of the custom-scalars category (suffixed with the prefix when it is not ``memory``)."""

PHASE_KEYS = ("peak_forward_GiB", "peak_backward_GiB", "peak_optimizer_GiB", "allocated_GiB")
RISE_KEYS = ("peak_forward_above_start_GiB", "peak_backward_above_start_GiB", "peak_optimizer_above_start_GiB",
             "peak_step_above_start_GiB")
RESERVED_KEYS = ("allocated_GiB", "reserved_GiB", "peak_step_GiB", "peak_reserved_GiB")
LEAK_KEYS = ("findings", "gc_freed_GiB", "unexplained_GiB")
HOST_KEYS = ("host_rss_GiB", "host_private_GiB", "host_python_GiB", "host_workers_GiB")


def layout(dashboard: Dashboard, key_prefix: str = "", separator: str = "/") -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout, in the form ``SummaryWriter.add_custom_scalars`` takes: a chart
    for each group of keys the run logs (``log_keys``), with the lines of those keys.

    Each chart line is an anchored regular expression matching exactly one logged tag, so a
    second monitor with another prefix, or the user's own keys, never join these charts.
    """
    p = dashboard.prefix

    def tags(names: tuple[str, ...]) -> list[str]:
        return ["^" + re.escape(f"{key_prefix}{p}/{name}".replace("/", separator)) + "$" for name in names if dashboard.logs(name)]

    phase = tags(PHASE_KEYS[:3])  # no phase peak logged (CPU's default list has their rises): no chart of the floor alone
    phase += tags(PHASE_KEYS[3:]) + (tags(("capacity_GiB",)) if dashboard.capacity else []) if phase else []
    category = CATEGORY if p == "memory" else f"{CATEGORY} ({p})"
    charts = {"memory per phase": phase, "per phase, above the step's start": tags(RISE_KEYS),
              "reserved vs allocated": tags(RESERVED_KEYS), "leaks": tags(LEAK_KEYS), "host": tags(HOST_KEYS)}
    return {category: {title: ["Multiline", lines] for title, lines in charts.items() if lines}}


class TensorBoardTracker(Tracker):
    """A ``SummaryWriter`` (torch.utils.tensorboard or tensorboardX) the run already writes to."""

    name = "TensorBoard writer"

    def handle(self) -> Any:
        writer = self.resolve()
        # Lightning's DummyExperiment, or a writer closed and dropped (Transformers sets tb_writer=None)
        return writer if writer is not None and hasattr(writer, "add_custom_scalars") else None

    def start(self, dashboard: Dashboard) -> bool:
        writer = self.handle()
        if writer is None:
            return False
        writer.add_custom_scalars(layout(dashboard, self.key_prefix, self.separator))
        return True

    def findings(self, findings: list[Finding], dashboard: Dashboard) -> bool:
        writer = self.handle()
        if writer is None:
            return False
        for finding in findings:
            # markdown: keep the message's line breaks, show holders as a list
            text = finding_text(finding).replace("\n", "  \n")
            writer.add_text(f"{dashboard.prefix}/findings/{finding.kind}", text, global_step=int(finding.first_step or finding.step) if finding.state == "open" and not finding.details.get("reopened") else int(finding.step))
        writer.flush()
        return True

    def finish(self, outputs: RunOutputs) -> None:
        writer = self.handle()
        if writer is None:
            return
        if outputs.report_text:
            last = int(outputs.report.get("summary", {}).get("steps_seen", 0) or 0)
            body = "\n".join("    " + line for line in outputs.report_text.splitlines())  # a markdown code block
            writer.add_text(f"{outputs.prefix}/report", body, global_step=last)
        writer.flush()
