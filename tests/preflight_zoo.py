"""The models pre-flight is checked against (tests use small sizes, benchmarks/preflight.py bigger ones).

Each case builds a real model, a batch, an optimizer and the forward_fn; ``precision`` is what
``predict`` gets (the real step runs under the matching CPU autocast).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


@dataclasses.dataclass
class Case:
    name: str
    model: nn.Module
    batch: Any
    optimizer: torch.optim.Optimizer
    forward_fn: Callable[[nn.Module, Any], torch.Tensor]
    precision: str = "fp32"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.precision)


def _xy_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def mlp(scale: int = 1, precision: str = "fp32") -> Case:
    d = 256 * scale
    model = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, 2 * d), nn.GELU(), nn.Linear(2 * d, 10))
    batch = (torch.randn(32 * scale, d), torch.randint(0, 10, (32 * scale,)))
    name = "mlp" if precision == "fp32" else f"mlp {precision}"
    return Case(name, model, batch, torch.optim.AdamW(model.parameters(), lr=1e-3), _xy_loss, precision)


def cnn(scale: int = 1) -> Case:
    c = 16 * scale
    model = nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(2 * c * 16, 10),
    )
    batch = (torch.randn(8 * scale, 3, 32, 32), torch.randint(0, 10, (8 * scale,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return Case("cnn", model, batch, opt, _xy_loss)


class _Encoder(nn.Module):
    def __init__(self, d: int, layers: int, vocab: int = 500) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, batch_first=True, dropout=0.1)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))


def encoder(scale: int = 1) -> Case:
    model = _Encoder(64 * scale, 2)
    ids = torch.randint(0, 500, (4 * scale, 64 * scale))

    def forward_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        logits = m(b)
        return F.cross_entropy(logits.flatten(0, 1), b.flatten())

    return Case("transformer encoder", model, ids, torch.optim.AdamW(model.parameters(), lr=1e-3), forward_fn)


def gpt2(scale: int = 1) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2 * scale, n_embd=64 * scale, n_head=4, vocab_size=1000, n_positions=256)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (2 * scale, 64 * scale))
    batch = {"input_ids": ids, "labels": ids}
    return Case("gpt2 (transformers)", model, batch, torch.optim.AdamW(model.parameters(), lr=1e-3),
                lambda m, b: m(**b).loss)


class _CheckpointedMLP(nn.Module):
    def __init__(self, d: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(blocks))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def checkpointed(scale: int = 1) -> Case:
    d = 128 * scale
    model = _CheckpointedMLP(d, 3)
    batch = (torch.randn(64 * scale, d), torch.randint(0, 10, (64 * scale,)))
    return Case("activation checkpointing", model, batch, torch.optim.AdamW(model.parameters(), lr=1e-3), _xy_loss)


CASES: dict[str, Callable[..., Case]] = {
    "mlp": mlp,
    "cnn": cnn,
    "encoder": encoder,
    "gpt2": gpt2,
    "checkpointed": checkpointed,
    "mlp-bf16": lambda scale=1: mlp(scale, "bf16-mixed"),
}


class TinyMLP(nn.Sequential):
    """Built with no arguments, for ``memcallbacks preflight --model preflight_zoo:TinyMLP``."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
