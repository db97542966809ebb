"""Flakiness and cost of the pytest plugin: a clean training test, N times in a row.

Writes one test file with the same clean test copied N times, marked and unmarked, runs each set
in one pytest subprocess, and reports passes and the call time per test (pytest's --durations), so
the plugin's cost is the difference between the two. ``--framework lightning`` (the default): a
Lightning fit with validation, gradient accumulation, an LR scheduler, 8 optimizer steps on CPU.
``--framework transformers``: a Transformers ``Trainer`` on a tiny GPT-2 built from its config,
gradient accumulation 2, 8 optimizer steps on CPU. Run from the repository root:

    python benchmarks/pytest_plugin_stress.py --runs 50
    python benchmarks/pytest_plugin_stress.py --runs 50 --framework transformers
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TEST = '''
import pytest, torch
from torch import nn
import lightning.pytorch as L
from torch.utils.data import DataLoader, TensorDataset


class LitModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", ((self.net(x) - y) ** 2).mean())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1)}


def fit(tmp_path):
    data = TensorDataset(torch.randn(256, 64), torch.randn(256, 1))
    trainer = L.Trainer(max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        accumulate_grad_batches=2, val_check_interval=4, limit_val_batches=2)
    trainer.fit(LitModel(), DataLoader(data, batch_size=16), DataLoader(data, batch_size=16))
'''

TRANSFORMERS_TEST = '''
import pytest, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16):
        self.ids = torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def fit(tmp_path):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, use_cpu=True,
                             report_to=[], save_strategy="no", logging_steps=2, disable_tqdm=True,
                             gradient_accumulation_steps=2)
    Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=TokenData()).train()
'''

TESTS = {"lightning": TEST, "transformers": TRANSFORMERS_TEST}

CASE = '''

@pytest.mark.parametrize("run", range({runs}))
{marker}def test_clean_fit(run, tmp_path):
    fit(tmp_path)
'''

_DURATION = re.compile(r"^\s*([0-9.]+)s call\s+\S+::test_clean_fit\[")


def run_set(folder: Path, test: str, runs: int, marked: bool, extra: list[str]) -> tuple[int, int, list[float], str]:
    marker = "@pytest.mark.train_memory\n" if marked else ""
    path = folder / f"test_stress_{'marked' if marked else 'bare'}.py"
    path.write_text(test + CASE.format(runs=runs, marker=marker))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", "--durations=0",
           "--durations-min=0", str(path), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=folder)
    out = proc.stdout
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", out)) else 0
    failed = int(m.group(1)) if (m := re.search(r"(\d+) failed", out)) else 0
    times = [float(m.group(1)) for line in out.splitlines() if (m := _DURATION.match(line))]
    return passed, failed, times, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--framework", choices=sorted(TESTS), default="lightning")
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        results = {}
        for marked in (False, True):
            passed, failed, times, out = run_set(folder, TESTS[args.framework], args.runs, marked, extra)
            results[marked] = times
            label = "marked  " if marked else "unmarked"
            print(f"{label}: {passed}/{args.runs} passed, {failed} failed; call time per test: "
                  f"median {statistics.median(times):.3f} s, min {min(times):.3f} s, max {max(times):.3f} s")
            if failed:
                print(out[-6000:])
        extra_cost = statistics.median(results[True]) - statistics.median(results[False])
        print(f"plugin cost per test (median call time, marked - unmarked): {extra_cost:+.3f} s")


if __name__ == "__main__":
    main()
