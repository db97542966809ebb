"""What the docs state about the configuration and the files is what the code does.

configuration.md's table names every ``MonitorConfig`` field with the default the code has;
metrics.md names every ``history.csv`` and ``eval_history.csv`` column and every ``report.json``
key a real run writes; user docs speak to users (no project history, no private module names
outside architecture.md)."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from memcallbacks import Monitor, MonitorConfig
from memcallbacks._base.columns import COLUMNS, EVAL_COLUMNS

ROOT = Path(__file__).resolve().parents[2]
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
METRICS = (ROOT / "docs" / "metrics.md").read_text()
USER_DOCS = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "architecture.md")]


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def documented_defaults() -> dict[str, str]:
    """``{field: default cell}`` from configuration.md's table (dotted names for grouped fields)."""
    rows = re.findall(r"^\| `([a-z_.]+)` \| (?:`([^|`]*)`|([^|`]*))[^|]*\|", CONFIGURATION, re.M)
    groups = {f.name for f in dataclasses.fields(MonitorConfig) if "." not in f.name and dataclasses.is_dataclass(f.default)}
    # "`65536` (64 KiB)": the literal; a group's own row (`leaks`: its fields follow, dotted) is no field
    return {name: (quoted or plain).strip() for name, quoted, plain in rows if name not in groups}


def code_fields(config: Any, prefix: str = "") -> dict[str, Any]:
    """Every field of a default config with its value, a group's fields as ``group.field``."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(code_fields(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


def test_configuration_md_lists_every_field_with_its_default() -> None:
    documented, code = documented_defaults(), code_fields(MonitorConfig())
    assert set(code) <= set(documented), f"fields missing from configuration.md: {sorted(set(code) - set(documented))}"
    assert set(documented) <= set(code), f"configuration.md names fields the code has not: {sorted(set(documented) - set(code))}"
    wrong = {name: (documented[name], value) for name, value in code.items() if ast.literal_eval(documented[name]) != value}
    assert not wrong, f"configuration.md's default differs from the code's (documented, code): {wrong}"


def test_metrics_md_lists_every_history_column() -> None:
    text = section(METRICS, "`monitor.history` (and `history.csv`)")
    table = {name for cell in re.findall(r"^\| ([^|]+) \|", text, re.M) for name in re.findall(r"`([a-z_]+)`", cell)}
    assert set(COLUMNS) <= table, sorted(set(COLUMNS) - table)
    eval_sentence = text[text.index("`monitor.eval_history`"):]
    assert set(EVAL_COLUMNS) <= set(re.findall(r"`([a-z_]+)`", eval_sentence)), sorted(set(EVAL_COLUMNS) - set(re.findall(r"`([a-z_]+)`", eval_sentence)))


@pytest.fixture(scope="module")
def written_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("report")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    monitor = Monitor(model, opt, output_dir=str(out), plot=False, device="cpu", console_summary=False)
    for _ in monitor.track(range(6)):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return json.loads((out / "report.json").read_text()), out


def test_metrics_md_names_every_report_json_key_a_run_writes(written_report: tuple[dict[str, Any], Path]) -> None:
    report, out = written_report
    text = section(METRICS, "`report.json`")
    named = {part for name in re.findall(r"`([a-z_.]+)`", text) for part in name.split(".")}
    assert list(report)[:2] == ["verdict", "summary"], list(report)
    assert set(report) <= named, f"report.json keys missing from metrics.md: {sorted(set(report) - named)}"
    for key in ("peak", "step_time_median_s", "cadence", "rank_figures"):
        assert key in report["summary"] and key in named, key
    assert "step_time_median_s" not in report["summary"]["cadence"]  # one median, in the summary
    assert report["config"]["output_dir"] == str(out)  # resolved, as metrics.md says


def test_history_csv_columns_carry_their_unit_as_metrics_md_says(written_report: tuple[dict[str, Any], Path]) -> None:
    _, out = written_report
    header = (out / "history.csv").read_text().splitlines()[0].split(",")
    assert "allocated_bytes" in header and "peak_forward_bytes" in header and "step_time_s" in header, header
    assert "allocated" not in header and "step" in header
    assert "`allocated_bytes`" in section(METRICS, "`monitor.history` (and `history.csv`)")


HISTORY_WORDS = re.compile(r"seed stor|seed \d{3}|\bissue[ -]\d+|\bthe seed\b", re.I)
PRIVATE_NAMES = re.compile(r"memcallbacks[./]_[a-z]")


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: p.name)
def test_user_docs_speak_to_users(doc: Path) -> None:
    text = doc.read_text()
    history = [m.group(0) for m in HISTORY_WORDS.finditer(text)]
    private = [text[max(0, m.start() - 20):m.end() + 30] for m in PRIVATE_NAMES.finditer(text)]
    assert not history, f"{doc.name} speaks in the project's history: {history}"
    assert not private, f"{doc.name} names private modules (they belong in architecture.md): {private}"
