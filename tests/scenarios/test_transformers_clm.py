"""Causal-LM fine-tuning the way transformers' ``examples/pytorch/language-modeling/run_clm.py`` does it.

Modelled on that script (not copied): documents of varying length concatenated and cut into fixed blocks
(``group_texts``), labels a copy of the inputs, ``default_data_collator``, a GPT-2 built from a config, and
the ``Trainer`` with its defaults but for what the example passes on the command line (an evaluation and a
checkpoint every 50 steps). The monitor is ``MemoryMonitorCallback()`` with no argument. Files are read back
from ``report.json``.

The planted bug: a ``Trainer`` subclass that keeps every step's logits for a metric computed at the end
(``compute_loss`` appending ``outputs.logits.detach()``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import open_problems  # noqa: E402
from memcallbacks.transformers import MemoryMonitorCallback  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_accelerate_state")

BLOCK, VOCAB, STEPS = 64, 512, 150


class KeepingTrainer(transformers.Trainer):
    """BUG: keeps every step's logits to compute a metric at the end of training."""

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **kwargs)
        self.kept_logits = getattr(self, "kept_logits", [])
        self.kept_logits.append(outputs.logits.detach())
        return (loss, outputs) if return_outputs else loss


def group_texts(documents: list[list[int]]) -> list[dict[str, list[int]]]:
    """Concatenate the tokenized documents and cut them into blocks of BLOCK tokens (the rest dropped)."""
    concatenated = [token for document in documents for token in document]
    total = len(concatenated) // BLOCK * BLOCK
    blocks = [concatenated[i:i + BLOCK] for i in range(0, total, BLOCK)]
    return [{"input_ids": b, "attention_mask": [1] * BLOCK, "labels": list(b)} for b in blocks]


def run(tmp_path: Path, trainer_class: type = transformers.Trainer) -> dict[str, Any]:
    torch.manual_seed(0)
    lengths = torch.randint(20, 400, (600,)).tolist()
    blocks = group_texts([torch.randint(VOCAB, (n,)).tolist() for n in lengths])
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=BLOCK, bos_token_id=0, eos_token_id=0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=8,
        per_device_eval_batch_size=8, eval_strategy="steps", eval_steps=50, save_steps=50, report_to="none",
    )
    trainer = trainer_class(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=blocks[:-40],
                            eval_dataset=blocks[-40:], data_collator=transformers.default_data_collator,
                            callbacks=[MemoryMonitorCallback()])
    trainer.train()
    assert len(list((tmp_path / "out").glob("checkpoint-*"))) == STEPS // 50
    return json.loads((tmp_path / "out" / "memcallbacks" / "report.json").read_text())


def test_run_clm_at_defaults_raises_no_false_alarm(tmp_path):
    report = run(tmp_path)
    assert report["summary"]["steps_seen"] == STEPS
    false_alarms = open_problems(report)
    assert false_alarms == [], [f["message"] for f in false_alarms]
    assert report["verdict"][0].startswith(f"memcallbacks: no problem found in {STEPS} steps"), report["verdict"]
    assert report["summary"]["eval"]["validate"]["runs"] == STEPS // 50  # each evaluation a row of its own


def test_kept_logits_are_found_with_their_holder(tmp_path):
    report = run(tmp_path, KeepingTrainer)  # 8 x 64 x 512 float32 logits kept a step: 1 MiB/step
    growth = next(f for f in report["findings"] if f["kind"] == "growth")
    assert growth["state"] == "open" and growth["first_step"] <= 20, growth["message"]
    assert any(h.startswith("KeepingTrainer.kept_logits grew by") for h in growth["holders"]), growth["holders"]
