"""Out of memory, explained, on CUDA: ``torch.OutOfMemoryError`` under a per-process memory fraction, the allocator's
figures (allocated, reserved, the largest free block), the OOM snapshot linked, and fragmentation's remedy."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import CUDA_LIMIT
from memcallbacks import Monitor
from memcallbacks.oom import explain_oom, is_oom

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_growing_batch_on_cuda(cuda_limited: None, tmp_path: Path) -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)) for _ in range(3)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(torch.OutOfMemoryError) as raised:
        with Monitor(model, optimizer, output_dir=str(tmp_path), auto_snapshot=True, sample_every_n_steps=1) as monitor:
            for n in monitor.track(64 << i for i in range(12)):
                x = torch.randn(n, 256, 1024, device="cuda")
                model(x).float().pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    assert is_oom(raised.value)  # propagated unchanged
    oom = json.loads((tmp_path / "oom.json").read_text())
    memory = oom["memory"]
    assert oom["source"] == "cuda" and memory["requested_bytes"] > 0
    assert oom["where"]["phase"] in ("forward", "backward")
    assert memory["capacity_bytes"] == pytest.approx(CUDA_LIMIT, rel=1e-6) and memory["capacity_source"].startswith("per-process")
    assert sum(memory["categories"].values()) == memory["figure_bytes"]
    assert memory["largest_free_block_bytes"] is not None and memory["reserved_unallocated_bytes"] is not None
    # the categories add up to the allocator's reserved bytes at the failure, within 5% of the limit it ran into
    assert abs(memory["figure_bytes"] + memory["requested_bytes"] - CUDA_LIMIT) <= 0.05 * CUDA_LIMIT + memory["requested_bytes"]
    assert oom["snapshot"] and Path(oom["snapshot"]).is_file()  # the OOM snapshot, linked
    kinds = [r["kind"] for r in oom["remedies"]]
    assert "batch_size" in kinds and "expandable_segments" not in kinds[:1]


def test_fragmentation_is_named_with_expandable_segments(cuda_limited: None) -> None:
    # one 1.5 GiB segment carved into 16 blocks of 96 MiB, every other one freed: 768 MiB cached in
    # blocks of 96 MiB the allocator cannot merge, and a segment it cannot release (half of it is in use)
    whole = torch.empty(1536 << 20, dtype=torch.uint8, device="cuda")
    del whole
    parts = [torch.empty(96 << 20, dtype=torch.uint8, device="cuda") for _ in range(16)]
    del parts[::2]
    try:
        torch.empty(640 << 20, dtype=torch.uint8, device="cuda")  # 1.5 GiB reserved + 640 MiB is above the 2 GiB fraction
    except torch.OutOfMemoryError as exc:
        explanation = explain_oom(exc, model=None, optimizer=None, step=0, device=torch.device("cuda", 0))
    else:
        pytest.fail("the allocator found room for the request")
    del parts
    acc = explanation.accounting
    assert acc.requested_bytes == 640 << 20
    assert acc.reserved_unallocated_bytes >= 640 << 20 > acc.largest_free_block_bytes >= 96 << 20
    assert explanation.remedies and explanation.remedies[0].kind == "expandable_segments"
    assert "expandable_segments:True" in explanation.text()


README_LOOP_ON_CUDA = '''
import json, sys
import torch
from torch import nn
sys.path.insert(0, {here!r})
from oom_shapes import readme_loop

torch.cuda.set_per_process_memory_fraction({limit} / torch.cuda.get_device_properties(0).total_memory, 0)
seen = []

def mine(exc_type, exc, tb):
    seen.append(exc)
    json.dump({{"type": exc_type.__name__, "context": repr(exc.__context__), "cause": repr(exc.__cause__)}}, open("seen.json", "w"))
    sys.__excepthook__(exc_type, exc, tb)

sys.excepthook = mine
model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)) for _ in range(3)]).cuda()
optimizer = torch.optim.AdamW(model.parameters())
loader = (torch.randn(n, 256, 1024, device="cuda") for n in [2] * 10 + [{big}] * 2)

class Loss(nn.Module):  # README's loop calls model(batch) for the loss
    def __init__(self, net):
        super().__init__()
        self.net = net
    def forward(self, x):
        return self.net(x).float().pow(2).mean()

exec(compile(readme_loop(), "README.md", "exec"), {{"model": Loss(model), "optimizer": optimizer, "loader": loader}})
'''


def test_the_readme_loop_explains_a_cuda_oom_nobody_caught(tmp_path: Path) -> None:
    """README's plain loop, no ``with``: torch.OutOfMemoryError reaches the top, its traceback is printed as it is,
    and the monitor's excepthook explains it after (oom.json, against the per-process fraction)."""
    import os
    import subprocess
    import sys

    here = str(Path(__file__).resolve().parent)
    script = README_LOOP_ON_CUDA.format(here=here, limit=CUDA_LIMIT, big=256)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=str(Path(here).parents[1])))
    assert done.returncode == 1, done.stderr[-3000:]
    assert json.loads((tmp_path / "seen.json").read_text()) == {"type": "OutOfMemoryError", "context": "None", "cause": "None"}
    assert done.stderr.count("Traceback (most recent call last)") == 1 and "During handling" not in done.stderr
    assert done.stderr.index("torch.OutOfMemoryError: CUDA out of memory") < done.stderr.index("out of memory at step 10")
    oom = json.loads((tmp_path / "memcallbacks_output" / "oom.json").read_text())
    assert oom["source"] == "cuda" and oom["step"] == 10 and oom["where"]["phase"] in ("forward", "backward")
    assert oom["memory"]["capacity_source"].startswith("per-process")


def test_the_proposed_batch_fits_on_cuda(cuda_limited: None, tmp_path: Path) -> None:
    """A batch that jumps at step 10 under a 2 GiB per-process fraction: the batch the explanation proposes runs under
    the same fraction with the monitor on, and twice that batch does not."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)) for _ in range(3)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters())

    def run(big: int, folder: Path) -> None:
        with Monitor(model, optimizer, output_dir=str(folder)) as monitor:
            for n in monitor.track([2] * 10 + [big] * 2):
                x = torch.randn(n, 256, 1024, device="cuda")
                model(x).float().pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del x

    with pytest.raises(torch.OutOfMemoryError):
        run(256, tmp_path / "jump")
    gc.collect()  # the error's frames held the failed step's tensors
    torch.cuda.empty_cache()
    oom = json.loads((tmp_path / "jump" / "oom.json").read_text())
    remedy = next(r for r in oom["remedies"] if r["kind"] == "batch_size")
    n = remedy["details"]["batch_size"]
    assert 1 <= n < 256 and remedy["details"]["margin_bytes"] >= 16 << 20, oom["text"]
    run(n, tmp_path / "fits")  # completes
    gc.collect()
    torch.cuda.empty_cache()
    with pytest.raises(torch.OutOfMemoryError):
        run(2 * n, tmp_path / "twice")
