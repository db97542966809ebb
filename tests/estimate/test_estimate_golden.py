"""estimate() over a fixed grid of configurations gives the numbers recorded in tests/data/estimate_golden.json.

The grid was recorded before ``estimate()`` and ``compute_states()`` were split into helpers (issue 10): a
change in how the arithmetic is organised must keep every field, note and error message bit-for-bit.
It mixes valid and invalid configurations, models and counts, optimizer names and live optimizers.
Regenerate only for an intended change of a formula or message, and say why in the commit:
``python tests/estimate/test_estimate_golden.py --write``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from memcallbacks.estimate import MemoryEstimate, estimate, estimate_for

GOLDEN = Path(__file__).parents[1] / "data" / "estimate_golden.json"
CASES = 320


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.down = nn.Linear(hidden, width, bias=False)


class Blocks(nn.Module):
    """Repeated blocks in a ModuleList, odd dim-0 sizes (uneven FSDP2 chunks), frozen, int and 0-dim params."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 12)
        self.layers = nn.ModuleList([Block(12, 21) for _ in range(3)])
        self.layers[0].norm.requires_grad_(False)
        self.counter = nn.Parameter(torch.zeros(7, dtype=torch.int32), requires_grad=False)
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.head = nn.Linear(12, 5, bias=False)


class NoSplit(nn.Module):
    """Units named by ``_no_split_modules``, an embedding tied to the head."""

    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(19, 8)
        self.first = Block(8, 13)
        self.second = Block(8, 9)
        self.head = nn.Linear(8, 19, bias=False)
        self.head.weight = self.embed.weight


MODELS: dict[str, Callable[[], nn.Module]] = {
    "blocks": Blocks,
    "no_split": NoSplit,
    "flat": lambda: nn.Sequential(nn.Linear(9, 30), nn.ReLU(), nn.Linear(30, 3)),
}


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    half = len(trainable) // 2
    return [{"params": trainable[:half], "amsgrad": True}, {"params": trainable[half:-1]}]  # last one outside


OPTIMIZER_INSTANCES: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "AdamW_groups": lambda m: torch.optim.AdamW(_groups(m)),
    "Adam_fused": lambda m: torch.optim.Adam([p for p in m.parameters() if p.requires_grad], fused=True),
    "SGD_momentum": lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9),
    "RMSprop_centered": lambda m: torch.optim.RMSprop([p for p in m.parameters() if p.requires_grad], centered=True),
    "Adagrad": lambda m: torch.optim.Adagrad([p for p in m.parameters() if p.requires_grad]),
    "Adafactor": lambda m: torch.optim.Adafactor([p for p in m.parameters() if p.requires_grad]),
}

OPTIMIZER_NAMES = [
    "adam", "adamw+amsgrad", "sgd", "sgd+momentum", "sgd+nesterov", "adagrad+fused", "rmsprop+momentum+centered",
    "adafactor", "adam+fused", "adamw+capturable", "rmsprop+capturable", 8.0, 0, 12.5, "lion", "sgd+amsgrad",
]
PRECISIONS = ["fp32", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true", "32", "bf16", "16"]
STRATEGIES = ["single", "ddp", "fsdp", "fsdp2", "zero1", "zero2", "zero3", "deepspeed_stage_3", "FSDP1"]


def _case(rng: random.Random) -> dict[str, Any]:
    """One configuration, JSON-safe: models and optimizer instances by name."""
    strategy = rng.choice(STRATEGIES)
    world = 1 if strategy == "single" and rng.random() < 0.9 else rng.choice([1, 2, 3, 8, 16])
    case: dict[str, Any] = {"strategy": strategy, "world_size": world, "rank": rng.randrange(world)}
    if rng.random() < 0.5:
        case["model"] = rng.choice(list(MODELS))
        if rng.random() < 0.25:
            case["estimate_for"] = True
        if rng.random() < 0.15:
            case["layer_cls"] = rng.choice(["Block", "Linear", "Embedding"])
        elif rng.random() < 0.1:
            case["layer_names"] = {"blocks": ["layers.0", "layers.2"], "no_split": ["first"], "flat": ["0"]}[case["model"]]
        if rng.random() < 0.1:
            case["largest_layer_params"] = rng.choice([100, 1000])
        if rng.random() < 0.1:
            case["root_params"] = rng.choice([0, 50])
    else:
        case["num_params"] = rng.choice([4e9, 7e9, 1234567, 1e3])
        if rng.random() < 0.85:
            case["largest_layer_params"] = case["num_params"] / rng.choice([4, 32, 97])
        if rng.random() < 0.25:
            case["trainable_params"] = case["num_params"] * rng.choice([0.5, 0.9, 1.0])
        if rng.random() < 0.25:
            case["root_params"] = rng.choice([0, 1e6, 33])
    if "model" in case and rng.random() < 0.35:
        case["optimizer"] = "instance:" + rng.choice(list(OPTIMIZER_INSTANCES))
    elif rng.random() < 0.9:
        case["optimizer"] = rng.choice(OPTIMIZER_NAMES)
    if rng.random() < 0.9:
        case["precision"] = rng.choice(PRECISIONS)
    fsdp = strategy in ("fsdp", "fsdp2", "FSDP1")
    if fsdp and rng.random() < 0.5:
        case["sharding"] = rng.choice(["grad_op", "hybrid", "HYBRID_SHARD", "full"])
        if case["sharding"].lower().startswith("hybrid") and rng.random() < 0.9:
            case["shard_group_size"] = rng.choice([d for d in range(1, world + 1) if world % d == 0])
    if rng.random() < 0.03:
        case["sharding"] = "grad_op"  # mostly invalid outside FSDP
    zero = strategy.startswith(("zero", "deepspeed"))
    if (zero and rng.random() < 0.4) or rng.random() < 0.03:
        case["offload_optimizer"] = True
    if ((fsdp or strategy in ("zero3", "deepspeed_stage_3")) and rng.random() < 0.3) or rng.random() < 0.03:
        case["offload_param"] = True
    if rng.random() < 0.4:
        case["gradient_accumulation_steps"] = rng.choice([1, 2, 4])
        case["no_sync"] = rng.random() < 0.5
    for flag, chance in (("set_to_none", 0.2), ("gradient_as_bucket_view", 0.3), ("zero_init", 0.3), ("conservative", 0.4)):
        if rng.random() < chance:
            case[flag] = rng.random() < 0.5
    if rng.random() < 0.2:
        case["reduce_bucket_size"] = rng.choice([0, 1000, 500_000_000])
    if rng.random() < 0.25:
        case["prefetch_layers"] = rng.choice([0, 1, 2])
    if rng.random() < 0.05:
        case["ranks_per_node"] = rng.choice([1, 4])
    if case.get("estimate_for"):
        for key in ("strategy", "world_size", "rank"):  # read from the (plain) model: single, 1, 0
            del case[key]
    return case


def _run(case: dict[str, Any]) -> list[Any] | dict[str, str]:
    """The label and every field of the estimate, in field order, or the error message."""
    kwargs = dict(case)
    model = MODELS[kwargs.pop("model")]() if "model" in kwargs else None
    if str(kwargs.get("optimizer", "")).startswith("instance:"):
        assert model is not None
        kwargs["optimizer"] = OPTIMIZER_INSTANCES[kwargs["optimizer"].split(":", 1)[1]](model)
    try:
        if kwargs.pop("estimate_for", False):
            result: MemoryEstimate = estimate_for(model, **kwargs)
        else:
            result = estimate(model, **kwargs)
    except ValueError as error:
        return {"error": str(error)}
    return [result.label, *(getattr(result, f.name) for f in dataclasses.fields(MemoryEstimate))]


def _cases() -> list[dict[str, Any]]:
    rng = random.Random(20240610)
    return [_case(rng) for _ in range(CASES)]


def _record() -> dict[str, Any]:
    fields = ["label", *(f.name for f in dataclasses.fields(MemoryEstimate))]
    return {"fields": fields, "cases": [[case, _run(case)] for case in _cases()]}


@functools.cache
def _recorded() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


def test_recorded_grid_is_the_grid_this_file_generates() -> None:
    recorded = _recorded()
    assert recorded["fields"] == ["label", *(f.name for f in dataclasses.fields(MemoryEstimate))]
    assert [case for case, _ in recorded["cases"]] == json.loads(json.dumps(_cases()))
    errors = sum(isinstance(result, dict) for _, result in recorded["cases"])
    assert 0 < errors < len(recorded["cases"]) // 3  # both paths exercised, mostly valid configurations


@pytest.mark.parametrize("index", range(CASES))
def test_estimate_equals_recorded(index: int) -> None:
    case, expected = _recorded()["cases"][index]
    assert json.loads(json.dumps(_run(case))) == expected


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/estimate/test_estimate_golden.py --write")
    record = _record()
    lines = [json.dumps(row, separators=(",", ":")) for row in record["cases"]]  # one case a line: readable diffs
    GOLDEN.write_text('{"fields":' + json.dumps(record["fields"]) + ',"cases":[\n' + ",\n".join(lines) + "\n]}\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
