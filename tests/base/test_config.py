"""MonitorConfig validation, MemoryMonitor's keyword arguments, and an unwritable output_dir stopping the run early."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import lightning.pytorch as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from helpers import BoringModel, RandomDataModule, csv_metrics, trainer_kwargs
from memcallbacks import MemoryMonitor, MonitorConfig

FIELDS = [f.name for f in dataclasses.fields(MonitorConfig)]

# whole numbers of any numeric type (10.0, numpy.int64(10)) are valid for integer fields: tests/runtime/test_bad_input_refused.py
INVALID = {
    "log_every_n_steps": [0, -1, 1.5, True, "2"],
    "sample_every_n_steps": [0, -3, 2.5, False, "1"],
    "overhead_budget": [0, -0.1, 1.5, True, "0.01", float("nan")],
    "cpu_mmap_threshold": [4095, 2**30 + 1, 0, -1, True, 65536.5],
    "output_dir": [3, ["runs"], b"runs"],
    "write_files": [1, "yes", None],
    "plot": [0, None],
    "console_summary": [1, "yes", None],
    "log_to_trackers": [0, "yes"],
    "log_validation": ["true", 1],
    "reduce_across_ranks": [1, None],
    "strict": [None, "False"],
    "max_history_rows": [99, 0, -5, True, 1000.5],
    "prefix": ["", "/", "/memory", "memory/", " memory", "memory ", 3, None],
    "detect_leaks": [1, None, "yes"],
    "watch_host": [1, None, "no"],
    "growth_warmup_steps": [-1, 2.5, True],
    "growth_min_bytes_per_step": [0, -1, 1.5, False],
    "growth_min_total_bytes": [0, "4MiB"],
    "lingering_min_bytes": [-1, 0.5, None],
    "census_time_budget_s": [0, -1.0, 601, True, "2"],
    "gc_every_n_steps": [0, -2, 1.5, True],
    "gc_disable_automatic": [True, 1],  # True without gc_every_n_steps collects nothing
    "estimate_model_states": [None, 0],
    "unexplained_margin_bytes": [-1, 1.5, None],
    "auto_snapshot": [1, "yes"],
    "snapshot_policy": ["sometimes", None, 1],
    "snapshot_capacity_fraction": [0, 1.5, -0.1, True, "0.9"],
    "snapshot_peak_bytes": [0, -1, 1.5, True],
    "snapshot_on_alloc_retries": [None, 1],
    "snapshot_on_findings": [0, "no"],
    "snapshot_every_n_steps": [0, 2.5, False],
    "snapshot_steps": [0, None, 1.5],
    "max_snapshots": [0, None, -1],
    "max_snapshot_bytes": [1000, None, 2.0**31 + 0.5],
    "snapshot_max_entries": [10, None],
    "preflight": [1, "yes", None],
    "capacity_bytes": [0, -1, 1000, 2.0**31 + 0.5, True, "80GB"],
    "preflight_tolerance": [-0.1, 11, True, "0.25", None, float("nan")],
}
INVALID_CASES = [(field, value) for field, values in INVALID.items() for value in values]


def test_every_field_has_invalid_cases():
    assert sorted(INVALID) == sorted(FIELDS), "a MonitorConfig field was added or removed: add its invalid values here"


@pytest.mark.parametrize(("field", "value"), INVALID_CASES, ids=[f"{f}={v!r}" for f, v in INVALID_CASES])
def test_invalid_value_names_field_and_value(field, value):
    expected = re.escape(f"MonitorConfig.{field}={value!r}")
    with pytest.raises(ValueError, match=expected):
        MonitorConfig(**{field: value})
    # the adapter takes the same names and gives the same error
    with pytest.raises(ValueError, match=expected):
        MemoryMonitor(**{field: value})
    with pytest.raises(ValueError, match=expected):
        MemoryMonitor(config={field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("log_every_n_steps", 1),
        ("log_every_n_steps", None),
        ("sample_every_n_steps", 1),
        ("cpu_mmap_threshold", 4096),
        ("cpu_mmap_threshold", 2**30),
        ("max_history_rows", 100),
        ("prefix", "train/memory"),
        ("write_files", False),
        ("strict", True),
        ("capacity_bytes", 1 << 20),
        ("preflight_tolerance", 0),
        ("preflight_tolerance", 10),
    ],
)
def test_boundary_values_are_accepted(field, value):
    assert getattr(MonitorConfig(**{field: value}), field) == value


def test_output_dir_path_is_stored_as_str(tmp_path):
    config = MonitorConfig(output_dir=tmp_path / "mem")
    assert config.output_dir == str(tmp_path / "mem") and isinstance(config.output_dir, str)


def test_defaults_frozen_and_keyword_only():
    config = MonitorConfig()
    assert config.to_dict() == {f.name: f.default for f in dataclasses.fields(MonitorConfig)}
    assert config.log_every_n_steps is None and config.max_history_rows == 200_000 and config.prefix == "memory"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.prefix = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        MonitorConfig(5)  # type: ignore[misc]


def test_unknown_keyword_is_a_type_error_listing_valid_names():
    with pytest.raises(TypeError) as info:
        MemoryMonitor(log_every_n_step=3)
    message = str(info.value)
    assert "'log_every_n_step'" in message and "MemoryMonitor" in message
    for name in FIELDS:
        assert name in message
    with pytest.raises(TypeError, match="'colour'"):
        MemoryMonitor(config={"colour": "red"})
    with pytest.raises(TypeError, match="must be a MonitorConfig"):
        MemoryMonitor(config=42)


def test_keyword_overrides_config_and_the_fit_follows_it(tmp_path):
    base = MonitorConfig(log_every_n_steps=5, sample_every_n_steps=1, prefix="mem", write_files=False)
    monitor = MemoryMonitor(config=base, log_every_n_steps=3)
    assert monitor.config == dataclasses.replace(base, log_every_n_steps=3)
    assert base.log_every_n_steps == 5  # the caller's config is untouched

    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=6, callbacks=[monitor], logger=CSVLogger(str(tmp_path), name="csv", version=0)))
    trainer.fit(BoringModel(), RandomDataModule())
    csv = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert [s for s, _ in csv["mem/peak_step_GiB"]] == [2, 5]
    assert not any(key.startswith("memory/") for key in csv)
    assert list(monitor.history["step"]) == list(range(6))


def test_unwritable_output_dir_stops_the_run_in_setup(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "memcallbacks"  # its parent is a regular file: not creatable, even for root
    monitor = MemoryMonitor(output_dir=str(out), sample_every_n_steps=1)
    model = BoringModel()
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=3, callbacks=[monitor]))
    with pytest.raises(OSError) as info:
        trainer.fit(model, RandomDataModule())
    message = str(info.value)
    assert str(out) in message and "output_dir" in message and "write_files=False" in message
    assert model.training_steps_run == 0
    assert trainer.global_step == 0
    assert blocker.read_text() == "not a folder"


def test_write_files_false_never_touches_output_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monitor = MemoryMonitor(output_dir=str(blocker / "mem"), write_files=False, sample_every_n_steps=1)
    model = BoringModel()
    L.Trainer(**trainer_kwargs(tmp_path, max_steps=2, callbacks=[monitor])).fit(model, RandomDataModule())
    assert model.training_steps_run == 2 and list(monitor.history["step"]) == [0, 1]
    assert monitor.files == {} and sorted(p.name for p in Path(tmp_path).iterdir()) == ["a-file"]
