"""Pins for the framework-private reads the adapters make (the table in docs/architecture.md).

Each test fails loudly, naming the read, when a framework release renames or changes it, so the
break shows here and not as a silently wrong number in a user's run. Real objects only.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from helpers import trainer_kwargs

LIGHTNING_PACKAGES = [name for name in ("lightning.pytorch", "pytorch_lightning") if importlib.util.find_spec(name.split(".")[0])]


def _two_optimizer_module(L):  # noqa: N803 - the package, as users import it
    class TwoOptimizers(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            opt_a, opt_b = self.optimizers()
            for opt, layer in ((opt_a, self.a), (opt_b, self.b)):
                loss = layer(batch[0]).sum() if layer is self.a else self.b(self.a(batch[0])).sum()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4)), batch_size=2)

    return TwoOptimizers()


@pytest.mark.parametrize("package", LIGHTNING_PACKAGES)
def test_lightning_batches_that_stepped(package, tmp_path):
    """``trainer.fit_loop.epoch_loop._batches_that_stepped``: Lightning's own logging axis, which
    ``MemoryMonitor._log_step`` reads (``global_step`` moves by 2 per batch with two optimizers)."""
    L = importlib.import_module(package)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=6, logger=False))
    trainer.fit(_two_optimizer_module(L))
    loop = trainer.fit_loop.epoch_loop
    assert hasattr(loop, "_batches_that_stepped"), (
        f"{package}: fit_loop.epoch_loop._batches_that_stepped is gone; MemoryMonitor._log_step falls back to "
        "global_step, which is wrong with several optimizers. Find the new name and update memcallbacks/lightning.py."
    )
    assert trainer.global_step == 6 and loop._batches_that_stepped == 3, (
        f"{package}: _batches_that_stepped={loop._batches_that_stepped} after 3 batches of 2 optimizer steps each "
        f"(global_step={trainer.global_step}); its meaning changed: update MemoryMonitor._log_step."
    )


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_optimizers_list():
    """``accelerator._optimizers``: the prepared optimizers, read by ``AccelerateMemoryMonitor`` to find
    the one optimizer for the theory check when the user did not pass it."""
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    model = nn.Linear(4, 4)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    optimizers = getattr(accelerator, "_optimizers", None)
    assert isinstance(optimizers, list), (
        "accelerate: Accelerator._optimizers is gone; AccelerateMemoryMonitor.set_training_objects can no longer find "
        "the prepared optimizer. Update memcallbacks/accelerate.py."
    )
    assert len(optimizers) == 1 and optimizers[0] is optimizer, "accelerate: Accelerator._optimizers no longer lists the prepared optimizer."


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_transformers_callback_handler_frame(tmp_path):
    """``MemoryMonitorCallback._move_to_front`` finds the ``CallbackHandler`` dispatching an event in a
    caller's frame (``sys._getframe``) and puts itself first, so ``report_to`` integrations see its
    metrics. This checks the frame is still there: the callback, added last, ends up first after the Trainer's
    DefaultFlowCallback."""
    transformers = pytest.importorskip("transformers")
    from memcallbacks.transformers import MemoryMonitorCallback

    monitor = MemoryMonitorCallback(write_files=False)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=["tensorboard"], use_cpu=True, max_steps=1)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    trainer = transformers.Trainer(model=model, args=args, callbacks=[monitor])
    callbacks = trainer.callback_handler.callbacks
    assert type(callbacks[0]).__name__ == "DefaultFlowCallback" and callbacks[1] is monitor, (
        "transformers: MemoryMonitorCallback did not move itself right after DefaultFlowCallback in Trainer.callback_handler.callbacks "
        f"(order: {[type(c).__name__ for c in callbacks]}); CallbackHandler.call_event's frame layout changed. "
        "Update _move_to_front in memcallbacks/transformers.py."
    )
    assert any(type(c).__name__ == "TensorBoardCallback" for c in callbacks[2:])


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_transformers_trainer_loop_locals_for_the_pytest_plugin(tmp_path):
    """The pytest plugin leaves the Trainer's own per-step tensors out of its leak census: it reads the
    locals of ``Trainer._run_epoch`` / ``_inner_training_loop`` (``batch_samples``, ``inputs``,
    ``tr_loss_step``, ...), ``Trainer._tr_loss`` and the locals of the training data iterator's
    generator (Accelerate's ``DataLoaderShard`` prefetches the next batch) while ``on_step_end`` runs.
    This checks they still hold the step's batch, the next batch and the loss."""
    transformers = pytest.importorskip("transformers")
    from memcallbacks.pytest_plugin.trainer_locals import TRAINER_LOOP_FRAMES, transformers_bookkeeping
    from memcallbacks.leaks.tensors import iter_tensors

    ids = torch.arange(8 * 6).reshape(8, 6) % 32
    data = [{"input_ids": row, "labels": row} for row in ids]
    seen: dict[str, list[torch.Tensor]] = {}
    forwarded: list[torch.Tensor] = []

    class Look(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen[f"step {state.global_step}"] = [t for obj in transformers_bookkeeping(trainer) for t in iter_tensors(obj)]

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=2,
                                          per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    model.register_forward_pre_hook(lambda module, a, kw: forwarded.append(kw["input_ids"]), with_kwargs=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[Look()])
    trainer.train()
    where = f"transformers: the Trainer's loop frames {TRAINER_LOOP_FRAMES} and its data iterator's generator"
    tensors = seen.get("step 1", [])
    assert any(t is forwarded[0] for t in tensors), f"{where} no longer hold the step's batch (inputs, batch_samples) in on_step_end."
    assert any(t.dim() == 0 and t.is_floating_point() for t in tensors), f"{where} no longer hold the loss (tr_loss_step, Trainer._tr_loss) in on_step_end."
    next_rows = [t for t in tensors if t.dim() == 2 and torch.equal(t, forwarded[1])]
    assert next_rows, f"{where}: the prefetched next batch is no longer found in the data iterator's generator locals."


@pytest.mark.parametrize("package", LIGHTNING_PACKAGES)
def test_lightning_loop_results_for_the_pytest_plugin(package, tmp_path):
    """``loop._results`` (each loop's ``_ResultCollection``: the metrics ``self.log`` keeps as tensors),
    which the pytest plugin's ``lightning_bookkeeping`` counts as carry-over, not as a leak."""
    L = importlib.import_module(package)

    class Logs(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch).sum()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)

    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=3, logger=False))
    trainer.fit(Logs())
    results = getattr(trainer.fit_loop.epoch_loop, "_results", None)
    assert results is not None and hasattr(results, "values"), (
        f"{package}: fit_loop.epoch_loop._results is gone or no longer a mapping; the pytest plugin's "
        "lightning_bookkeeping (memcallbacks/pytest_plugin/attach.py) would count logged metrics as a leak. Find the new name."
    )
    metrics = list(results.values())
    assert metrics and any(isinstance(v, torch.Tensor) for m in metrics for v in vars(m).values()), (
        f"{package}: the logged metrics in _results hold no tensors in their attributes any more; update lightning_bookkeeping."
    )
