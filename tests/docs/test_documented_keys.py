"""Every logged key is in docs/metrics.md and every finding kind and key is in docs/findings.md,
each kind with its fix; the host channel's keys, kinds and report.json parts included (issue 23).

The logged keys come from a real run (a plain-loop Monitor on CPU, every key-adding option on), the
host keys also from the TensorBoard layout's host chart, the finding keys from the code that makes
them."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from memcallbacks import Monitor
from memcallbacks._base.findings import KINDS
from memcallbacks._base.keys import ALL_KEYS, CPU_DEFAULT_KEYS, DEFAULT_KEYS, EVAL_KEYS, OPTION_KEYS, TRAINING_KEYS, WHEN_FORECAST
from memcallbacks.trackers.tensorboard import HOST_KEYS

ROOT = Path(__file__).resolve().parents[2]
METRICS = (ROOT / "docs" / "metrics.md").read_text()
FINDINGS = (ROOT / "docs" / "findings.md").read_text()

HOST_FINDING_KEYS = ("host_growth", "host_growth:native", "worker_growth", "rank_imbalance:host", "rank_imbalance:device")


def logged_keys() -> set[str]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    keys: set[str] = set()
    monitor = Monitor(model, opt, lambda metrics, step: keys.update(metrics), write_files=False, log_every_n_steps=1, device="cpu",
                      log_keys="all", leaks={"gc_every_n_steps": 2})
    for _ in monitor.track(range(6)):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return keys


def table_keys(text: str) -> set[str]:
    """Every `memory/...` name in the first column of the metrics tables."""
    found: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            found.update(re.findall(r"`(memory/[^`]+)`", line.split(" | ")[0]))
    return found


def test_every_logged_key_of_a_real_run_is_documented() -> None:
    keys = logged_keys()
    assert {"memory/host_python_GiB", "memory/host_private_GiB", "memory/gc_time_ms"} <= keys, sorted(keys)
    missing = sorted(keys - table_keys(METRICS))
    assert not missing, f"logged but not in docs/metrics.md's tables: {missing}"


def test_the_key_lists_are_the_documented_keys_and_hold_every_logged_key() -> None:
    keys = logged_keys()
    unlisted = sorted(k for k in keys if k.removeprefix("memory/") not in ALL_KEYS)
    assert not unlisted, f"logged but not in memcallbacks/_base/keys.py: {unlisted}"
    training = {k for k in table_keys(METRICS) if "/val/" not in k}
    assert training == {f"memory/{k}" for k in TRAINING_KEYS}, training ^ {f"memory/{k}" for k in TRAINING_KEYS}
    evaluation = {k for k in table_keys(METRICS) if "/val/" in k}
    assert evaluation == {f"memory/{k}" for k in EVAL_KEYS if k.startswith("val/")}


def test_the_default_list_is_the_documented_one() -> None:
    """docs/metrics.md names the keys logged by default (on CPU each phase's rise in place of its peak)
    and those an option adds, each in backticks."""
    section = METRICS.split("## Logged by default", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`memory/([^`]+)`", section))
    assert named == set(DEFAULT_KEYS) | set(CPU_DEFAULT_KEYS) | {k for keys in OPTION_KEYS.values() for k in keys}, named
    # a training step's keys and an evaluation's; the forecast's only while a growth finding forecasts
    for default in (DEFAULT_KEYS, CPU_DEFAULT_KEYS):
        assert len([k for k in default if "/" not in k and k not in WHEN_FORECAST]) + 1 <= 8


def test_every_host_key_is_documented() -> None:
    host = {f"memory/{k}" for k in HOST_KEYS} | {"memory/host_workers_GiB"}
    missing = sorted(host - table_keys(METRICS))
    assert not missing, f"host keys not in docs/metrics.md's tables: {missing}"
    # report.json's host parts (the channel's summary and this rank's figures)
    for name in ("`host`", "`summary.rank_figures`", "`host_private_bytes`", "`host_python_growth_bytes`", "`host_worker_uss_bytes`",
                 "`uss_bytes`", "`pss_bytes`", "`census_seconds`"):
        assert name in METRICS, f"docs/metrics.md (report.json) does not name {name}"


def _section(text: str, kind: str) -> str | None:
    match = re.search(rf"^(#+) `{re.escape(kind)}`.*$", text, re.M)
    if match is None:
        return None
    rest = text[match.end():]
    end = re.search(rf"^#{{1,{len(match.group(1))}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def test_every_finding_kind_is_in_the_table_with_a_section_and_its_fix() -> None:
    rows = {line.split(" | ")[0].strip("| `") for line in FINDINGS.splitlines() if line.startswith("| `")}
    assert set(KINDS) <= rows, f"kinds missing from docs/findings.md's table: {sorted(set(KINDS) - rows)}"
    for kind in KINDS:
        if kind == "unexplained":  # explained with the theory it compares against
            assert "unexplained" in (ROOT / "docs" / "theory.md").read_text()
            continue
        section = _section(FINDINGS, kind)
        assert section is not None, f"docs/findings.md has no section `{kind}`"
        assert "fix" in section.lower(), f"docs/findings.md's `{kind}` section gives no fix"


def test_every_host_finding_key_the_code_makes_is_documented() -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "memcallbacks" / "host").glob("*.py"))
    made = set(re.findall(r'key="([a-z_:]+)"', source)) | set(re.findall(r'"(host_growth:[a-z]+)"', source))
    made |= {f"rank_imbalance:{c}" for c in ("host", "device")} if 'key=f"rank_imbalance:{channel}"' in source else set()
    assert set(HOST_FINDING_KEYS) <= made | {"host_growth"}, sorted(made)
    table = "\n".join(line for line in FINDINGS.splitlines() if line.startswith("| `"))
    for key in sorted(made | set(HOST_FINDING_KEYS)):
        assert f"`{key}`" in table, f"finding key {key!r} is not in docs/findings.md's table"
