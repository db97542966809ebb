"""One out-of-memory error in one documented shape, uncaught, as a user's script meets it: ``python oom_shapes.py SHAPE PHASE``.

Run in an empty working folder (the monitors' default output folders are there). SHAPE is ``plain`` (README.md's
plain loop, without ``with``: its code block is read from README.md and run as it is), ``with`` (``with
Monitor(...)``), ``lightning``, ``accelerate`` (as its docstring shows it: ``close()`` after the loop) or
``transformers`` (``trainer.train()``, no ``try``). PHASE is ``forward`` or ``backward``.

The model keeps 16 MiB more every step (a leak, in ``Net.kept``); at step 30 the batch jumps to 8192 and the
address space is limited to what the process holds plus 100 MiB, at the start of the model's forward (``forward``: its
first layer's 128 MiB output fails) or at its end (``backward``: a 128 MiB gradient fails). The limit before that is
the process plus 8 GiB, so the monitor keeps its address-space reserve. Nothing catches the error: it reaches the
excepthook the script installed first (the user's own), which writes ``result.json`` (what reached it, and whether it
is the very exception the allocator raised) and passes it on to Python's default hook, which prints the traceback.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import resource
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
LEAK = 16 << 20  # bytes kept every step
SMALL, BIG, OOM_STEP = 16, 8192, 30
ROOM = 100 << 20  # the address space left at the OOM step: below the 128 MiB the step asks for next
RAISED: list[int] = []  # id() of the exception torch raised, seen where it was raised
SEEN: list[dict[str, Any]] = []


def vm_size() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) << 10 for line in fh if line.startswith("VmSize:"))


def limit_to(room: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + room, resource.RLIM_INFINITY))


class ImportsAtTheOom:
    """A ``sys.meta_path`` finder installed when the failing step begins: the modules imported from then until ``oom.json``
    exists (written at exit to ``imports.json``). Explaining must import nothing: at the OOM there may be no room."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.written = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        self.written = self.written or any(Path().rglob("oom.json"))
        if not self.written:
            self.names.append(name)

    def save(self) -> None:
        Path("imports.json").write_text(json.dumps(self.names))


IMPORTS = ImportsAtTheOom()


class Net(nn.Module):
    def __init__(self, phase: str) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(512, 4096), nn.GELU(), nn.Linear(4096, 512)
        self.kept: list[torch.Tensor] = []
        self.phase = phase

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        big = x.shape[0] == BIG
        if big and IMPORTS not in sys.meta_path:
            sys.meta_path.insert(0, IMPORTS)
            atexit.register(IMPORTS.save)
        if big and self.phase == "forward":
            limit_to(ROOM)
        try:
            out = self.fc2(self.act(self.fc1(x)))
        except RuntimeError as exc:
            RAISED.append(id(exc))
            raise
        if self.training:
            self.kept.append(torch.ones(LEAK // 4))  # the leak
        if big and self.phase == "backward":
            limit_to(ROOM)
        loss = out.pow(2).mean()
        return {"loss": loss} if labels is not None else loss


def recording_backward(backward: Any) -> Any:
    """``torch.autograd.backward`` as the user's own code would wrap it: the exception the autograd engine raised."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return backward(*args, **kwargs)
        except RuntimeError as exc:
            RAISED.append(id(exc))
            raise

    return wrapped


def user_hook(exc_type: Any, exc: BaseException, tb: Any) -> None:
    """The user's own excepthook, installed before any monitor: what reached it is what the user sees."""
    frames = traceback.extract_tb(tb)
    SEEN.append({
        "type": exc_type.__name__, "same_object": id(exc) in RAISED, "context": repr(exc.__context__), "cause": repr(exc.__cause__),
        "notes": getattr(exc, "__notes__", None), "frames": [f"{os.path.basename(f.filename)}:{f.name}" for f in frames],
        "memcallbacks_frames": [f"{f.filename}:{f.name}" for f in frames if f"{os.sep}memcallbacks{os.sep}" in f.filename],
        "error": str(exc)[:300], "calls": len(SEEN) + 1,
    })
    Path("result.json").write_text(json.dumps(SEEN))
    sys.__excepthook__(exc_type, exc, tb)


def batches(n: int = OOM_STEP + 2) -> Any:
    return (torch.randn(BIG if i == OOM_STEP else SMALL, 512) for i in range(n))


def readme_loop() -> str:
    """README.md's plain-loop block, as it is shown (the first ```python block with ``monitor = Monitor(model, optimizer)``)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return next(b for b in blocks if "monitor = Monitor(model, optimizer)" in b)


def run_plain(model: Net, optimizer: Any) -> None:
    exec(compile(readme_loop(), "README.md", "exec"), {"model": model, "optimizer": optimizer, "loader": batches()})


def run_with(model: Net, optimizer: Any) -> None:
    from memcallbacks import Monitor

    with Monitor(model, optimizer) as monitor:
        for batch in monitor.track(batches()):
            loss = model(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


def run_lightning(model: Net, optimizer: Any) -> None:
    import lightning.pytorch as L

    from memcallbacks import MemoryMonitor

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters())

    trainer = L.Trainer(callbacks=[MemoryMonitor()], logger=L.loggers.TensorBoardLogger("runs"), max_epochs=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(Lit(), torch.utils.data.DataLoader(list(batches()), batch_size=None))


def run_accelerate(model: Net, optimizer: Any) -> None:
    from accelerate import Accelerator

    from memcallbacks.accelerate import AccelerateMemoryMonitor

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir="runs")
    accelerator.init_trackers("exp")
    model, optimizer = accelerator.prepare(model, optimizer)
    monitor = AccelerateMemoryMonitor(accelerator, model, optimizer)
    for batch in monitor.track(batches()):
        accelerator.backward(model(batch))
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()


def run_transformers(model: Net, optimizer: Any) -> None:
    from transformers import Trainer, TrainingArguments

    from memcallbacks.transformers import MemoryMonitorCallback

    class Batches(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.items = [{"x": x, "labels": torch.zeros(len(x))} for x in batches()]

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return self.items[i]

    class OneBatchPerItem(Trainer):
        def get_train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(Batches(), batch_size=None)

    args = TrainingArguments(output_dir="runs", report_to=["tensorboard"], max_steps=OOM_STEP + 2,
                             save_strategy="no", logging_steps=1, disable_tqdm=True, use_cpu=True, dataloader_num_workers=0)
    OneBatchPerItem(model=model, args=args, callbacks=[MemoryMonitorCallback()], optimizers=(optimizer, None)).train()


SHAPES = {"plain": run_plain, "with": run_with, "lightning": run_lightning, "accelerate": run_accelerate, "transformers": run_transformers}


def main(shape: str, phase: str) -> None:
    sys.excepthook = user_hook
    torch.autograd.backward = recording_backward(torch.autograd.backward)
    limit_to(8 << 30)
    torch.manual_seed(0)
    model = Net(phase)
    SHAPES[shape](model, torch.optim.AdamW(model.parameters()))
    print("no out-of-memory error", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:3])
