"""How far a real CPU training step's memory is from the pre-flight's prediction: the margin a proposed batch keeps.

For each model and batch size, a forked child (no limit, no monitor) warms up one step (the optimizer's state), then
runs one step at that batch with its resident-set high-water mark reset (``/proc/self/clear_refs`` 5), and compares
the rise (``VmHWM`` less the resident set at the step's start) with ``predict()``'s (its peak less what is alive at the
start: parameters, optimizer state, the batch), with glibc's mmap threshold adaptive (its default) and fixed at 1 MiB.
The models are tests/oom/oom_runs.py's MLP and transformer and a vector MLP (256-2048-2048-10). docs/oom.md
("What makes it fit") quotes its table. Takes about a minute on 2 cores::

    scripts/oom_prediction_error.py  [model:batch,batch,...] ...
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("MALLOC_ARENA_MAX", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "oom"))
import torch  # noqa: E402
from torch import nn  # noqa: E402

import oom_runs  # noqa: E402
from memcallbacks.preflight import predict  # noqa: E402

torch.set_num_threads(1)
M_MMAP_THRESHOLD = -3
DEFAULT = ["mlp:4,8,16,32", "transformer:2,4,8,16", "vmlp:512,2048,8192"]


def status(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) << 10 for line in fh if line.startswith(field + ":"))


class VectorMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make(kind: str, n: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    if kind == "vmlp":
        g = torch.Generator().manual_seed(n)
        return VectorMLP(), (torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g))
    return oom_runs.Net(kind), oom_runs.batch(kind, n)


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).float().reshape(-1, 10), y.reshape(-1))


def measure(kind: str, n: int, threshold: int) -> dict[str, Any]:
    if threshold:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold)
    torch.manual_seed(0)
    model, _ = make(kind, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss(model, *make(kind, 2)[1]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    x, y = make(kind, n)[1]
    meta = (torch.empty(x.shape, device="meta"), torch.empty(y.shape, dtype=y.dtype, device="meta"))
    predicted = predict(model, meta, opt, forward_fn=lambda m, b: loss(m, *b))
    alive = sum(t.numel() * t.element_size() for t in [*model.parameters(), x, y, *(v for s in opt.state.values() for v in s.values())])
    rss = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    loss(model, x, y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"real": status("VmHWM") - rss, "predicted": predicted.peak_bytes - alive}


def forked(*args: Any) -> dict[str, Any]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            os.write(write, json.dumps(measure(*args)).encode())
        finally:
            os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 1 << 16):
        data += chunk
    os.waitpid(pid, 0)
    return json.loads(data)


def main(specs: list[str]) -> None:
    print(f"{'model':12} {'batch':>6} {'malloc':>9} {'real MiB':>9} {'predicted':>9} {'error':>9}")
    for spec in specs or DEFAULT:
        kind, sizes = spec.split(":")
        for n in map(int, sizes.split(",")):
            for threshold, name in ((0, "adaptive"), (1 << 20, "1 MiB")):
                d = forked(kind, n, threshold)
                error = d["real"] - d["predicted"]
                print(f"{kind:12} {n:6d} {name:>9} {d['real'] / 2**20:9.1f} {d['predicted'] / 2**20:9.1f} "
                      f"{error / 2**20:+8.1f} ({error / max(d['predicted'], 1):+.1%})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
