"""docs/configuration.md names every setting of MonitorConfig and its groups, with the default the code has."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from memcallbacks import AdvancedOptions, LeakOptions, MonitorConfig, SnapshotOptions

CONFIGURATION = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
GROUPS = {"leaks": LeakOptions, "snapshot": SnapshotOptions, "advanced": AdvancedOptions}


def documented() -> dict[str, str]:
    """``{setting path: its default cell's first code span}`` from the tables."""
    rows = {}
    for line in CONFIGURATION.splitlines():
        if line.startswith("| `"):
            cells = line.split(" | ")
            rows[cells[0].strip("| `")] = re.findall(r"`([^`]*)`", cells[1])[0]
    return rows


def shown(default: object) -> str:
    return f"{type(default).__name__}()" if dataclasses.is_dataclass(default) else repr(default)


def test_every_setting_is_documented_with_its_default() -> None:
    code = {f.name: shown(f.default) for f in dataclasses.fields(MonitorConfig)}
    code.update({f"{group}.{f.name}": shown(f.default) for group, cls in GROUPS.items() for f in dataclasses.fields(cls)})
    assert documented() == code


def test_the_documented_yaml_and_errors_are_what_the_code_does() -> None:
    import pytest
    import yaml

    from memcallbacks import MemoryMonitor

    assert len(dataclasses.fields(MonitorConfig)) <= 15
    block = re.search(r"```yaml\n(.*?)```", CONFIGURATION, re.S).group(1)
    init_args = yaml.safe_load(block)["trainer"]["callbacks"][0]["init_args"]
    config = MonitorConfig(**init_args)
    assert config.capacity_bytes == 80 * 2**30 and config.leaks.gc_every_n_steps == 100
    for build in (lambda: MonitorConfig(log_every_n_steps=0), lambda: MemoryMonitor(log_evry_n_steps=3),
                  lambda: MemoryMonitor(gc_every_n_steps=100)):
        with pytest.raises((TypeError, ValueError)) as info:
            build()
        assert f"{type(info.value).__name__}: {info.value}" in CONFIGURATION, str(info.value)
