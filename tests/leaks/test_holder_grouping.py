"""Holder lists name the right holder without noise: entries of one container (a kept output's KV cache)
make one line, and the loop's current ``loss`` (a few bytes) is not listed under the kept outputs."""

from __future__ import annotations

import torch
from torch import nn

from memcallbacks import Monitor


class KVModel(nn.Module):
    """Returns what a Transformers causal LM returns: loss, logits and a past_key_values tuple of tuples."""

    def __init__(self, vocab: int = 100, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.k = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.v = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.vocab = vocab

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict:
        h = self.emb(ids)
        pkv = tuple((k(h), v(h)) for k, v in zip(self.k, self.v))
        logits = self.head(h + sum(k + v for k, v in pkv))
        loss = nn.functional.cross_entropy(logits.view(-1, self.vocab), labels.view(-1))
        return {"loss": loss, "logits": logits, "past_key_values": pkv}


def test_kept_outputs_are_one_line_per_container_and_the_loss_is_not_listed(tmp_path):
    torch.manual_seed(0)
    model = KVModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, output_dir=str(tmp_path / "mem"), plot=False)
    for _ in range(5):
        ids = torch.randint(100, (16, 256))
        outputs = model(ids, ids)  # kept until the next step rebinds it (never `del`ed)
        loss = outputs["loss"] / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    finding = next(f for f in monitor.findings if f.key == "lingering:outputs")
    holders = finding.holders
    kv = [h for h in holders if "past_key_values" in h]
    # before: four lines, outputs['past_key_values'][1][1], [1][0], [0][1], [0][0]
    assert len(kv) == 1 and "outputs['past_key_values'][...]" in kv[0] and "(4 tensors, 4.0 MiB)" in kv[0], holders
    assert any("outputs['logits']" in h for h in holders), holders
    assert not any("['loss']" in h or "local loss" in h for h in holders), holders  # 4 bytes under 5.6 MiB of outputs: noise
    assert not any("param_groups" in h for h in holders), holders
    del outputs, loss
