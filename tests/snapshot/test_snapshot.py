"""Snapshots: CPU capture with the real profiler, memory_viz's format, offline summary/render, the CLI, CUDA history."""

from __future__ import annotations

import gc
import importlib.util
import inspect
import os
import pickle
import pickletools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memcallbacks._base import torch_private as _torch_private
from memcallbacks.cli import main
from memcallbacks.snapshot import (
    CPU_SNAPSHOT_FILE,
    META_KEY,
    CpuCapture,
    EmptySnapshotError,
    SnapshotError,
    SnapshotTooLarge,
    cpu_events_to_snapshot,
    dump_on_oom,
    dump_snapshot,
    format_summary,
    load_snapshot,
    render_snapshot,
    snapshot_file_name,
    snapshot_size,
    start_recording,
    stop_recording,
    summarize_snapshot,
    time_mark,
    validate_snapshot,
    write_snapshot,
)

MIB = 2**20
DATA = Path(__file__).parents[1] / "data"
CUDA_LIKE = DATA / "cuda_like_snapshot.pickle"
ROOT = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------------------------
# A real CPU training loop with a planted 32 MiB buffer that stays alive
# ----------------------------------------------------------------------------------------------

KEPT: list[torch.Tensor] = []


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = torch.randn(32, 128), torch.randint(0, 10, (32,))
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step == 1:
        KEPT.append(torch.ones(32 * MIB, dtype=torch.uint8))  # planted: alive until the end


PLANTED_LINE = next(
    i for i, text in enumerate(inspect.getsourcelines(_train_step)[0], inspect.getsourcelines(_train_step)[1]) if "# planted" in text
)
PLANTED_SITE = f"test_snapshot.py:{PLANTED_LINE} in _train_step"


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _capture(steps: int, **kwargs: Any) -> CpuCapture:
    model, opt = _model()
    capture = CpuCapture(steps=steps, **kwargs)
    capture.start(step=0)
    for step in range(steps):
        _train_step(model, opt, step)
        finished = capture.step()
        assert finished == (step == steps - 1)
    return capture


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("cpu_capture")
    KEPT.clear()
    gc.collect()  # earlier tests' trainers (cycles) would otherwise crowd the census's largest tensors
    capture = _capture(3, out_dir=out)
    paths = capture.write()
    yield {"capture": capture, "paths": paths, "out": out}
    KEPT.clear()


# ----------------------------------------------------------------------------------------------
# What memory_viz needs: its unpickler's opcodes and the invariants its views rely on
# ----------------------------------------------------------------------------------------------

# every opcode the JavaScript unpickler in torch/utils/viz/MemoryViz.js handles
JS_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWTRUE", "NEWFALSE",
    "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE",
}


def assert_memory_viz_readable(path: Path) -> dict[str, Any]:
    """The file is protocol <= 4, uses only the opcodes memory_viz's unpickler knows, and its views' invariants hold."""
    raw = path.read_bytes()
    ops = {op.name for op, _, _ in pickletools.genops(raw)}
    assert ops <= JS_OPCODES, f"opcodes memory_viz cannot read: {ops - JS_OPCODES}"
    proto = next(arg for op, arg, _ in pickletools.genops(raw) if op.name == "PROTO")
    assert 2 <= proto <= 4
    snapshot = pickle.loads(raw)
    check_memory_viz_invariants(snapshot)
    return snapshot


def check_memory_viz_invariants(snapshot: dict[str, Any]) -> None:
    """What MemoryViz.js's annotate_snapshot / MemoryView / process_alloc_data assume, replayed in Python."""
    for seg in snapshot["segments"]:
        for key in ("device", "address", "total_size", "stream", "blocks"):
            assert key in seg, key
        addr = seg["address"]
        for b in seg["blocks"]:  # the viewer recomputes block addresses by walking the segment
            assert b.get("address", addr) == addr
            assert b["state"] in ("active_allocated", "active_pending_free", "inactive")
            if b["state"] != "inactive":
                assert {"size", "requested_size", "frames"} <= set(b)
            addr += b["size"]
        assert addr - seg["address"] == seg["total_size"], "blocks must tile their segment"
    for device, trace in enumerate(snapshot["device_traces"]):
        merged: list[dict[str, Any]] = []
        for e in trace:  # annotate_snapshot elides free_requested + free_completed into one 'free'
            assert "action" in e and "size" in e and "stream" in e
            for f in e.get("frames", []):
                assert isinstance(f["filename"], str) and isinstance(f["line"], int) and isinstance(f["name"], str)
            if e["action"] == "free_completed" and merged and merged[-1]["action"] == "free_requested" and merged[-1]["addr"] == e["addr"]:
                merged[-1] = {**merged[-1], "action": "free"}
                continue
            merged.append(e)
        segments = [[s["address"], s["total_size"]] for s in snapshot["segments"] if s["device"] == device]
        blocks = {}
        for s in snapshot["segments"]:
            if s["device"] != device:
                continue
            addr = s["address"]
            for b in s["blocks"]:
                if b["state"] != "inactive":
                    blocks[addr] = b["size"]
                addr += b["size"]

        def inside(addr: int) -> bool:
            return any(start <= addr < start + size for start, size in segments)

        for i in range(len(merged) - 1, -1, -1):  # MemoryView.simulate_memory, back from the end
            assert all(inside(a) for a in blocks), f"device {device}: a live block lies outside every segment before event {i + 1}"
            e = merged[i]
            action = e["action"]
            if action in ("free", "free_completed"):
                blocks[e["addr"]] = e["size"]
            elif action == "free_requested":
                assert e["addr"] in blocks, "free_requested of a block the viewer does not know"
            elif action == "alloc":
                blocks.pop(e["addr"], None)
            elif action in ("segment_free", "segment_unmap"):
                segments.append([e["addr"], e["size"]])
            elif action in ("segment_alloc", "segment_map"):
                segments[:] = [s for s in segments if s[0] != e["addr"]]


def run_torch_memory_viz(snapshot: dict[str, Any]) -> None:
    """torch's own snapshot tools accept it (flamegraph formatting replaced: it downloads a script)."""
    from torch.cuda import _memory_viz as mv

    text = lambda lines: lines  # noqa: E731
    assert "total_reserved" in mv.segsum(snapshot)
    assert "entries" in mv.trace(snapshot)
    assert ";" in mv.memory(snapshot, format_flamegraph=text)
    assert ";" in mv.segments(snapshot, format_flamegraph=text)
    mv.compare(snapshot["segments"], snapshot["segments"], format_flamegraph=text)
    for page in (mv.trace_plot(snapshot), mv.segment_plot(snapshot), mv.trace_plot(snapshot, plot_segments=True)):
        assert "snapshot.pickle" in page
    mv.filter_alloc_free_pairs(pickle.loads(pickle.dumps(snapshot)))


def assert_offline_html(path: Path) -> str:
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>")
    lowered = text.lower()
    for needle in ("http://", "https://", "<script", "<link", "@import", "url("):
        assert needle not in lowered, needle
    return text


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------------
# CPU capture
# ----------------------------------------------------------------------------------------------


def test_cpu_capture_writes_pickle_census_html_and_png(cpu_run: dict[str, Any]) -> None:
    paths = cpu_run["paths"]
    assert paths["snapshot"].name == snapshot_file_name(CPU_SNAPSHOT_FILE, 0) == "memory_snapshot_cpu_step0.pickle"
    assert set(paths) == {"snapshot", "census", "html", "png"}
    assert all(p.is_file() for p in paths.values())
    assert is_png(paths["png"])
    text = assert_offline_html(paths["html"])
    assert PLANTED_SITE in text
    assert 'src="data:image/png;base64,' in text
    census = __import__("json").loads(paths["census"].read_text())
    assert census["bytes_by_category"]["parameters"] > 0
    assert any(r["nbytes"] == 32 * MIB for r in census["records"])
    assert snapshot_size(paths["snapshot"]) == paths["snapshot"].stat().st_size > 0
    assert snapshot_size(cpu_run["out"] / "missing.pickle") == 0


def test_cpu_summary_names_the_planted_buffer_with_its_frame(cpu_run: dict[str, Any]) -> None:
    snapshot = load_snapshot(cpu_run["paths"]["snapshot"])
    summary = summarize_snapshot(snapshot, source="cpu")
    (d,) = summary.devices
    assert d.entries > 50 and d.allocs > 20 and d.frees > 20
    assert [label for _, label in d.marks] == ["capture start (before step 0)", "after step 0", "after step 1", "after step 2"]
    # the default window skips the first (warm-up) step: Adam's state is not reported as staying alive
    assert d.window_labels[0].startswith("after step 0") and d.window_labels[1].startswith("after step 2")
    top = d.stayed_alive[0]
    assert top.site == PLANTED_SITE and top.bytes == 32 * MIB and top.count == 1
    assert d.stayed_alive_bytes == 32 * MIB, [(r.site, r.bytes) for r in d.stayed_alive]
    assert "aten::ones" in top.what and "held by" in top.what and "KEPT" in top.what
    assert d.largest_at_peak[0].size == 32 * MIB and d.largest_at_peak[0].site == PLANTED_SITE
    assert d.peak >= 32 * MIB and d.end >= 32 * MIB
    # parameters predate the capture: the census puts them in the end state without a stack
    assert any(a.index is None and "parameters" in a.what for a in d.largest_at_peak)
    text = format_summary(summary)
    assert PLANTED_SITE in text and "stayed alive" in text and "32.0 MiB" in text


def test_cpu_snapshot_is_what_memory_viz_reads(cpu_run: dict[str, Any]) -> None:
    snapshot = assert_memory_viz_readable(cpu_run["paths"]["snapshot"])
    meta = snapshot[META_KEY]
    assert meta["kind"] == "cpu_profiler" and meta["dropped_entries"] == 0 and meta["synthetic_segments"]
    (trace,) = snapshot["device_traces"]
    assert {e["action"] for e in trace} == {"alloc", "free_requested", "free_completed"}
    assert all(e.get("time_us", 0) > 0 for e in trace)
    planted = [e for e in trace if e["action"] == "alloc" and e["size"] == 32 * MIB]
    assert len(planted) == 1
    frames = planted[0]["frames"]
    assert frames[0] == {"filename": "<torch op>", "line": 0, "name": "aten::ones"}
    assert frames[1]["line"] == PLANTED_LINE and frames[1]["name"] == "_train_step"
    assert frames[1]["filename"].endswith("test_snapshot.py")
    alive = [b for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert any(b["size"] == 32 * MIB and b["frames"] is frames for b in alive)
    run_torch_memory_viz(snapshot)


def test_cpu_capture_is_bounded_and_says_so(tmp_path: Path) -> None:
    capture = _capture(1, max_entries=40, census=False)
    snapshot = capture.snapshot
    assert snapshot is not None and capture.census is None
    trace = snapshot["device_traces"][0]
    assert 0 < len(trace) <= 40
    assert trace[0]["action"] != "free_completed"  # a free pair is never split by the cut
    meta = snapshot[META_KEY]
    assert meta["dropped_entries"] > 0 and meta["max_entries"] == 40
    assert any("dropped" in n for n in meta["notes"])
    path = write_snapshot(snapshot, tmp_path / "bounded.pickle")
    assert_memory_viz_readable(path)
    assert "dropped" in format_summary(summarize_snapshot(load_snapshot(path)))


def test_cpu_capture_lifecycle_stop_early_close_twice(tmp_path: Path) -> None:
    capture = CpuCapture(steps=5, out_dir=tmp_path, census=False, with_stack=False, record_shapes=False)
    assert not capture.active and not capture.finished and capture.step() is False
    capture.stop()  # not running: nothing to do
    with pytest.raises(RuntimeError, match="has not finished"):
        capture.write()
    model, opt = _model()
    capture.start(step=7, reason="test trigger")
    with pytest.raises(RuntimeError, match="already running"):
        capture.start()
    _train_step(model, opt, 0)
    assert capture.step() is False and capture.active
    capture.stop()
    assert capture.finished and not capture.active and capture.step() is False
    meta = capture.snapshot[META_KEY]
    assert meta["steps"] == 1 and meta["first_step"] == 7 and meta["trigger"]["reason"] == "test trigger"
    assert any("stopped early, after 1 of 5 steps" in n for n in meta["notes"])
    # without Python stacks, frames name only the op
    frames = [e["frames"] for e in capture.snapshot["device_traces"][0] if e["frames"]]
    assert frames and all(f[0]["filename"] == "<torch op>" and len(f) == 1 for f in frames)
    summary = summarize_snapshot(capture.snapshot)
    assert summary.devices[0].trigger is not None and summary.devices[0].trigger[1] == "test trigger"
    assert all("(no Python stack)" in r.site for r in summary.devices[0].sites_at_peak)
    paths = capture.write(render=False)
    assert set(paths) == {"snapshot"} and paths["snapshot"].name == "memory_snapshot_cpu_step7.pickle"
    capture.close()
    capture.close()
    # a capture can be closed while running, and the profiler is free again afterwards
    second = CpuCapture(steps=2, census=False)
    second.start()
    second.close()
    second.close()
    assert not second.active and not second.finished


def test_cpu_capture_refuses_to_start_inside_another_profiler() -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="another torch.profiler"):
            CpuCapture(steps=1, census=False).start()


def test_capture_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="steps=0"):
        CpuCapture(steps=0)
    with pytest.raises(ValueError, match="max_entries=-1"):
        CpuCapture(max_entries=-1)


def _event(t: int, ptr: int, nbytes: int, line: int = 10, device: str = "cpu") -> _torch_private.ProfilerAllocation:
    return _torch_private.ProfilerAllocation(t, ptr, nbytes, device, 0, "aten::empty", (("train.py", line, "step"),))


def test_cpu_conversion_pairs_frees_keeps_the_newest_entries_and_adds_census_blocks() -> None:
    base = 0x7F00_0000_0000
    events = [
        _event(1_000, base, 4096, 11),
        _event(2_000, base + 8192, 1024, 12),
        _event(3_000, base, -4096, 13),
        _event(4_000, base + 0x4000_0000, 2 * MIB, 14),  # far away: its own segment
        _event(5_000, base + 16384, 512, 15),
        _event(6_000, base + 16384, -512, 16),
        _event(7_000, base + 99, 8, device="cuda"),  # not CPU: ignored and counted
    ]
    holders = {base + 0x100_0000: {"nbytes": 256, "shape": "64 float32", "category": "parameters", "holder": None, "path": None}}
    snap = cpu_events_to_snapshot(events, marks=[("start", 500), ("after step 1", 3_500)], max_entries=6, holders=holders)
    trace = snap["device_traces"][0]
    # 8 entries in all (4 allocs, 2 frees as pairs); cutting to 6 drops the two oldest allocs
    assert [e["action"] for e in trace] == ["free_requested", "free_completed", "alloc", "alloc", "free_requested", "free_completed"]
    assert [e["addr"] - base for e in trace] == [0, 0, 0x4000_0000, 16384, 16384, 16384]
    assert [e["frames"][1]["line"] for e in trace] == [13, 13, 14, 15, 16, 16]
    meta = snap[META_KEY]
    assert meta["dropped_entries"] == 2 and meta["events_other_devices"] == 1
    assert [(m["label"], m["index"]) for m in meta["marks"]] == [("start", 0), ("after step 1", 2)]
    alive = sorted((b["address"] - base, b["size"], bool(b["frames"])) for s in snap["segments"] for b in s["blocks"] if b["state"] != "inactive")
    # the 1 KiB block's alloc was dropped, but it is alive at the end with its stack
    assert alive == [(8192, 1024, True), (0x100_0000, 256, False), (0x4000_0000, 2 * MIB, True)]
    assert len(snap["segments"]) == 3  # more than 1 MiB apart: separate synthetic segments
    assert meta["holders"] == {base + 0x100_0000: {"shape": "64 float32", "category": "parameters", "holder": None, "path": None}}
    check_memory_viz_invariants(snap)
    d = summarize_snapshot(snap).devices[0]
    # before the kept trace: the blocks it never saw allocated, and the one it sees freed
    assert d.baseline == 1024 + 256 + 4096
    assert d.end == 1024 + 256 + 2 * MIB and d.peak == d.end + 512
    assert d.largest_at_peak[0].site == "train.py:14 in step" and d.largest_at_peak[0].what == "aten::empty"


def _load_builder() -> Any:
    spec = importlib.util.spec_from_file_location("make_cuda_like_snapshot", DATA / "make_cuda_like_snapshot.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_shipped_cuda_like_snapshot_is_what_its_builder_makes() -> None:
    builder = _load_builder()
    assert pickle.loads(CUDA_LIKE.read_bytes()) == builder.build()
    snap = assert_memory_viz_readable(CUDA_LIKE)
    assert set(snap) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
    actions = {e["action"] for e in snap["device_traces"][0]}
    assert actions == {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom"}
    run_torch_memory_viz(snap)


def test_cuda_like_snapshot_summary() -> None:
    builder = _load_builder()
    summary = summarize_snapshot(load_snapshot(CUDA_LIKE), source=str(CUDA_LIKE))
    (d,) = summary.devices
    leak = f"train.py:{builder.LEAK_LINE} in train_step"
    assert d.stayed_alive[0].site == leak and d.stayed_alive[0].bytes == 32 * MIB
    assert d.largest_at_peak[0].site == leak
    assert d.sites_at_peak[0].site == leak and d.sites_at_peak[0].callers[0] == "train.py:90 in main"
    assert d.ooms == [(len(d.allocated) - 2, 80 * 2**30, 2**30)] and d.trigger == (d.ooms[0][0], "out of memory")
    assert d.baseline == 2 * 4 * MIB + 2 * 4096  # parameters, allocated before history was on
    assert d.reserved is not None and d.reserved_end == int(d.reserved[-1]) == 74 * MIB
    assert int(d.reserved[0]) == 22 * MIB and (d.reserved[1:] < d.reserved[:-1]).any()  # empty_cache gave a segment back
    assert any(a.pending_free for r in [d.largest_at_peak] for a in r) or any("waiting" in r.what for r in d.stayed_alive)
    # torch-internal frames never name a site
    assert all("site-packages/torch" not in r.site_file for r in d.sites_at_peak)
    text = format_summary(summary)
    for needle in (leak, "OUT OF MEMORY", "80.0 GiB requested", "reserved at the end", "stayed alive"):
        assert needle in text


def test_cuda_like_snapshot_with_step_marks_from_dump_metadata() -> None:
    snap = load_snapshot(CUDA_LIKE)
    times = [e["time_us"] for e in snap["device_traces"][0]]
    snap[META_KEY] = {"marks": [{"label": f"step {i}", "time_us": times[k]} for i, k in enumerate((0, 30, 60))],
                      "trigger": {"reason": "threshold", "time_us": times[-1] + 1}}
    d = summarize_snapshot(snap).devices[0]
    assert [m[0] for m in d.marks] == [1, 31, 61]
    assert d.window == (31, 61)  # from the second mark (after the warm-up step) to the last
    assert d.trigger == (len(times), "threshold")
    assert summarize_snapshot(snap, window=(0, len(times)), trigger=5).devices[0].trigger == (5, "trigger")


def test_older_snapshot_formats_are_read(tmp_path: Path) -> None:
    """torch versions before 2.1: no time_us, no block address/frames/requested_size (a 'history' list), no device."""
    snap = load_snapshot(CUDA_LIKE)
    for seg in snap["segments"]:
        seg.pop("device")
        seg.pop("is_expandable")
        for b in seg["blocks"]:
            b.pop("address")
            frames, requested = b.pop("frames"), b.pop("requested_size")
            if b["state"] != "inactive":
                b["history"] = [{"addr": 0, "real_size": requested, "frames": frames}]
    for e in snap["device_traces"][0]:
        e.pop("time_us")
    d = summarize_snapshot(snap).devices[0]
    assert d.stayed_alive[0].bytes == 32 * MIB and d.time_us is None
    segments_only = [dict(s) for s in load_snapshot(CUDA_LIKE)["segments"]]
    path = tmp_path / "segments_only.pickle"
    path.write_bytes(pickle.dumps(segments_only, protocol=4))  # what torch.cuda.memory_snapshot() returns
    d2 = summarize_snapshot(load_snapshot(path)).devices[0]
    assert d2.entries == 0 and d2.largest_at_peak[0].size == 32 * MIB
    assert "no trace" in format_summary(summarize_snapshot(load_snapshot(path)))
    written = render_snapshot(load_snapshot(path), tmp_path / "segments_only.html")
    assert_offline_html(written["html"])


def test_render_cuda_like_snapshot_with_and_without_matplotlib(tmp_path: Path) -> None:
    written = render_snapshot(load_snapshot(CUDA_LIKE), tmp_path / "out.html", source=str(CUDA_LIKE))
    assert is_png(written["png"]) and written["png"] == tmp_path / "out.png"
    text = assert_offline_html(written["html"])
    for needle in ("Largest live allocations at the peak", "Allocated but not freed", "train.py:55 in train_step", "out of memory"):
        assert needle in text
    svg_only = render_snapshot(load_snapshot(CUDA_LIKE), tmp_path / "svg.html", png=False)
    assert set(svg_only) == {"html"} and not (tmp_path / "svg.png").exists()
    assert "<svg" in assert_offline_html(svg_only["html"])


def test_long_trace_gets_a_zoom_panel_and_stays_fast(tmp_path: Path) -> None:
    events = []
    for i in range(3000):
        events.append(_event(2 * i, 0x5000_0000 + 4096 * (i % 50), 4096 if i % 2 == 0 else -4096))
    snap = cpu_events_to_snapshot(events, max_entries=100_000)
    snap[META_KEY]["trigger"] = {"reason": "leak", "index": 2000}
    written = render_snapshot(snap, tmp_path / "long.html")
    assert is_png(written["png"]) and "leak at entry 2000" in written["html"].read_text()


# ----------------------------------------------------------------------------------------------
# Writing: atomic, protocol 4, within a byte budget
# ----------------------------------------------------------------------------------------------


def test_write_snapshot_respects_the_byte_budget(tmp_path: Path) -> None:
    snap = load_snapshot(CUDA_LIKE)
    path = tmp_path / "s.pickle"
    with pytest.raises(SnapshotTooLarge, match="max_bytes=100"):
        write_snapshot(snap, path, max_bytes=100)
    with pytest.raises(SnapshotTooLarge, match="no snapshot byte budget left"):
        write_snapshot(snap, path, max_bytes=0)
    assert list(tmp_path.iterdir()) == []  # no file, no temporary left behind
    write_snapshot(snap, path, max_bytes=10 * MIB)
    assert pickle.loads(path.read_bytes()) == snap
    assert next(pickletools.genops(path.read_bytes()))[1] == 4


def test_metadata_is_plain_data() -> None:
    snap = cpu_events_to_snapshot([_event(1, 0x1000, 64)], metadata={"torch": torch.__version__, "n": torch.tensor(3).item()})
    raw = pickle.dumps(snap, protocol=4)
    assert {op.name for op, _, _ in pickletools.genops(raw)} <= JS_OPCODES  # no classes, e.g. TorchVersion
    mark = time_mark("step 3")
    assert mark["label"] == "step 3" and mark["time_us"] > 1.6e15


# ----------------------------------------------------------------------------------------------
# Errors and the command line
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["render", "summary"])
def test_cli_errors(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.pickle"
    assert main([command, str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"memcallbacks {command}: no such file: {missing}"

    text_file = tmp_path / "notes.txt"
    text_file.write_text("hello")
    list_pickle = tmp_path / "list.pickle"
    list_pickle.write_bytes(pickle.dumps([1, 2, 3]))
    dict_pickle = tmp_path / "dict.pickle"
    dict_pickle.write_bytes(pickle.dumps({"history": []}))
    for bad in (text_file, list_pickle, dict_pickle):
        assert main([command, str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"memcallbacks {command}: {bad} is not a memory snapshot (expected a dict with 'segments' and 'device_traces'")

    malformed = tmp_path / "malformed.pickle"
    malformed.write_bytes(pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "size": 4}]]}))
    assert main([command, str(malformed)]) == 2
    assert "an entry is malformed: KeyError: 'addr'" in capsys.readouterr().err

    empty = tmp_path / "empty.pickle"
    empty.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    assert main([command, str(empty)]) == 2
    err = capsys.readouterr().err
    assert "empty memory snapshot" in err and "_record_memory_history" in err and "CpuCapture" in err


def test_loading_never_runs_code(tmp_path: Path) -> None:
    class Boom:
        def __reduce__(self) -> Any:
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "x": Boom()}))
    with pytest.raises(SnapshotError, match="holds a Python object"):
        load_snapshot(path)
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(EmptySnapshotError):
        validate_snapshot({"segments": [], "device_traces": []})
    with pytest.raises(SnapshotError, match="is a folder"):
        load_snapshot(tmp_path)


def test_cli_render_and_summary_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert main(["render", str(CUDA_LIKE), "-o", str(out_dir), "--top", "3", "--between", "0", "40", "--trigger", "10"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == ["wrote", str(out_dir / "cuda_like_snapshot.html"), "wrote", str(out_dir / "cuda_like_snapshot.png")]
    assert "trigger at entry 10" in assert_offline_html(out_dir / "cuda_like_snapshot.html")
    assert main(["summary", str(CUDA_LIKE), "--device", "0", "--between", "40", "30"]) == 2
    assert "START must not be after END" in capsys.readouterr().err


def test_python_m_memcallbacks_render_and_summary(tmp_path: Path) -> None:
    snap = tmp_path / "cuda_like_snapshot.pickle"
    snap.write_bytes(CUDA_LIKE.read_bytes())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    script = (
        "import runpy, sys\n"
        "path = sys.argv[1]\n"
        "for command in ('render', 'summary'):\n"
        "    sys.argv = ['memcallbacks', command, path]\n"
        "    try:\n"
        "        runpy.run_module('memcallbacks', run_name='__main__')\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code == 0, (command, exit.code)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(snap)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "cuda_like_snapshot.html").is_file() and is_png(tmp_path / "cuda_like_snapshot.png")
    assert "train.py:55 in train_step" in done.stdout and "peak allocated" in done.stdout


# ----------------------------------------------------------------------------------------------
# CUDA: allocator history (skipped without a GPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cuda_helpers_without_cuda() -> None:
    with pytest.raises(RuntimeError, match="needs CUDA"):
        start_recording(1000)
    stop_recording()
    stop_recording()
    with pytest.raises(ValueError, match="stacks="):
        start_recording(1000, stacks="cpp")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        dump_on_oom("oom.pickle")


@pytest.mark.cuda
def test_cuda_history_dump_and_summary(tmp_path: Path) -> None:
    start_recording(10_000)
    try:
        keep = torch.empty(16 * MIB, dtype=torch.uint8, device="cuda")  # cuda-planted
        line = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
        tmp = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
        del tmp
        torch.cuda.synchronize()
        path = dump_snapshot(tmp_path / "cuda.pickle", marks=[time_mark("start")], trigger="test")
    finally:
        stop_recording()
        stop_recording()
    snapshot = assert_memory_viz_readable(path)
    run_torch_memory_viz(snapshot)
    d = summarize_snapshot(load_snapshot(path)).devices[0]
    assert any(a.size == 16 * MIB and a.site == f"test_snapshot.py:{line} in test_cuda_history_dump_and_summary" for a in d.largest_at_peak)
    assert d.trigger is not None and d.trigger[1] == "test"
    written = render_snapshot(snapshot, tmp_path / "cuda.html")
    assert_offline_html(written["html"])
    with pytest.raises(SnapshotTooLarge):
        dump_snapshot(tmp_path / "tiny.pickle", max_bytes=10)
    del keep


@pytest.mark.cuda
def test_cuda_oom_observer_and_dump_on_oom(tmp_path: Path) -> None:
    seen: list[tuple[int, int, int, int]] = []
    detach = _torch_private.cuda_attach_oom_observer(lambda *args: seen.append(args))
    start_recording(10_000)
    try:
        detach_dump = dump_on_oom(lambda: tmp_path / "oom.pickle")
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        (tmp_path / "oom.pickle").rename(tmp_path / "first.pickle")
        with pytest.raises(torch.OutOfMemoryError):  # once=True: the second OOM does not dump again
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        detach_dump()
    finally:
        stop_recording()
        detach()
        detach()
    assert len(seen) == 2 and seen[0][1] >= 1 << 50
    assert (tmp_path / "first.pickle").is_file() and not (tmp_path / "oom.pickle").exists()
    d = summarize_snapshot(load_snapshot(tmp_path / "first.pickle")).devices[0]
    assert d.ooms and d.trigger is not None and d.trigger[1].startswith("out of memory on cuda:0")
