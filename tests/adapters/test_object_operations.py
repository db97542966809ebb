"""What a user does with their model and optimizer still works while a monitor is attached, and after.

For every adapter (plain ``Monitor``, Lightning ``MemoryMonitor``, ``AccelerateMemoryMonitor``,
Transformers ``MemoryMonitorCallback``), from inside a running step and after the run ended:
``torch.save``/``torch.load`` of the whole model, ``pickle``, ``copy.deepcopy`` of the model and the
optimizer, ``AveragedModel``, ``state_dict``/``load_state_dict``, a checkpoint saved and resumed,
``torch.compile`` (``backend="aot_eager"``: dynamo traces the forward with the monitor's hooks and
AOT autograd builds the backward; inductor's C++ code generation takes ~40 s per graph on this CPU
and never sees the hooks), a dtype change mid-run, and DDP wrapping after the monitor attached. The
monitor keeps producing rows afterwards, and a copy carries no monitor: its hooks are inert and gone
after its first forward.
"""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers import MIB, BoringModel, RandomDataModule, free_port, leave_rank, set_rank_environment, trainer_kwargs, run_ranks
from memcallbacks import Monitor
from memcallbacks._runtime.lifecycle import WeakHook

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # one intra-op thread, clean Accelerate singletons

OP_STEP = 2  # the step whose end runs the operations
DTYPE_STEPS = (3, 4)  # steps run in float64 (then back to float32)


def _monitor_hooks(module: nn.Module) -> list[Any]:
    return [h for m in module.modules() for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values()
            if type(h).__module__.startswith("memcallbacks")]


def _first_input(model: nn.Module) -> Any:
    if hasattr(model, "transformer"):  # GPT-2
        return torch.randint(0, 128, (2, 8))
    return torch.randn(2, 32)


def _check_copy(original: nn.Module, copied: nn.Module) -> None:
    """A copy computes what the original computes and carries no live monitor hook, and none at all after a forward."""
    assert not any(isinstance(h, WeakHook) for h in _monitor_hooks(copied))
    x = _first_input(copied)
    with torch.no_grad():
        out_copy, out_orig = copied(x), original(x)
    get = (lambda o: o.logits) if hasattr(out_copy, "logits") else (lambda o: o)
    torch.testing.assert_close(get(out_copy), get(out_orig))
    assert _monitor_hooks(copied) == []


def exercise(model: nn.Module, optimizer: Any, tmp_path: Path) -> None:
    """Every object operation of issue 24 on ``model`` and ``optimizer``; raises on the first that fails."""
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    _check_copy(model, torch.load(buf, weights_only=False))
    _check_copy(model, pickle.loads(pickle.dumps(model)))
    _check_copy(model, copy.deepcopy(model))
    optimizer_copy = copy.deepcopy(optimizer)
    assert len(optimizer_copy.param_groups) == len(optimizer.param_groups)
    pickle.dumps(optimizer.state_dict())

    averaged = torch.optim.swa_utils.AveragedModel(model)  # deep-copies the model
    averaged.update_parameters(model)
    _check_copy(model, averaged.module)

    state = model.state_dict()
    assert model.load_state_dict(state) is not None
    path = tmp_path / "checkpoint.pt"  # the plain loop's checkpoint: a dict of state_dicts
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])

    compiled = torch.compile(model, backend="aot_eager")
    x = _first_input(model)
    with torch.no_grad():
        out = compiled(x)
    assert out is not None


def _rows_after(history: Any, step: int) -> int:
    return int((history["step"] > step).sum())


# ---------------------------------------------------------------------- plain loop
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def _plain_loop(monitor: Monitor, model: nn.Module, optimizer: Any, tmp_path: Path, steps: int, kept: list[Any] | None = None) -> None:
    for step, x in enumerate(monitor.track([torch.randn(4, 32) for _ in range(steps)])):
        dtype = torch.float64 if step in DTYPE_STEPS else torch.float32
        if step == DTYPE_STEPS[0]:
            model.double()
        if step == DTYPE_STEPS[-1] + 1:
            model.float()
        loss = model(x.to(dtype)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if kept is not None:
            kept.append(torch.ones(MIB, dtype=torch.float32))  # 4 MiB a step: the growth the monitor must still find
        del loss
        if step == OP_STEP:
            exercise(model, optimizer, tmp_path)


def test_plain_monitor_object_operations_during_and_after(tmp_path: Path) -> None:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False, sample_every_n_steps=1, advanced={"strict": True})
    kept: list[Any] = []
    _plain_loop(monitor, model, optimizer, tmp_path, steps=20, kept=kept)
    monitor.close()
    assert list(monitor.history["step"]) == list(range(20))  # every step after the operations is a row
    assert [f.kind for f in monitor.findings] == ["growth"]  # and detection still works
    assert _monitor_hooks(model) == []
    exercise(model, optimizer, tmp_path)  # after close()


def test_a_model_saved_with_a_monitor_attached_loads_without_memcallbacks(tmp_path: Path) -> None:
    model = _mlp()
    monitor = Monitor(model, write_files=False, advanced={"strict": True})
    blob = pickle.dumps(model)
    assert b"memcallbacks" not in blob  # the hooks pickle as a no-op of Python itself, naming no monitor
    torch.save(model, tmp_path / "model.pt")
    deep = copy.deepcopy(model)
    assert len(_monitor_hooks(deep)) == 2  # a deep copy's hooks are inert ...
    deep(torch.randn(2, 32))
    assert _monitor_hooks(deep) == [] and not deep._forward_pre_hooks  # ... and gone after its first forward
    monitor.close()
    # a fresh interpreter where memcallbacks cannot be imported loads and runs the saved model
    code = ("import sys, torch; sys.modules['memcallbacks'] = None; "
            f"m = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False); print(tuple(m(torch.randn(2, 32)).shape))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "(2, 1)", out.stderr[-2000:]


def test_ddp_wrapping_after_the_monitor_attached(tmp_path: Path) -> None:

    run_ranks(_ddp_rank, (2, free_port(), str(tmp_path)))
    for rank in (0, 1):
        assert (tmp_path / f"rows.{rank}").read_text() == "0,1,2,3"


def _ddp_rank(rank: int, world_size: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    set_rank_environment(rank, world_size, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = Monitor(model, optimizer, write_files=False, sample_every_n_steps=1, advanced={"strict": True})
        ddp = DistributedDataParallel(model)  # wrapped after the monitor attached to the bare module
        for x in monitor.track([torch.randn(4, 32) for _ in range(4)]):
            ddp(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        monitor.close()
        Path(out, f"rows.{rank}").write_text(",".join(str(s) for s in monitor.history["step"]))
    finally:
        dist.destroy_process_group()
    leave_rank()  # before the DDP model is freed: see helpers.leave_rank


# ---------------------------------------------------------------------- Accelerate
def test_accelerate_monitor_object_operations_during_and_after(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from memcallbacks.accelerate import AccelerateMemoryMonitor

    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    model = _mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    monitor = AccelerateMemoryMonitor(accelerator, model, optimizer, write_files=False, sample_every_n_steps=1, advanced={"strict": True})
    _plain_loop(monitor, model, optimizer, tmp_path, steps=8)
    accelerator.save_state(str(tmp_path / "state"))  # Accelerate's own checkpoint, while the monitor is attached
    accelerator.load_state(str(tmp_path / "state"))
    for x in monitor.track([torch.randn(4, 32) for _ in range(2)]):
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    assert list(monitor.history["step"]) == list(range(10))
    exercise(model, optimizer, tmp_path)


# ---------------------------------------------------------------------- Lightning
class DtypeFollowing(BoringModel):
    """Casts each batch to the module's dtype, so the test can move the module to float64 mid-run."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch.to(self.dtype), batch_idx)


def _lightning_module() -> Any:
    torch.manual_seed(0)
    return DtypeFollowing()


def _operations_callback(tmp_path: Path) -> Any:
    import lightning.pytorch as L

    class Operations(L.Callback):
        ran = False

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == OP_STEP + 1:
                exercise(pl_module, trainer.optimizers[0], tmp_path)
                self.ran = True
            if trainer.global_step == DTYPE_STEPS[0]:
                pl_module.double()
            if trainer.global_step == DTYPE_STEPS[-1] + 1:
                pl_module.float()

    return Operations()


def test_lightning_monitor_object_operations_checkpoint_and_resume(tmp_path: Path) -> None:
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from memcallbacks import MemoryMonitor

    monitor = MemoryMonitor(write_files=False, sample_every_n_steps=1, advanced={"strict": True})
    operations = _operations_callback(tmp_path)
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=4, save_top_k=-1)
    model = _lightning_module()
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=8, enable_checkpointing=True, callbacks=[monitor, operations, checkpoints]))
    trainer.fit(model, RandomDataModule())
    assert operations.ran
    assert list(monitor.history["step"]) == list(range(8))
    exercise(model, trainer.optimizers[0], tmp_path)  # after fit

    # resume from the checkpoint saved mid-run (the monitor's state is in it) with a new monitor
    resumed = MemoryMonitor(write_files=False, sample_every_n_steps=1, advanced={"strict": True})
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=8, callbacks=[resumed]))
    trainer.fit(_lightning_module(), RandomDataModule(), ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt"))
    assert list(resumed.history["step"]) == list(range(8))  # the checkpoint's rows 0-3, then the resumed steps


# ---------------------------------------------------------------------- Transformers
def test_transformers_callback_object_operations_during_and_after(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from memcallbacks.transformers import MemoryMonitorCallback

    class Ids(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 128, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    class Operations(TrainerCallback):
        ran = False

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
            if state.global_step == OP_STEP + 1:
                exercise(model, optimizer, tmp_path)
                self.ran = True
            if state.global_step == DTYPE_STEPS[0]:
                model.double()
            if state.global_step == DTYPE_STEPS[-1] + 1:
                model.float()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=16, bos_token_id=0, eos_token_id=0,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    monitor = MemoryMonitorCallback(write_files=False, sample_every_n_steps=1, advanced={"strict": True})
    operations = Operations()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=8, per_device_train_batch_size=4,
                             save_strategy="steps", save_steps=4, disable_tqdm=True, dataloader_num_workers=0, optim="sgd",
                             learning_rate=1e-3)
    trainer = Trainer(model=model, args=args, train_dataset=Ids(), callbacks=[monitor, operations])
    trainer.train()
    assert operations.ran
    assert list(monitor.history["step"]) == list(range(8))
    exercise(model, trainer.optimizer, tmp_path)

    # the Trainer's own checkpoint (saved at step 4 with the monitor attached), resumed with a new callback
    resumed = MemoryMonitorCallback(write_files=False, sample_every_n_steps=1, advanced={"strict": True})
    trainer = Trainer(model=model, args=args, train_dataset=Ids(), callbacks=[resumed])
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    assert list(resumed.history["step"]) == [4, 5, 6, 7]
    del transformers
