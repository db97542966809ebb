"""Two networks, two optimizers: the way pytorch/examples' ``dcgan/main.py`` trains a GAN.

Modelled on that script (not copied): a generator and a discriminator of strided (transposed)
convolutions with BatchNorm, two Adam optimizers, and per iteration the discriminator's update on
``netD(real)`` and ``netD(fake.detach())``, then the generator's through ``netD(fake)``. A plain
``Monitor`` at defaults watches one of the two networks, as a user would pass "the model".

Watching the discriminator, one iteration is two steps (its optimizer step, then the generator's),
and the script's variables (``errG``, ``errD_real``) live one iteration: the graphs of three steps
were alive at once at step 3, and two at every step after. The graph-chain rule reported that
transient as growth, a false alarm; a chain is now confirmed at a second check that still sees its
oldest graph. The planted bug, a running total of the losses without ``.item()``, is a chain.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers import open_problems
from memcallbacks import Monitor

pytestmark = pytest.mark.usefixtures("one_thread")

NZ, NGF, NDF, NC, BATCH = 16, 16, 16, 3, 32


def generator() -> nn.Module:
    return nn.Sequential(
        nn.ConvTranspose2d(NZ, NGF * 4, 4, 1, 0, bias=False), nn.BatchNorm2d(NGF * 4), nn.ReLU(True),
        nn.ConvTranspose2d(NGF * 4, NGF * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(NGF * 2), nn.ReLU(True),
        nn.ConvTranspose2d(NGF * 2, NGF, 4, 2, 1, bias=False), nn.BatchNorm2d(NGF), nn.ReLU(True),
        nn.ConvTranspose2d(NGF, NC, 4, 2, 1, bias=False), nn.Tanh(),
    )


def discriminator() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(NC, NDF, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(NDF * 2), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(NDF * 2, NDF * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(NDF * 4), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(NDF * 4, 1, 4, 1, 0, bias=False), nn.Sigmoid(),
    )


def train(out: Path, watch: str, iterations: int, running_total: bool = False) -> dict[str, Any]:
    torch.manual_seed(999)
    netG, netD = generator(), discriminator()
    criterion = nn.BCELoss()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    monitor = Monitor(netD if watch == "D" else netG, output_dir=str(out))
    data = [torch.randn(BATCH, NC, 32, 32) for _ in range(25)]
    total: Any = 0.0
    for i in range(iterations):
        real = data[i % len(data)]
        netD.zero_grad()
        label = torch.full((BATCH,), 1.0)
        output = netD(real).view(-1)
        errD_real = criterion(output, label)
        errD_real.backward()
        fake = netG(torch.randn(BATCH, NZ, 1, 1))
        label.fill_(0.0)
        output = netD(fake.detach()).view(-1)
        errD_fake = criterion(output, label)
        errD_fake.backward()
        errD = errD_real + errD_fake
        optimizerD.step()
        netG.zero_grad()
        label.fill_(1.0)
        output = netD(fake).view(-1)
        errG = criterion(output, label)
        errG.backward()
        optimizerG.step()
        total = total + errD + errG if running_total else total + errD.item() + errG.item()  # BUG when running_total
    monitor.close()
    return json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("watch", ["D", "G"])
def test_dcgan_at_defaults_raises_no_false_alarm(tmp_path: Path, watch: str) -> None:
    report = train(tmp_path / "mem", watch, 75)
    steps = report["summary"]["steps_seen"]
    # netD: each iteration's two optimizer steps are two rows, and before the first optimizer step is seen (none
    # was passed) each forward is a row, as for any loop with no optimizer known: the first iteration is three
    assert steps == (1 + 2 * 75 if watch == "D" else 75), steps
    false_alarms = open_problems(report)
    assert false_alarms == [], [f["message"] for f in false_alarms]


@pytest.mark.parametrize("watch", ["D", "G"])
def test_a_running_total_of_the_losses_is_a_chain(tmp_path: Path, watch: str) -> None:
    report = train(tmp_path / "mem", watch, 20, running_total=True)
    chain = next(f for f in report["findings"] if f["kind"] == "growth")
    assert chain["details"]["evidence"] == "graph_chain" and chain["first_step"] <= 6, chain["message"]
    assert any("train() local total" in h for h in chain["holders"]), chain["holders"]
