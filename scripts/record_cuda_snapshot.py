"""Record a small, real CUDA memory snapshot for the test data (run by scripts/gpu_check.sh).

    python scripts/record_cuda_snapshot.py OUT_DIR

The same story as tests/data/make_cuda_like_snapshot.py (which builds one by hand, without a GPU):
a linear model trains three steps with allocator history on; step 2 appends a 32 MiB buffer to a
list and never frees it; then an allocation far above the device's memory fails (caught). Writes
OUT_DIR/cuda_recorded_snapshot.pickle (a few hundred KiB) and OUT_DIR/cuda_recorded_snapshot.json
(what tests/snapshot/test_snapshot.py::test_recorded_cuda_snapshot checks). Copy both into tests/data/ to
make that test run on every machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

import memcallbacks.snapshot as _snapshot

MIB = 1 << 20
KEPT: list[torch.Tensor] = []


def train(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(64, 1024, device="cuda")
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if step == 2:
        KEPT.append(torch.ones(32 * MIB, dtype=torch.uint8, device="cuda"))  # planted: never freed


def main(out: str) -> int:
    if not torch.cuda.is_available():
        print("record_cuda_snapshot: no CUDA device; nothing recorded", file=sys.stderr)
        return 1
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).cuda()  # before recording: no frames
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    _snapshot.start_recording(5_000)
    marks = [_snapshot.time_mark("start")]
    try:
        for step in range(1, 4):
            train(model, optimizer, step)
            torch.cuda.synchronize()
            marks.append(_snapshot.time_mark(f"after step {step}"))
        try:
            torch.empty(2 * torch.cuda.get_device_properties(0).total_memory, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
        path = _snapshot.dump_snapshot(out_dir / "cuda_recorded_snapshot.pickle", marks=marks, trigger="recorded by scripts/record_cuda_snapshot.py")
    finally:
        _snapshot.stop_recording()
    import inspect

    lines, first = inspect.getsourcelines(train)
    planted = next(first + i for i, text in enumerate(lines) if "# planted" in text)
    facts = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "planted_site": f"record_cuda_snapshot.py:{planted} in train",
        "planted_bytes": 32 * MIB,
        "bytes": path.stat().st_size,
    }
    (out_dir / "cuda_recorded_snapshot.json").write_text(json.dumps(facts, indent=1))
    print(json.dumps(facts))
    problems = check(path, facts)
    for problem in problems:
        print(f"record_cuda_snapshot: CHECK FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


def check(path: Path, facts: dict) -> list[str]:
    """What the recorded snapshot must show, read back with memcallbacks' own readers."""
    problems: list[str] = []
    summary = _snapshot.summarize_snapshot(_snapshot.load_snapshot(path), source=str(path))
    if len(summary.devices) != 1:
        return [f"expected one device in the snapshot, found {len(summary.devices)}"]
    d = summary.devices[0]
    if not d.stayed_alive or d.stayed_alive[0].site != facts["planted_site"] or d.stayed_alive[0].bytes != facts["planted_bytes"]:
        first = d.stayed_alive[0] if d.stayed_alive else None
        problems.append(f"first stayed-alive allocation is {first}, expected {facts['planted_site']} / {facts['planted_bytes']} B")
    if not d.ooms or d.ooms[-1][1] <= 2**40 // 8:
        problems.append(f"the planted OOM is missing: {d.ooms}")
    if [label for _, label in d.marks][:2] != ["start", "after step 1"]:
        problems.append(f"step marks: {[label for _, label in d.marks]}")
    if facts["planted_site"] not in _snapshot.format_summary(summary):
        problems.append("the text summary does not name the planted site")
    page = _snapshot.render_snapshot(_snapshot.load_snapshot(path), path.with_suffix(".html"))
    if not Path(page["html"]).is_file():
        problems.append("the offline page was not written")
    return problems


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
