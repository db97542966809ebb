"""User-facing messages name the public class the user created, never a private one."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch


def test_transformers_warning_names_the_callback_not_its_private_monitor(tmp_path, caplog):
    transformers = pytest.importorskip("transformers")
    from memcallbacks.transformers import MemoryMonitorCallback

    class KeepsLogits(transformers.Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
            outputs = model(**inputs)
            self._train_logits = outputs.logits  # kept until the next step overwrites it: lingering advice
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=2048, n_positions=32, use_cache=False)
    ids = torch.randint(0, 2048, (32, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]  # logits: 8 x 32 x 2048 float32 = 2 MiB
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=4, per_device_train_batch_size=8,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, logging_steps=50,
    )
    monitor = MemoryMonitorCallback(output_dir=str(tmp_path / "mem"), plot=False)
    caplog.set_level(logging.INFO, logger="memcallbacks")
    KeepsLogits(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=data, callbacks=[monitor]).train()
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("memcallbacks")]
    # one step's kept logits: advice (issue 24), named by the public class like any finding
    assert any(m.startswith(("MemoryMonitorCallback found a memory problem", "MemoryMonitorCallback has advice")) for m in messages), messages
    assert not any("_TrainerMonitor" in m for m in messages), [m for m in messages if "_TrainerMonitor" in m]
