"""A training run at defaults that keeps Python objects only (no tensors) from step 0 on; prints one JSON line.

    python tests/scripts/host_python_objects.py ADAPTER KIND N STEPS

ADAPTER: ``plain`` (``Monitor`` over ``track()``) or ``lightning`` (``MemoryMonitor``, ``logger=False``).
KIND: ``floats`` (a dict of N per-parameter floats with string keys appended to a module-level list every
step) or ``spec`` (N dataclass objects a step into a module-level dict). The truth is ``tracemalloc``'s
count of the same objects made before training (``truth_bytes_per_step``); the run's report.json gives the
host findings and the Python-object figures. A process of its own: in a test session freed heap from
earlier tests is refilled by the leak before the resident set moves.
"""

from __future__ import annotations

import json
import sys
import tracemalloc
import warnings
from dataclasses import dataclass

import torch

warnings.filterwarnings("ignore")
ADAPTER, KIND, N, STEPS = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
NAMES = [f"model.layers.{i // 4}.block.weight_{i}" for i in range(N)]
KEPT: list = []
SPECS: dict = {}


@dataclass
class Spec:
    name: str
    shape: tuple
    stride: tuple
    placement: list
    step: int


def keep(step: int) -> None:
    if KIND == "floats":
        KEPT.append({name: float(step) + i * 0.5 for i, name in enumerate(NAMES)})
    else:
        for i in range(N):
            SPECS[(step, i)] = Spec(f"p{step}.{i}", (step, i, 3), (1, step, i), [step, i], step)


def truth_per_step() -> float:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for step in range(-20, 0):
        keep(step)
    out = (tracemalloc.get_traced_memory()[0] - before) / 20
    tracemalloc.stop()
    KEPT.clear()
    SPECS.clear()
    return out


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))


def main() -> None:
    truth = truth_per_step()
    data = torch.utils.data.DataLoader(torch.randn(STEPS * 32, 64, generator=torch.Generator().manual_seed(0)), batch_size=32)
    if ADAPTER == "lightning":
        import lightning.pytorch as L
        from memcallbacks import MemoryMonitor

        class Keep(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                keep(trainer.global_step - 1)  # the step that just ran

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = model()

            def training_step(self, batch, batch_idx):
                return self.net(batch).pow(2).mean()

            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=1e-3)

        trainer = L.Trainer(max_steps=STEPS, logger=False, accelerator="cpu", devices=1, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[MemoryMonitor(output_dir="mem", plot=False), Keep()], default_root_dir=".")
        trainer.fit(Module(), data)
    else:
        from memcallbacks import Monitor

        net = model()
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        monitor = Monitor(net, opt, output_dir="mem", plot=False)
        for step, batch in enumerate(monitor.track(data)):
            loss = net(batch).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            keep(step)
        monitor.close()
    with open("mem/report.json") as fh:
        report = json.load(fh)
    print(json.dumps({"truth_bytes_per_step": truth, "figures": report["summary"]["rank_figures"],
                      "findings": report["findings"], "host": report["host"]}))


if __name__ == "__main__":
    main()
