"""DataLoader workers' private memory: real workers, a real copy-on-access Dataset of 200,000 dicts."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from memcallbacks._base.units import MiB
from memcallbacks.host import WorkerWatch, dataloader_workers

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux smaps_rollup")


class Records(Dataset):
    """A Python list of dicts: every item read writes its objects' reference counts (copy on access)."""

    def __init__(self, n: int) -> None:
        self.items = [{"id": i, "x": float(i), "label": f"item-{i}"} for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        d = self.items[i]
        return torch.tensor([d["x"], float(d["id"])])


class Arrays(Dataset):
    """The fix: one tensor, no per-item objects."""

    def __init__(self, n: int) -> None:
        self.data = torch.arange(2 * n, dtype=torch.float32).reshape(n, 2)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def fit(loader: DataLoader, watch: WorkerWatch, steps: int, epochs: int = 1) -> list:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    findings, step = [], 0
    for _ in range(epochs):
        for i, batch in enumerate(loader):
            f = watch.update(step)
            if f is not None:
                findings.append(f)
            loss = model(batch).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if i + 1 >= steps:
                break
    return findings


def test_persistent_workers_copy_on_access_is_found_with_its_fix():
    loader = DataLoader(Records(200_000), batch_size=64, num_workers=2, persistent_workers=True, shuffle=True)
    watch = WorkerWatch(min_interval_s=0.0, max_overhead=0.5)  # read often: a short test
    findings = fit(loader, watch, 400)
    live = dataloader_workers()
    assert sorted(w.worker_id for w in live) == [0, 1] and {w.dataset for w in live} == {"Records"}
    for track in watch.live():  # the reader sees each worker's USS grow as pages are copied
        usses = [r[1] for r in track.reads]
        assert len(usses) >= 4 and usses[-1] - usses[0] >= 8 * MiB, usses
    assert findings, watch.summary()
    f = findings[-1]
    assert f.kind == "worker_growth" and f.key == "worker_growth"
    assert {w["worker_id"] for w in f.details["workers"]} == {0, 1}
    assert f.details["total_uss_bytes"] >= 2 * 20 * MiB
    assert "pytorch/pytorch#13246" in f.message and "NumPy arrays or tensors" in f.message and "Records" in f.message
    assert f.details["read_cost_s"] > 0 and watch.seconds > 0
    assert watch.figures()["host_worker_uss_bytes"] == f.details["total_uss_bytes"]
    del loader


def test_non_persistent_workers_are_tracked_per_epoch():
    loader = DataLoader(Records(200_000), batch_size=64, num_workers=2, persistent_workers=False, shuffle=True)
    watch = WorkerWatch(min_interval_s=0.0, max_overhead=0.5)
    findings = fit(loader, watch, 250, epochs=2)
    assert watch.generation == 2, watch.summary()
    assert len(watch.tracks) == 4 and {t.generation for t in watch.tracks.values()} == {1, 2}
    assert findings and findings[-1].details["generations"] == 2


def test_arrays_do_not_grow():
    loader = DataLoader(Arrays(200_000), batch_size=64, num_workers=2, persistent_workers=True, shuffle=True)
    watch = WorkerWatch(min_interval_s=0.0, max_overhead=0.5)
    findings = fit(loader, watch, 300)
    assert watch.reads >= 4 and findings == [], [f.message for f in findings]


def test_bad_parameters_name_the_parameter_and_the_fix():
    with pytest.raises(ValueError, match=r"WorkerWatch\(max_overhead=0\) is invalid; use a fraction"):
        WorkerWatch(max_overhead=0)
