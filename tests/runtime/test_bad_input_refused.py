"""Bad input gets a clear error naming the parameter, the value and the fix; valid input is never refused.

Each case here was answered wrongly before (issue 24, section 3): whole numbers given as
``np.int64``/``10.0`` refused, a keyword equal to its default losing to ``config=``, a device
without CUDA accepted and failing at start, a nested ``track()`` recorded as extra rows,
``load_state_dict({})`` accepted, and ``memcallbacks estimate`` exiting 0 on nonsense.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from memcallbacks import AdvancedOptions, LeakOptions, Monitor, MonitorConfig, SnapshotOptions
from memcallbacks.cli import main

GROUPS = {"leaks": LeakOptions, "snapshot": SnapshotOptions, "advanced": AdvancedOptions}
# every integer setting, as "field" or "group.field"
_INT_FIELDS = [f.name for f in dataclasses.fields(MonitorConfig) if f.type.startswith("int")] + [
    f"{group}.{f.name}" for group, cls in GROUPS.items() for f in dataclasses.fields(cls) if f.type.startswith("int")]
# a valid value of each integer field, and what each needs alongside it
VALID_INT = {"advanced.cpu_mmap_threshold": 1 << 20, "advanced.max_history_rows": 1000, "snapshot.max_bytes": 1 << 30,
             "snapshot.max_entries": 5000, "capacity_bytes": 1 << 30}
NEEDS = {"snapshot": {"auto_snapshot": True}, "capacity_bytes": {"preflight": True}}


def build(path: str, value: Any) -> tuple[Any, str]:
    """MonitorConfig with ``path`` set to ``value``, and the name its messages give the field."""
    group, _, name = path.rpartition(".")
    given = {group: {name: value}} if group else {path: value}
    config = MonitorConfig(**given, **NEEDS.get(group or path, {}))
    return (getattr(getattr(config, group), name) if group else getattr(config, name)), f"{GROUPS[group].__name__ if group else 'MonitorConfig'}.{name}"


# ---------------------------------------------------------------------- integer fields
@pytest.mark.parametrize("name", _INT_FIELDS)
def test_every_integer_field_takes_any_whole_number(name: str) -> None:
    value = VALID_INT.get(name, 10)
    for given in (np.int64(value), np.int32(value) if value < 2**31 else np.int64(value), float(value), np.float64(value)):
        stored, _ = build(name, given)
        assert stored == value and type(stored) is int, (name, given, stored)


@pytest.mark.parametrize("name", _INT_FIELDS)
def test_every_integer_field_refuses_a_fraction_by_name(name: str) -> None:
    value = VALID_INT.get(name, 10) + 0.5
    with pytest.raises(ValueError) as info:
        build(name, value)
    text = str(info.value)
    owner = f"{GROUPS[name.split('.')[0]].__name__}.{name.split('.')[1]}" if "." in name else f"MonitorConfig.{name}"
    assert f"{owner}={value!r} is invalid" in text and "whole number" in text


def test_whole_numbers_through_every_entry_point() -> None:
    assert Monitor(write_files=False, log_every_n_steps=np.int64(10)).config.log_every_n_steps == 10
    assert Monitor(write_files=False, config={"log_every_n_steps": 10.0}).config.log_every_n_steps == 10
    assert MonitorConfig(advanced={"overhead_budget": np.float32(0.5)}).advanced.overhead_budget == 0.5
    with pytest.raises(ValueError, match=r"log_every_n_steps=10.5 is invalid: it must be a whole number; pass an integer such as 10"):
        Monitor(write_files=False, log_every_n_steps=10.5)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="whole number"):
            MonitorConfig(log_every_n_steps=bad)
    with pytest.raises(ValueError, match="positive integer"):  # a string is still refused by the field's own check
        MonitorConfig(log_every_n_steps="10")


# ---------------------------------------------------------------------- keywords win over config=
def test_a_keyword_equal_to_its_default_wins_over_config() -> None:
    from memcallbacks import MemoryMonitor

    base = MonitorConfig(detect_leaks=False, leaks={"growth_warmup_steps": 9}, advanced={"prefix": "gpu"})
    for cls in (Monitor, MemoryMonitor):
        kwargs: dict[str, Any] = {"write_files": False} if cls is Monitor else {}
        config = cls(config=base, detect_leaks=True, leaks=LeakOptions(), **kwargs).config
        assert (config.detect_leaks, config.leaks.growth_warmup_steps, config.advanced.prefix) == (True, 4, "gpu"), cls
        assert cls(config=base, **kwargs).config.leaks.growth_warmup_steps == 9  # config= alone is kept
    # LightningCLI passes every field (the ones not in its YAML at their defaults): config's values stay
    every = {f: getattr(MonitorConfig(), f) for f in MonitorConfig.__dataclass_fields__}
    assert MemoryMonitor(config=base, **every).config.leaks.growth_warmup_steps == 9


# ---------------------------------------------------------------------- devices
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)], ids=["type", "index", "torch.device"])
def test_a_device_without_cuda_is_refused_at_construction(device: Any) -> None:
    with pytest.raises(ValueError) as info:
        Monitor(nn.Linear(2, 2), device=device, write_files=False)
    text = str(info.value)
    assert f"Monitor(device={device!r}) cannot be measured: no cuda device is available" in text
    assert "device='cpu'" in text and "leave device out" in text


def test_devices_that_exist_are_accepted() -> None:
    for device in ("cpu", torch.device("cpu"), "meta"):
        Monitor(write_files=False, device=device).close()


# ---------------------------------------------------------------------- nested track()
def test_nested_track_is_ignored_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="memcallbacks")
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False, sample_every_n_steps=1)
    epochs = [[torch.randn(2, 8) for _ in range(3)] for _ in range(4)]
    seen = 0
    for epoch in monitor.track(epochs):  # the outer loop's items are the training steps here
        for x in monitor.track(epoch):  # a nested track(): not rows of their own
            model(x).sum().backward()
            seen += 1
        optimizer.step()
        optimizer.zero_grad()
    # and after the outer loop, a new track() tracks again
    for x in monitor.track([torch.randn(2, 8) for _ in range(2)]):
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    assert seen == 12
    assert list(monitor.history["step"]) == list(range(6))  # 4 outer steps + 2, no row per inner item
    assert list(monitor.history["micro_batches"])[:4] == [1, 1, 1, 1]
    nested = [r for r in caplog.records if "inside a loop over another Monitor.track()" in r.getMessage()]
    assert len(nested) == 1


def test_track_after_a_broken_loop_is_not_nested() -> None:
    monitor = Monitor(nn.Linear(8, 1), write_files=False, sample_every_n_steps=1)
    for i, _ in enumerate(monitor.track(range(5))):
        if i == 1:
            break
    rows = list(monitor.track(range(3)))
    monitor.close()
    assert rows == [0, 1, 2] and len(monitor.history) == 5  # 2 rows of the broken loop, 3 of the new one


# ---------------------------------------------------------------------- load_state_dict({})
def test_load_state_dict_of_an_empty_dict_is_refused() -> None:
    monitor = Monitor(write_files=False)
    with pytest.raises(ValueError) as info:
        monitor.load_state_dict({})
    assert "Monitor.load_state_dict" in str(info.value) and "an empty dict" in str(info.value)
    with pytest.raises(ValueError, match="a dict with keys \\['model', 'optimizer'\\]"):
        monitor.load_state_dict({"model": {}, "optimizer": {}})  # the training checkpoint, not the monitor's state
    monitor.load_state_dict(Monitor(write_files=False).state_dict())  # a real state still loads
    monitor.close()


# ---------------------------------------------------------------------- estimate CLI
def exit_code(argv: list[str]) -> int:
    """What the ``memcallbacks`` command exits with (argparse's own errors leave by SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize("argv", [
    "--params 1e30",
    "--params inf",
    "--params 7e9 --world-sizes 8,,16",
    "--params 7e9 --world-sizes 8,",
    "--params 7e9 --strategies ddp,,zero3",
    "--params 7e9 --world-sizes 99999999999999999999",
    "--params 7e9 --grad-accum 1.5",
    "--params 7e9 --shard-group-size x",
    "--params 7e9 --ranks-per-node 0",
    "--params 7e9 --unit parsec",
    "--params 7e9 --no-such-flag",
    "--params",
])
def test_estimate_bad_input_is_one_line_and_exit_2(argv: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code(["estimate", *argv.split()]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memcallbacks estimate: error: "), err
    assert "invalid literal" not in err[0] and "Traceback" not in err[0]


def test_estimate_messages_name_the_flag_and_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    main("estimate --params 1e30".split())
    assert "--params '1e30' is more parameters than any model has" in capsys.readouterr().err
    main("estimate --params 7e9 --world-sizes 8,,16".split())
    assert "--world-sizes '8,,16' has an empty item" in capsys.readouterr().err
    exit_code("estimate --params 7e9 --grad-accum 1.5".split())
    assert capsys.readouterr().err.strip() == "memcallbacks estimate: error: --grad-accum '1.5' is not a whole number; pass e.g. --grad-accum 8"
    assert main("estimate --params 1e15 --world-sizes 8,16 --grad-accum 2".split()) == 0  # the limits are inclusive
