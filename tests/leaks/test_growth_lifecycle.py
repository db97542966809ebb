"""Issue 24: the growth finding's lifecycle on the detector itself (raised, settled, re-opened, not
raised when already stopped), the finding log's state changes, and how counts and labels show them."""

from __future__ import annotations

import logging

import pytest

from memcallbacks._base.findings import Finding, FindingLog, announce, finding_counts, finding_label
from memcallbacks._files.report import format_report
from memcallbacks.leaks.growth import SETTLE_MIN_GAPS, GrowthDetector
from memcallbacks.trackers import shown_key

KIB, MIB = 1 << 10, 1 << 20
BASE = 100 * MIB


def feed(detector: GrowthDetector, series: list[int], start: int = 0) -> list[Finding]:
    out = []
    for i, value in enumerate(series):
        found = detector.update(start + i, value)
        if found is not None:
            out.append(found)
    return out


def warm_up(rate: int, grow_steps: int, flat_steps: int) -> list[int]:
    """A cache that fills at ``rate`` bytes a step for ``grow_steps`` steps, then stays flat."""
    return [BASE + rate * min(i, grow_steps) for i in range(grow_steps + flat_steps)]


def test_a_warm_up_is_raised_while_it_grows_then_settles_after_a_plateau_as_long_as_the_climb():
    detector = GrowthDetector(warmup_steps=4)
    found = feed(detector, warm_up(512 * KIB, 24, 80))
    raised = [f for f in found if f.state == "open"]
    settled = [f for f in found if f.state == "settled"]
    assert raised and raised[0].step <= 24, [str(f) for f in found]
    assert len(settled) == 1, [str(f) for f in found]
    s = settled[0]
    d = s.details
    assert d["flat_steps"] >= d["grew_steps"] and d["flat_steps"] >= d["settle_after_steps"], d
    assert s.step == d["settled_step"] and d["last_rise_step"] <= 25, d
    assert d["settled_bytes"] == s.bytes and 10 * MIB <= s.bytes <= 12 * MIB, d
    assert s.message.startswith("Settled: memory at step start grew by") and "not a leak" in s.message
    assert s.first_step == raised[0].first_step and s.count == 0  # an update of the same cause
    assert found[-1] is s  # nothing after it while the floor is flat


def test_a_leak_that_goes_on_never_settles():
    for rate in (4 * MIB, MIB, 256 * KIB, 64 * KIB):
        detector = GrowthDetector(warmup_steps=4)
        noise = [(i * 7919) % 13 * KIB for i in range(400)]  # a few KiB of step-to-step noise
        found = feed(detector, [BASE + rate * i + noise[i] for i in range(400)])
        assert found and all(f.state == "open" for f in found), (rate, [str(f) for f in found if f.state != "open"])


def test_growth_that_stopped_before_the_decision_is_not_raised():
    # 24 buckets of ~200 KiB in the first 24 steps (~4.7 MiB), then flat: the coarse and fine tests
    # confirm the climb only after it stopped
    detector = GrowthDetector(warmup_steps=4)
    found = feed(detector, warm_up(200 * KIB, 24, 150))
    assert [f for f in found if f.state == "open"] == [], [str(f) for f in found]


def test_a_settled_growth_that_grows_again_is_reopened_with_its_own_settling():
    detector = GrowthDetector(warmup_steps=4)
    series = warm_up(512 * KIB, 20, 80)
    top = series[-1]
    series += [top + MIB * (i + 1) for i in range(40)]  # a leak from step 100
    found = feed(detector, series)
    states = [f.state for f in found]
    assert "settled" in states and states[-1] == "open", states
    last = found[-1]
    assert last.details["reopened"] == 1 and 100 < last.details["reopened_step"] <= 120, last.details
    assert last.message.startswith(f"Re-opened at step {last.details['reopened_step']}: the growth that settled at step "), last.message


def test_settle_after_is_relative_to_the_climb_and_the_rate():
    detector = GrowthDetector(warmup_steps=4)
    feed(detector, warm_up(MIB, 60, 30))
    rises = detector.rises
    assert rises.settle_after(MIB) >= 50  # grew for ~55 steps: as many flat steps
    assert rises.settle_after(1.0) >= SETTLE_MIN_GAPS * rises.tolerance  # a slow rate: long intervals between rises


def test_finding_log_reports_state_changes_and_counts_open_problems(caplog):
    log = FindingLog()
    raised = Finding(kind="growth", step=15, message="grew", bytes=5 * MIB, details={"rate_bytes_per_step": 1})
    assert log.add(raised) and log.changed is None and log.problems() == 1
    settled = Finding(kind="growth", step=41, message="Settled: ...", bytes=8 * MIB, state="settled", count=0,
                      details={"settled_step": 41, "settled_bytes": 8 * MIB, "floor_bytes": BASE, "flat_steps": 20, "grew_steps": 17})
    settled.first_step = 15
    assert not log.add(settled)
    assert log.changed is not None and log.changed.state == "settled" and log.problems() == 0
    stored = log.get("growth")
    assert stored.count == 1 and stored.details["rate_bytes_per_step"] == 1  # merged, not a new sighting
    caplog.set_level(logging.INFO)
    logger = logging.getLogger("memcallbacks.test")
    announce(logger, "Monitor", log.changed, changed=True)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.getMessage() == (
        "Monitor: the growth found at step 15 settled at 100.0 MiB (+8.0 MiB) at step 41: flat for 20 steps after growing "
        "for 17; not a leak unless it grows again.")
    advice = Finding(kind="lingering", step=2, key="lingering:outputs", message="Advice ...", severity="advice")
    assert log.add(advice) and log.problems() == 0
    caplog.clear()
    announce(logger, "Monitor", advice)
    assert caplog.records[0].levelno == logging.INFO and "Monitor has advice: [lingering, advice] step 2" in caplog.records[0].getMessage()


def test_labels_counts_and_tracker_keys_follow_the_state():
    open_ = Finding(kind="growth", step=3, message="m")
    settled = Finding(kind="growth", step=9, message="m", state="settled")
    advice = Finding(kind="lingering", step=2, message="m", key="lingering:outputs", severity="advice")
    assert [f.label for f in (open_, settled, advice)] == ["growth", "growth, settled", "lingering, advice"]
    assert str(settled).startswith("[growth, settled] step 9:")
    assert shown_key(open_) != shown_key(settled)  # a tracker shows the finding again when it settles
    items = [f.to_dict() for f in (settled, advice)]
    assert [finding_label(i) for i in items] == ["growth, settled", "lingering, advice"]
    assert finding_counts(items) == "0 open problems (1 settled growth, 1 advice)"
    assert finding_counts([open_.to_dict()]) == "1"
    assert finding_counts([{"kind": "growth", "step": 1, "message": "from an older report.json"}]) == "1"
    report = {"summary": {}, "findings": items, "files": {}, "events": [], "model_states": {}, "snapshots": []}
    text = format_report(report)
    assert "0 open problems (1 settled growth, 1 advice)" in text and "[growth, settled] step 9: m" in text


@pytest.mark.parametrize(("field", "value"), [("state", "closed"), ("severity", "warning")])
def test_a_bad_state_or_severity_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=f"Finding.{field}='{value}' is not one of"):
        Finding(kind="growth", step=1, message="m", **{field: value})


def test_a_finding_shows_the_step_it_was_first_raised_at_and_its_latest_update_apart():
    log = FindingLog()
    log.add(Finding(kind="growth", step=49, message="m"))
    log.add(Finding(kind="growth", step=284, message="m"))
    stored = log.get("growth")
    assert (stored.first_step, stored.step) == (49, 284)
    assert str(stored).startswith("[growth] step 49 (confirmed again at step 284): m")
    text = format_report({"summary": {}, "findings": [stored.to_dict()], "files": {}, "events": [], "model_states": {}, "snapshots": []})
    assert "[growth] step 49 (confirmed again at step 284): m" in text
    settled = Finding(kind="growth", step=300, first_step=49, message="m", state="settled")
    assert str(settled).startswith("[growth, settled] step 49 (settled at step 300): m")
