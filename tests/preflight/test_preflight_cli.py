"""``memcallbacks preflight`` run as a subprocess: the table, the batch that fits, one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from memcallbacks.preflight import predict
from preflight_zoo import TinyMLP


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "memcallbacks", "preflight", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def gpt2_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GPT2Config

    folder = tmp_path_factory.mktemp("gpt2")
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0).save_pretrained(folder)
    return folder / "config.json"


def test_cli_prints_phases_and_top_modules_for_a_transformers_config(gpt2_config: Path) -> None:
    out = _cli("--hf-config", str(gpt2_config), "--batch", "input_ids:int64[4,64]", "--device", "cuda",
               "--capacity", "80GB", "--precision", "bf16-mixed")
    assert out.returncode == 0, out.stderr
    for word in ("forward", "backward", "optimizer", "top modules", "transformer.h.0.attn", "batch size 4 fits"):
        assert word in out.stdout


def test_cli_finds_the_largest_batch_that_fits() -> None:
    args = ("--model", "preflight_zoo:TinyMLP", "--batch", "float32[8,64]", "--batch", "int64[8]", "--loss", "cross_entropy",
            "--device", "cpu", "--capacity", "2MB")
    out = _cli(*args, "--find-max-batch")
    assert out.returncode == 0, out.stderr
    fitted = int(out.stdout.rsplit("batch size ", 1)[1].split()[0])
    assert fitted > 8 and "fits 1.9 MiB" in out.stdout

    def peak(n: int) -> int:  # the same prediction in process: n fits, n + 1 does not
        batch = (torch.empty(n, 64, device="meta"), torch.empty(n, dtype=torch.long, device="meta"))
        return predict(TinyMLP(), batch, "adamw", loss_fn=F.cross_entropy, device="cpu").peak_bytes

    assert peak(fitted) <= 2 * 10**6 < peak(fitted + 1)


def test_cli_positional_batch_with_a_model_class() -> None:
    out = _cli("--model", "torch.nn:Identity", "--batch", "float32[8,4]", "--device", "cpu", "--optimizer", "none")
    # Identity has no parameters and nothing to differentiate: a clear error, not a traceback
    assert out.returncode in (1, 2) and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--batch", "input_ids:int64[8,x]"], "--batch"),
        (["--batch", "input_ids:float128[8,2]"], "--batch"),
        (["--batch", "input_ids:int64[8,2]", "--capacity", "12XB"], "--capacity"),
        (["--batch", "input_ids:int64[8,2]", "--find-max-batch"], "--find-max-batch"),
        (["--batch", "input_ids:int64[8,2]", "--precision", "fp8"], "precision"),
    ],
)
def test_cli_bad_specs_are_one_line_naming_the_field(gpt2_config: Path, args: list[str], field: str) -> None:
    out = _cli("--hf-config", str(gpt2_config), *args)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and field in out.stderr and "Traceback" not in out.stderr
