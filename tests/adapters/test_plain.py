"""The framework-free ``Monitor`` on real models, optimizers and files read back from disk.

CPU peaks are RSS high-water marks, so every check compares a phase's peak with the RSS at step
start (the ``reserved`` column); ``cpu_mmap_threshold=1 << 20`` makes freed temporaries go back to
the OS, so the peaks follow tensor lifetimes.
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn

from helpers import GIB, MIB, TemporaryNet, touch_temporary
from memcallbacks._base.columns import frame_column
from memcallbacks import Monitor, MonitorConfig
from memcallbacks._runtime.schedule import LINGERING_EVERY_STEP_UNTIL

TEMP_MIB = 64
CPU = dict(advanced={"cpu_mmap_threshold": 1 << 20}, sample_every_n_steps=1)
# earlier tests' garbage (cycles holding tensors) freed by a collection inside a phase would lower
# the RSS while a temporary raises it: collect before each test that compares a phase's bytes with a
# planted size (the tests of rows, hooks, keys and arguments read no bytes; a full collection is ~0.4 s
# a test in a full run's worker)
measures_bytes = pytest.mark.usefixtures("collected_heap")
CPU_KEYS = {
    "memory/allocated_GiB",
    "memory/reserved_GiB",
    "memory/peak_forward_GiB",
    "memory/peak_backward_GiB",
    "memory/peak_optimizer_GiB",
    "memory/peak_step_GiB",
    "memory/peak_reserved_GiB",
    "memory/max_allocated_GiB",
    "memory/host_rss_GiB",
    "memory/monitor_time_ms",
    "memory/overhead",
    "memory/peak_forward_above_start_GiB",
    "memory/peak_backward_above_start_GiB",
    "memory/peak_optimizer_above_start_GiB",
    "memory/peak_step_above_start_GiB",
}


def batches(n: int, dim: int = 32) -> list[torch.Tensor]:
    return list(torch.randn(n, 4, dim, generator=torch.Generator().manual_seed(0)))


def train(monitor: Monitor | None, model: nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor], mode: str, accumulate: int = 1) -> None:
    """One loop, three ways of marking steps: ``track`` (iterator), ``step`` (context manager), ``auto`` (hooks only)."""
    items = monitor.track(data) if mode == "track" else data
    for i, x in enumerate(items):
        ctx = monitor.step() if mode == "step" else nullcontext()
        with ctx:
            model(x).pow(2).mean().backward()
            if (i + 1) % accumulate == 0:
                optimizer.step()
                optimizer.zero_grad()


def manual_sgd_step(model: nn.Module, x: torch.Tensor) -> None:
    """Backward, then the weights updated by hand: no optimizer steps."""
    model(x).pow(2).mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
            p.grad = None


def above_start(history: pd.DataFrame, column: str) -> pd.Series:
    """MiB a phase's peak rose above the RSS at step start."""
    return (history[column] - history["reserved"]) / MIB


# ---------------------------------------------------------------------- phases
@measures_bytes
@pytest.mark.parametrize("mode", ["track", "step", "auto"])
def test_forward_temporary_lands_in_peak_forward(tmp_path: Any, mode: str) -> None:
    model = TemporaryNet(forward_mib=TEMP_MIB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, output_dir=str(tmp_path), plot=False, **CPU)
    train(monitor, model, optimizer, batches(4), mode)
    monitor.close()

    history = pd.read_csv(tmp_path / "history.csv")  # what was written, not what is in memory
    assert "peak_forward_bytes" in history  # the file's byte columns carry their unit
    history = history.rename(columns=frame_column)
    assert len(history) == 4
    assert list(history["step"]) == [0, 1, 2, 3]
    assert (history["optimizer_steps"] == 1).all()
    forward, backward = above_start(history, "peak_forward"), above_start(history, "peak_backward")
    assert (forward >= 0.85 * TEMP_MIB).all(), forward.tolist()
    assert (backward < 0.5 * TEMP_MIB).all(), backward.tolist()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["framework"] == "torch"
    assert report["summary"]["peak_forward_above_baseline_bytes"] >= 0.85 * TEMP_MIB * MIB


@measures_bytes
def test_backward_temporary_lands_in_peak_backward() -> None:
    model = TemporaryNet(backward_mib=TEMP_MIB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False, **CPU)
    train(monitor, model, optimizer, batches(3), "track")
    monitor.close()

    history = monitor.history
    assert len(history) == 3
    forward, backward = above_start(history, "peak_backward"), above_start(history, "peak_forward")
    assert (forward >= 0.85 * TEMP_MIB).all(), forward.tolist()
    assert (backward < 0.5 * TEMP_MIB).all(), backward.tolist()


@measures_bytes
def test_optimizer_state_creation_lands_in_peak_optimizer_on_step_zero() -> None:
    # 64 MiB of weights; SGD's momentum buffer (another 64 MiB) is created by the first step only
    model = nn.Linear(4096, 4096, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=False)
    monitor = Monitor(model, optimizer, write_files=False, **CPU)
    for x in monitor.track(list(torch.randn(3, 4, 4096))):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()

    h = monitor.history
    state_mib = 4096 * 4096 * 4 / MIB
    rise = (h["peak_optimizer"] - h["peak_backward"]) / MIB  # what the optimizer added on top of backward
    assert rise[0] >= 0.85 * state_mib, rise.tolist()
    assert (rise[1:] < 0.25 * state_mib).all(), rise.tolist()
    # the state stays: it is part of the next steps' baseline
    assert (h["reserved"][1] - h["reserved"][0]) / MIB >= 0.85 * state_mib


@measures_bytes
@measures_bytes
def test_explicit_step_and_phase_without_model() -> None:
    monitor = Monitor(write_files=False, **CPU)
    for _ in range(2):
        with monitor.step():
            with monitor.phase("forward"):
                touch_temporary(TEMP_MIB)
            with monitor.phase("backward"):
                touch_temporary(TEMP_MIB // 4)
            with monitor.phase("optimizer"):
                pass
    monitor.close()

    h = monitor.history
    assert len(h) == 2
    assert (above_start(h, "peak_forward") >= 0.85 * TEMP_MIB).all()
    backward = above_start(h, "peak_backward")
    assert ((backward >= 0.85 * TEMP_MIB / 4) & (backward < 0.5 * TEMP_MIB)).all(), backward.tolist()
    with pytest.raises(ValueError, match="Monitor.phase\\(name='loss'\\)"):
        with monitor.phase("loss"):
            pass


# ---------------------------------------------------------------------- steps and accumulation
def test_track_with_gradient_accumulation_counts_micro_batches() -> None:
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False, **CPU)
    train(monitor, model, optimizer, batches(12), "track", accumulate=2)
    monitor.close()

    h = monitor.history
    assert h["micro_batches"].sum() == 12
    assert h["optimizer_steps"].sum() == 6
    # once an optimizer step has been seen, every row is one optimizer step of two batches
    steady = h[h["batch_idx"] >= 2]
    assert list(steady["batch_idx"]) == [2, 4, 6, 8, 10]
    assert (steady["micro_batches"] == 2).all() and (steady["optimizer_steps"] == 1).all()
    assert steady[["peak_forward", "peak_backward", "peak_optimizer"]].notna().all().all()


def test_track_with_gradient_accumulation_first_window_is_one_row() -> None:
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False, **CPU)
    train(monitor, model, optimizer, batches(8), "track", accumulate=2)
    monitor.close()
    assert list(monitor.history["micro_batches"]) == [2, 2, 2, 2]


@pytest.mark.parametrize(
    "accumulate, n, micro_batches, optimizer_steps",
    [
        (2, 8, [2, 2, 2, 2], [1, 1, 1, 1]),
        (3, 9, [3, 3, 3], [1, 1, 1]),
        (3, 8, [3, 3, 2], [1, 1, 0]),  # the last, incomplete window is a row of its own
    ],
)
def test_track_accumulation_rows_and_logged_steps(accumulate: int, n: int, micro_batches: list[int], optimizer_steps: list[int]) -> None:
    calls: list[int] = []
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, lambda metrics, step: calls.append(step), log_every_n_steps=1, write_files=False, **CPU)
    train(monitor, model, optimizer, batches(n), "track", accumulate=accumulate)
    monitor.close()

    h = monitor.history
    rows = len(micro_batches)
    assert list(h["micro_batches"]) == micro_batches
    assert list(h["optimizer_steps"]) == optimizer_steps
    assert list(h["step"]) == list(range(rows))  # step i is the i-th optimizer step
    assert list(h["batch_idx"]) == [i * accumulate for i in range(rows)]
    assert calls == list(range(rows))
    assert h[["peak_forward", "peak_backward"]].notna().all().all()


def test_track_accumulation_logged_steps_when_only_logged_steps_are_sampled() -> None:
    # a sampling interval longer than the run: only logged steps are sampled, the others take the
    # fast path (watched only) and only count
    calls: list[int] = []
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, lambda metrics, step: calls.append(step), log_every_n_steps=2, sample_every_n_steps=1000, write_files=False, advanced={"cpu_mmap_threshold": 1 << 20})
    train(monitor, model, optimizer, batches(12), "track", accumulate=2)
    monitor.close()

    h = monitor.history
    assert calls == [1, 3, 5] and list(h["step"]) == [1, 3, 5]
    assert list(h["batch_idx"]) == [2, 6, 10]
    assert (h["micro_batches"] == 2).all() and (h["optimizer_steps"] == 1).all()
    assert monitor.summary()["steps_seen"] == 6  # unsampled windows counted as one step each


def test_track_close_inside_a_window_writes_its_row() -> None:
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False, **CPU)
    for i, x in enumerate(monitor.track(batches(12))):
        model(x).pow(2).mean().backward()
        if (i + 1) % 3 == 0:
            optimizer.step()
            optimizer.zero_grad()
        if i == 7:
            break  # the generator is left open: close() ends the window
    monitor.close()
    h = monitor.history
    assert list(h["micro_batches"]) == [3, 3, 2] and list(h["optimizer_steps"]) == [1, 1, 0]
    assert list(h["batch_idx"]) == [0, 3, 6]


def test_track_without_optimizer_argument_splits_only_the_first_window() -> None:
    # the optimizer's global hooks make it known at its first step only: a batch before that is a row
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, write_files=False, **CPU)
    train(monitor, model, optimizer, batches(8), "track", accumulate=2)
    monitor.close()
    h = monitor.history
    assert list(h["micro_batches"]) == [1, 1, 2, 2, 2] and list(h["optimizer_steps"]) == [0, 1, 1, 1, 1]


@pytest.mark.parametrize("loop", ["evaluation", "manual_sgd"])
def test_track_loop_without_optimizer_gives_a_row_per_batch(loop: str) -> None:
    model = TemporaryNet()
    monitor = Monitor(model, write_files=False, **CPU)
    for x in monitor.track(batches(5)):
        if loop == "evaluation":
            with torch.no_grad():
                model(x)
        else:
            manual_sgd_step(model, x)
    monitor.close()
    h = monitor.history
    assert list(h["micro_batches"]) == [1] * 5 and list(h["optimizer_steps"]) == [0] * 5
    assert list(h["step"]) == list(range(5))


def test_track_optimizer_that_never_steps_is_bounded() -> None:
    # an optimizer was given but the loop updates the weights by hand: after max_micro_batches
    # batches without a step the window is closed, then every batch is a row of its own
    calls: list[int] = []
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, lambda metrics, step: calls.append(step), log_every_n_steps=1, write_files=False, **CPU)
    assert monitor.max_micro_batches == 256
    for x in monitor.track(list(torch.randn(300, 4, 8))):
        manual_sgd_step(model, x)
    monitor.close()
    h = monitor.history
    assert list(h["micro_batches"]) == [256] + [1] * 44
    assert (h["optimizer_steps"] == 0).all()
    assert list(h["step"]) == list(range(45)) and calls == list(range(45))


def test_track_idle_optimizer_then_accumulation_resumes() -> None:
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False, **CPU)
    monitor.max_micro_batches = 4
    for i, x in enumerate(monitor.track(batches(14))):
        model(x).pow(2).mean().backward()
        if i >= 6 and i % 2 == 1:  # no step for 7 batches, then one every 2 batches
            optimizer.step()
            optimizer.zero_grad()
    monitor.close()
    h = monitor.history
    # 0-3: the idle window, closed at 4 batches; 4, 5, 6: a row each; 7: the first step; then pairs
    assert list(h["micro_batches"]) == [4, 1, 1, 1, 1, 2, 2, 2]
    assert list(h["optimizer_steps"]) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert list(h["batch_idx"]) == [0, 4, 5, 6, 7, 8, 10, 12]


def test_track_accumulation_longer_than_max_micro_batches_is_learned() -> None:
    # the first window is split at max_micro_batches; its length, known at the first step, then
    # raises the bound (to twice the longest window), so later windows are one row each
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False, **CPU)
    monitor.max_micro_batches = 3
    train(monitor, model, optimizer, batches(16), "track", accumulate=4)
    monitor.close()
    h = monitor.history
    assert list(h["micro_batches"]) == [3, 1, 4, 4, 4]
    assert list(h["optimizer_steps"]) == [0, 1, 1, 1, 1]


def test_track_without_optimizer_gives_a_row_per_item() -> None:
    model = TemporaryNet()
    monitor = Monitor(model, write_files=False, **CPU)
    for x in monitor.track(batches(3)):
        model(x).sum().backward()
    monitor.close()
    h = monitor.history
    assert list(h["micro_batches"]) == [1, 1, 1] and list(h["optimizer_steps"]) == [0, 0, 0]


@measures_bytes
def test_auto_mode_rows_per_optimizer_step() -> None:
    model = TemporaryNet(forward_mib=TEMP_MIB // 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = Monitor(model, optimizer, write_files=False, **CPU)
    train(monitor, model, optimizer, batches(6), "auto", accumulate=2)
    with torch.no_grad():  # evaluation forwards do not open steps
        model.eval()
        model(batches(1)[0])
    monitor.close()

    h = monitor.history
    assert list(h["step"]) == [0, 1, 2]
    assert (h["optimizer_steps"] == 1).all()
    assert (above_start(h, "peak_forward") >= 0.85 * TEMP_MIB / 2).all()


@measures_bytes
def test_evaluate_is_recorded_apart_from_training() -> None:
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False, **CPU)
    train(monitor, model, optimizer, batches(2), "track")
    with monitor.evaluate(), torch.no_grad():
        touch_temporary(TEMP_MIB)
        model(batches(1)[0])
    monitor.close()
    assert len(monitor.history) == 2
    ev = monitor.eval_history
    assert list(ev["stage"]) == ["validate"]
    assert (ev["peak_reserved"][0] - ev["host_rss"][0]) / MIB >= 0.85 * TEMP_MIB  # RSS peak above RSS at the start


# ---------------------------------------------------------------------- logging
@measures_bytes
def test_log_fn_gets_documented_keys_on_logged_steps() -> None:
    calls: list[tuple[int, dict[str, float]]] = []
    model = TemporaryNet(forward_mib=TEMP_MIB // 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, lambda metrics, step: calls.append((step, metrics)), log_every_n_steps=2, write_files=False,
                      log_keys="all", advanced={"cpu_mmap_threshold": 1 << 20})
    train(monitor, model, optimizer, batches(6), "track")
    monitor.close()

    assert [step for step, _ in calls] == [1, 3, 5]
    h = monitor.history.set_index("step")
    assert {1, 3, 5} <= set(h.index)  # logged steps are always sampled (at defaults the first steps too: they measure the cost)
    for step, metrics in calls:
        assert CPU_KEYS <= set(metrics)  # leak detection adds its own keys (memory/findings, ...)
        assert all(key.startswith("memory/") for key in metrics)
        assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
        assert metrics["memory/peak_forward_GiB"] == pytest.approx(h.loc[step, "peak_forward"] / GIB)
        assert metrics["memory/peak_step_GiB"] == pytest.approx(h.loc[step, "peak_allocated"] / GIB)
        rise = (metrics["memory/peak_forward_GiB"] - metrics["memory/reserved_GiB"]) * GIB / MIB
        assert rise >= 0.85 * TEMP_MIB / 2
        # the rise above the step's start, logged as such: the peak less the resident memory at the step's start on CPU
        for phase in ("forward", "backward", "optimizer", "step"):
            peak = metrics[f"memory/peak_{phase}_GiB"] - metrics["memory/reserved_GiB"]
            assert metrics[f"memory/peak_{phase}_above_start_GiB"] == pytest.approx(max(peak, 0.0), abs=1e-12)


def test_prefix_renames_every_key() -> None:
    calls: list[dict[str, float]] = []
    monitor = Monitor(log_fn=lambda m, s: calls.append(m), log_every_n_steps=1, write_files=False, advanced={"prefix": "mem/train"})
    with monitor.step():
        pass
    monitor.close()
    assert calls and all(key.startswith("mem/train/") for key in calls[0])


# ---------------------------------------------------------------------- failures and cleanup
@measures_bytes
def test_oom_inside_step_writes_report_and_propagates(tmp_path: Any) -> None:
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, output_dir=str(tmp_path), plot=False, sample_every_n_steps=1)
    with monitor.step():
        model(batches(1)[0]).sum().backward()
        optimizer.step()
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        with monitor.step():
            model(batches(1)[0])
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")

    report = json.loads((tmp_path / "report.json").read_text())
    (event,) = report["events"]
    assert event["kind"] == "oom" and event["step"] == 1 and "CUDA out of memory" in event["error"]
    assert event["max_reserved_bytes"] > 0
    assert len(pd.read_csv(tmp_path / "history.csv")) >= 1
    monitor.close()
    monitor.close()


def test_non_oom_exception_propagates_as_an_exception_event() -> None:
    monitor = Monitor(write_files=False)
    with pytest.raises(KeyError):
        with monitor.step():
            raise KeyError("not memory")
    monitor.close()
    assert [(e["kind"], e["error"]) for e in monitor.events] == [("exception", "KeyError: 'not memory'")]


def test_close_twice_removes_every_hook() -> None:
    from torch.optim import optimizer as optim_module

    pre_hooks = len(optim_module._global_optimizer_pre_hooks)
    post_hooks = len(optim_module._global_optimizer_post_hooks)
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False, **CPU)
    assert len(optim_module._global_optimizer_pre_hooks) == pre_hooks + 1
    train(monitor, model, optimizer, batches(2), "track")
    monitor.close()
    monitor.close()
    assert len(optim_module._global_optimizer_pre_hooks) == pre_hooks
    assert len(optim_module._global_optimizer_post_hooks) == post_hooks
    assert not model._forward_pre_hooks and not model._forward_hooks
    rows = len(monitor.history)
    train(None, model, optimizer, batches(2), "auto")  # training after close leaves the history alone
    assert len(monitor.history) == rows


def test_context_manager_closes() -> None:
    model = TemporaryNet()
    with Monitor(model, write_files=False):
        model(batches(1)[0])
    assert not model._forward_pre_hooks


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(model=3), TypeError, r"Monitor\(model=int\) must be a torch.nn.Module"),
        (dict(optimizer="sgd"), TypeError, r"Monitor\(optimizer=str\) must be a torch optimizer"),
        (dict(log_fn=5), TypeError, r"Monitor\(log_fn=5\) must be callable"),
        (dict(log_every=3), TypeError, r"unexpected keyword argument\(s\): 'log_every' \(did you mean 'log_every_n_steps'\?\)"),
        (dict(log_every_n_steps=0), ValueError, r"MonitorConfig.log_every_n_steps=0 is invalid"),
        (dict(config=42), TypeError, r"Monitor\(config=42\) must be a MonitorConfig"),
    ],
)
def test_invalid_arguments_raise_clear_errors(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Monitor(**kwargs)


def test_accepts_every_config_field_as_keyword() -> None:
    import dataclasses

    fields = {f.name: getattr(MonitorConfig(), f.name) for f in dataclasses.fields(MonitorConfig)}
    monitor = Monitor(**{**fields, "write_files": False})
    assert monitor.config == MonitorConfig(**{**fields, "write_files": False})
    monitor.close()


@pytest.mark.parametrize("mode", ["track", "step"])
def test_forward_hooks_only_on_steps_that_use_them(mode) -> None:
    # any module hook sends every forward through torch's slower hooked call path: under track() /
    # step() the model's hooks are on for sampled steps, the first steps (lingering marks) and the
    # step after a marked one, and off otherwise; auto mode keeps them (they open the steps)
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False, log_every_n_steps=10, sample_every_n_steps=10)  # steps 9, 19, ... sampled
    seen: list[bool] = []
    items = monitor.track(batches(40)) if mode == "track" else batches(40)
    for x in items:
        with monitor.step() if mode == "step" else nullcontext():
            seen.append(bool(model._forward_pre_hooks) and bool(model._forward_hooks))
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    monitor.close()
    assert not model._forward_pre_hooks and not model._forward_hooks
    # the first 10 steps are marked (LINGERING_EVERY_STEP_UNTIL); sampled steps 19, 29 and 39 measure phases (after
    # step 10 only every MARK_EVERY_SAMPLES-th sampled step is marked: not these). Under track() the step after a
    # marked one checks the marks at its first forward (the caller's loop variable holds the previous batch until
    # then), so step 10 keeps the hooks; step() checks when it opens.
    after_marked = mode == "track"
    assert LINGERING_EVERY_STEP_UNTIL == 10
    assert all(seen[:10]) and seen[10] == after_marked
    assert not any(seen[11:19]) and seen[19] and not any(seen[20:29]) and seen[29] and not any(seen[30:39]) and seen[39]
    assert list(monitor.history["step"]) == [1, 9, 19, 29, 39]  # step 1: the theory check's sample
    assert (monitor.history["peak_forward"] == monitor.history["peak_forward"]).all()  # measured where sampled


def test_auto_mode_keeps_its_forward_hooks() -> None:
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False, log_every_n_steps=10, sample_every_n_steps=10)
    for x in batches(30):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert model._forward_pre_hooks
    monitor.close()
    assert len(monitor.history) == 4


def test_log_fn_gets_the_short_list_at_defaults() -> None:
    """On CPU the default list has what each phase rose above the step's start in place of its peak
    (the peaks are one resident high-water mark): per-phase figures that differ, a forward temporary in forward's."""
    calls: list[dict[str, float]] = []
    model = TemporaryNet(forward_mib=TEMP_MIB // 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, lambda metrics, step: calls.append(metrics), log_every_n_steps=2, write_files=False)
    train(monitor, model, optimizer, batches(6), "track")
    monitor.close()
    assert len(calls) == 3 and all(len(metrics) <= 8 for metrics in calls)
    assert set().union(*calls) == {"memory/peak_forward_above_start_GiB", "memory/peak_backward_above_start_GiB",
                                   "memory/peak_optimizer_above_start_GiB", "memory/reserved_GiB",
                                   "memory/allocated_GiB", "memory/findings", "memory/host_rss_GiB"}
    first = calls[0]
    assert first["memory/peak_forward_above_start_GiB"] * GIB >= 0.85 * TEMP_MIB / 2 * MIB, first
    assert first["memory/peak_forward_above_start_GiB"] > first["memory/peak_backward_above_start_GiB"], first
