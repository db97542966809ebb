"""Sequence classification the way accelerate's ``examples/nlp_example.py`` trains it.

Modelled on that script (not copied): a BERT classifier (here built from a small config), AdamW with a
linear warm-up schedule, everything through ``accelerator.prepare``, ``accelerator.backward``, and after
every epoch an evaluation in eval mode under ``no_grad`` with ``gather_for_metrics``. The monitor is
``AccelerateMemoryMonitor(accelerator)`` at defaults, with the loop under ``monitor.track()`` as the docs
show it, and without (the model's hooks find the steps): 150 steps, no false alarm either way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers import open_problems  # noqa: E402
from memcallbacks.accelerate import AccelerateMemoryMonitor  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_accelerate_state")

VOCAB, SEQ, BATCH, EPOCHS = 1000, 64, 16, 3


def examples(n: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(VOCAB, (n, SEQ))
    labels = torch.randint(2, (n,))
    return [{"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels[i]} for i in range(n)]


@pytest.mark.parametrize("track", [True, False], ids=["track", "hooks"])
def test_nlp_example_at_defaults_raises_no_false_alarm(tmp_path: Path, track: bool) -> None:
    from accelerate import Accelerator

    torch.manual_seed(42)
    accelerator = Accelerator(cpu=True)
    train_dl = torch.utils.data.DataLoader(examples(BATCH * 50), batch_size=BATCH, shuffle=True)
    eval_dl = torch.utils.data.DataLoader(examples(64), batch_size=32)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=256, max_position_embeddings=SEQ)
    model = transformers.BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=2e-5)
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, num_warmup_steps=10, num_training_steps=EPOCHS * 50)
    model, optimizer, train_dl, eval_dl, schedule = accelerator.prepare(model, optimizer, train_dl, eval_dl, schedule)
    monitor = AccelerateMemoryMonitor(accelerator, output_dir=str(tmp_path / "mem"))
    correct = total = 0
    for _ in range(EPOCHS):
        model.train()
        for batch in monitor.track(train_dl) if track else train_dl:
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        model.eval()
        for batch in eval_dl:
            with torch.no_grad():
                outputs = model(**batch)
            predictions, references = accelerator.gather_for_metrics((outputs.logits.argmax(dim=-1), batch["labels"]))
            correct += int((predictions == references).sum())
            total += len(references)
    monitor.close()
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    assert report["summary"]["steps_seen"] == EPOCHS * 50
    false_alarms = open_problems(report)
    assert false_alarms == [], [f["message"] for f in false_alarms]
    assert total == EPOCHS * 64
