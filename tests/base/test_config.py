"""MonitorConfig validation, MemoryMonitor's keyword arguments, and an unwritable output_dir stopping the run early."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import lightning.pytorch as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from helpers import BoringModel, RandomDataModule, csv_metrics, trainer_kwargs
from memcallbacks import AccelerateMemoryMonitor, AdvancedOptions, LeakOptions, MemoryMonitor, Monitor, MonitorConfig, SnapshotOptions
from memcallbacks import MemoryMonitorCallback

GROUPS = {"leaks": LeakOptions, "snapshot": SnapshotOptions, "advanced": AdvancedOptions}
FIELDS = [f.name for f in dataclasses.fields(MonitorConfig)]
PATHS = [f.name for f in dataclasses.fields(MonitorConfig) if f.name not in GROUPS] + [
    f"{group}.{f.name}" for group, cls in GROUPS.items() for f in dataclasses.fields(cls)]
# what a setting needs beside it to mean anything (refused alone: test_a_setting_without_its_switch_is_refused)
NEEDS = {"snapshot": {"auto_snapshot": True}, "capacity_bytes": {"preflight": True}, "advanced.preflight_tolerance": {"preflight": True}}

# whole numbers of any numeric type (10.0, numpy.int64(10)) are valid for integer fields: tests/runtime/test_bad_input_refused.py
INVALID = {
    "log_every_n_steps": [0, -1, 1.5, True, "2"],
    "sample_every_n_steps": [0, -3, 2.5, False, "1"],
    "log_keys": ["some", 3, ["peak_stp_GiB"], ["memory/peak_step_GiB"]],
    "output_dir": [3, ["runs"], b"runs"],
    "write_files": [1, "yes", None],
    "plot": [0, None],
    "console_summary": [1, "yes", None],
    "detect_leaks": [1, None, "yes"],
    "watch_host": [1, None, "no"],
    "preflight": [1, "yes", None],
    "capacity_bytes": [0, -1, 1000, 2.0**31 + 0.5, True, "80 GB2", "lots"],
    "auto_snapshot": [1, "yes"],
    "leaks.growth_warmup_steps": [-1, 2.5, True],
    "leaks.growth_min_bytes_per_step": [0, -1, 1.5, False, "fast"],
    "leaks.growth_min_total_bytes": [0, "4 MiBs"],
    "leaks.lingering_min_bytes": [-1, 0.5, None],
    "leaks.census_time_budget_s": [0, -1.0, 601, True, "2"],
    "leaks.gc_every_n_steps": [0, -2, 1.5, True],
    "leaks.gc_disable_automatic": [True, 1],  # True without gc_every_n_steps collects nothing
    "leaks.estimate_model_states": [None, 0],
    "leaks.unexplained_margin_bytes": [-1, 1.5, None],
    "snapshot.policy": ["sometimes", None, 1],
    "snapshot.capacity_fraction": [0, 1.5, -0.1, True, "0.9"],
    "snapshot.peak_bytes": [0, -1, 1.5, True],
    "snapshot.on_alloc_retries": [None, 1],
    "snapshot.on_findings": [0, "no"],
    "snapshot.every_n_steps": [0, 2.5, False],
    "snapshot.steps": [0, None, 1.5],
    "snapshot.max_snapshots": [0, None, -1],
    "snapshot.max_bytes": [1000, None, 2.0**31 + 0.5, "1 KiB"],
    "snapshot.max_entries": [10, None],
    "advanced.overhead_budget": [0, -0.1, 1.5, True, "0.01", float("nan")],
    "advanced.cpu_mmap_threshold": [4095, 2**30 + 1, 0, -1, True, 65536.5, "2 GiB"],
    "advanced.preflight_tolerance": [-0.1, 11, True, "0.25", None, float("nan")],
    "advanced.prefix": ["", "/", "/memory", "memory/", " memory", "memory ", 3, None],
    "advanced.log_validation": ["true", 1],
    "advanced.log_to_trackers": [0, "yes"],
    "advanced.reduce_across_ranks": [1, None],
    "advanced.max_history_rows": [99, 0, -5, True, 1000.5],
    "advanced.strict": [None, "False"],
}
INVALID_CASES = [(path, value) for path, values in INVALID.items() for value in values]


def arguments(path: str, value: object) -> dict:
    """The keyword arguments that set ``path`` (``"leaks.gc_every_n_steps"``) to ``value``, a group as a dict."""
    group, _, name = path.rpartition(".")
    given = {group: {name: value}} if group else {path: value}
    return {**given, **NEEDS.get(group or path, {}), **NEEDS.get(path, {})}


def test_every_field_has_invalid_cases():
    assert sorted(INVALID) == sorted(PATHS), "a MonitorConfig field was added or removed: add its invalid values here"


@pytest.mark.parametrize(("path", "value"), INVALID_CASES, ids=[f"{f}={v!r}" for f, v in INVALID_CASES])
def test_invalid_value_names_field_and_value(path, value):
    group, _, name = path.rpartition(".")
    expected = re.escape(f"{GROUPS[group].__name__}.{name}={value!r}" if group else f"MonitorConfig.{name}={value!r}")
    if path == "log_keys" and not isinstance(value, (str, int)):
        expected = re.escape(f"MonitorConfig.log_keys has {value[0]!r}")
    with pytest.raises(ValueError, match=expected):
        MonitorConfig(**arguments(path, value))
    # the monitors take the same names and give the same error
    with pytest.raises(ValueError, match=expected):
        MemoryMonitor(**arguments(path, value))
    with pytest.raises(ValueError, match=expected):
        MemoryMonitor(config=arguments(path, value))
    if group:  # and the group itself, built in Python
        with pytest.raises(ValueError, match=expected):
            GROUPS[group](**{name: value})


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("log_every_n_steps", 1),
        ("log_every_n_steps", None),
        ("sample_every_n_steps", 1),
        ("log_keys", "all"),
        ("log_keys", ("default", "peak_step_GiB", "val/peak_reserved_GiB")),
        ("write_files", False),
        ("capacity_bytes", 1 << 20),
        ("advanced.cpu_mmap_threshold", 4096),
        ("advanced.cpu_mmap_threshold", 2**30),
        ("advanced.max_history_rows", 100),
        ("advanced.prefix", "train/memory"),
        ("advanced.strict", True),
        ("advanced.preflight_tolerance", 0),
        ("advanced.preflight_tolerance", 10),
    ],
)
def test_boundary_values_are_accepted(path, value):
    config = MonitorConfig(**arguments(path, value))
    group, _, name = path.rpartition(".")
    assert getattr(getattr(config, group) if group else config, name) == value


SIZES = {"capacity_bytes": ("80 GiB", 80 << 30), "leaks.growth_min_bytes_per_step": ("64 KiB", 64 << 10),
         "leaks.growth_min_total_bytes": ("4 MiB", 4 << 20), "leaks.lingering_min_bytes": ("0 B", 0),
         "leaks.unexplained_margin_bytes": ("0.5 GiB", 1 << 29), "snapshot.peak_bytes": ("70 GB", 70 * 10**9),
         "snapshot.max_bytes": ("1 GiB", 1 << 30), "advanced.cpu_mmap_threshold": ("256 KiB", 256 << 10)}


def test_every_byte_setting_takes_a_size_string(tmp_path):
    byte_paths = {p for p in PATHS if "_bytes" in p or p.endswith("_threshold")}
    assert byte_paths == set(SIZES), "a setting in bytes was added: give it a size string here"
    for path, (text, expected) in SIZES.items():
        for build in (MonitorConfig, MemoryMonitor, lambda **kw: Monitor(output_dir=str(tmp_path), **kw)):
            made = build(**arguments(path, text))
            config = getattr(made, "config", made)
            group, _, name = path.rpartition(".")
            stored = getattr(getattr(config, group) if group else config, name)
            assert stored == expected and type(stored) is int, (path, build, stored)
    assert MemoryMonitor(preflight=True, capacity_bytes="80 GiB").config.capacity_bytes == 80 * 2**30


def test_a_setting_without_its_switch_is_refused_naming_the_switch():
    for given, switch in (
        ({"snapshot": SnapshotOptions(max_snapshots=3)}, "auto_snapshot=True"),
        ({"snapshot": {"policy": "always", "steps": 5}}, "auto_snapshot=True"),
        ({"capacity_bytes": "80 GiB"}, "preflight=True"),
        ({"advanced": AdvancedOptions(preflight_tolerance=0.5)}, "preflight=True"),
    ):
        with pytest.raises(ValueError, match=re.escape(switch)) as info:
            MemoryMonitor(**given)
        assert "does nothing" in str(info.value) or "do nothing" in str(info.value)
    # with the switch, or at their defaults, they are accepted
    MonitorConfig(auto_snapshot=True, snapshot=SnapshotOptions(max_snapshots=3, policy="always"))
    MonitorConfig(preflight=True, capacity_bytes="80 GiB", advanced=AdvancedOptions(preflight_tolerance=0.5))
    MonitorConfig(snapshot=SnapshotOptions(), advanced=AdvancedOptions(preflight_tolerance=0.25))


def test_at_most_fifteen_fields_and_every_monitor_has_them_by_name():
    assert len(FIELDS) <= 15, FIELDS
    defaults = {f.name: f.default for f in dataclasses.fields(MonitorConfig)}
    for cls in (MemoryMonitor, Monitor, AccelerateMemoryMonitor, MemoryMonitorCallback):
        params = inspect.signature(cls.__init__).parameters
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), f"{cls.__name__} takes **kwargs"
        mine = {name: p.default for name, p in params.items() if name in defaults}
        assert mine == defaults, cls.__name__  # every field, with MonitorConfig's default
        assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in defaults), cls.__name__
        assert all(str(params[name].annotation) == str(MonitorConfig.__dataclass_fields__[name].type) for name in defaults), cls.__name__


def test_a_typo_gets_did_you_mean_and_a_grouped_name_its_group():
    cases = [
        (lambda: MemoryMonitor(log_evry_n_steps=3), "MemoryMonitor()", "'log_evry_n_steps' (did you mean 'log_every_n_steps'?)"),
        (lambda: Monitor(sample_every=1), "Monitor()", "did you mean 'sample_every_n_steps'?"),
        (lambda: MonitorConfig(autosnapshot=True), "MonitorConfig()", "did you mean 'auto_snapshot'?"),
        (lambda: LeakOptions(gc_every=10), "LeakOptions()", "did you mean 'gc_every_n_steps'?"),
        (lambda: SnapshotOptions(max_snapshot=2), "SnapshotOptions()", "did you mean 'max_snapshots'?"),
        (lambda: MemoryMonitor(gc_every_n_steps=10), "MemoryMonitor()", "pass leaks=LeakOptions(gc_every_n_steps=...)"),
        (lambda: MemoryMonitor(snapshot_policy="always"), "MemoryMonitor()", "pass snapshot=SnapshotOptions(policy=...)"),
        (lambda: MemoryMonitor(prefix="gpu"), "MemoryMonitor()", "pass advanced=AdvancedOptions(prefix=...)"),
        (lambda: MemoryMonitor(warmup_steps=3), "MemoryMonitor()", "did you mean leaks=LeakOptions(growth_warmup_steps=...)?"),
        (lambda: MemoryMonitor(config={"log_evry_n_steps": 3}), "MemoryMonitor()", "did you mean 'log_every_n_steps'?"),
        (lambda: MemoryMonitor(leaks={"growth_warmup": 3}), "LeakOptions()", "did you mean 'growth_warmup_steps'?"),
    ]
    for build, owner, hint in cases:
        with pytest.raises(TypeError) as info:
            build()
        assert owner in str(info.value) and hint in str(info.value), str(info.value)
    with pytest.raises(TypeError, match="must be a MonitorConfig"):
        MemoryMonitor(config=42)
    with pytest.raises(ValueError, match=re.escape("MonitorConfig.leaks=3 is invalid: pass LeakOptions(...) or a dict of its fields.")):
        MonitorConfig(leaks=3)


def test_groups_as_dicts_and_as_objects_are_the_same_config():
    as_objects = MonitorConfig(leaks=LeakOptions(gc_every_n_steps=10), advanced=AdvancedOptions(prefix="gpu"))
    as_dicts = MonitorConfig(leaks={"gc_every_n_steps": 10}, advanced={"prefix": "gpu"})
    assert as_objects == as_dicts and MemoryMonitor(leaks={"gc_every_n_steps": 10}, advanced={"prefix": "gpu"}).config == as_dicts


def test_output_dir_path_is_stored_as_str(tmp_path):
    config = MonitorConfig(output_dir=tmp_path / "mem")
    assert config.output_dir == str(tmp_path / "mem") and isinstance(config.output_dir, str)


def test_defaults_frozen_and_keyword_only():
    config = MonitorConfig()
    nested = {f.name: dataclasses.asdict(f.default) if dataclasses.is_dataclass(f.default) else f.default
              for f in dataclasses.fields(MonitorConfig)}
    assert config.to_dict() == nested
    assert config.log_every_n_steps is None and config.advanced.max_history_rows == 200_000 and config.advanced.prefix == "memory"
    for frozen in (config, config.leaks, config.snapshot, config.advanced):
        with pytest.raises(dataclasses.FrozenInstanceError):
            frozen.strict = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        MonitorConfig(5)  # type: ignore[misc]
    with pytest.raises(TypeError):
        LeakOptions(4)  # type: ignore[misc]


def test_keyword_overrides_config_and_the_fit_follows_it(tmp_path):
    base = MonitorConfig(log_every_n_steps=5, sample_every_n_steps=1, advanced=AdvancedOptions(prefix="mem"), write_files=False)
    monitor = MemoryMonitor(config=base, log_every_n_steps=3)
    assert monitor.config == dataclasses.replace(base, log_every_n_steps=3)
    assert base.log_every_n_steps == 5  # the caller's config is untouched

    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=6, callbacks=[monitor], logger=CSVLogger(str(tmp_path), name="csv", version=0)))
    trainer.fit(BoringModel(), RandomDataModule())
    csv = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert [s for s, _ in csv["mem/peak_forward_above_start_GiB"]] == [2, 5]  # CPU's default list: each phase's rise
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


class PassingMonitor(MemoryMonitor):
    """A user's subclass that passes its keywords on (``__init__(*args, **kwargs)``)."""

    def __init__(self, *args, **kwargs):
        self.made_here = True
        super().__init__(*args, **kwargs)


def test_a_subclass_passing_keywords_on_keeps_the_names_and_the_checks():
    monitor = PassingMonitor(log_every_n_steps=3, leaks={"gc_every_n_steps": 5})
    assert monitor.made_here and monitor.config.log_every_n_steps == 3 and monitor.config.leaks.gc_every_n_steps == 5
    with pytest.raises(TypeError, match=r"PassingMonitor\(\) got unexpected keyword argument\(s\): 'log_evry_n_steps' \(did you mean"):
        PassingMonitor(log_evry_n_steps=3)
