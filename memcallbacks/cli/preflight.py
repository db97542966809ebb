"""``memcallbacks preflight``: predict one training step's memory per phase from a model and batch."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import torch

from memcallbacks.cli.estimate import load_hf_config, load_model_class, one_line, CliUsageError
from memcallbacks.estimate import PRECISIONS, STRATEGIES
from memcallbacks.estimate.tables import canonical_precision
from memcallbacks.estimate.tables import canonical_strategy as _canonical_strategy

__all__ = ["parse_batch_spec", "parse_bytes", "register", "run"]

_PROG = "memcallbacks preflight"
_EXAMPLES = """examples:
  memcallbacks preflight --hf-config ./gpt2-small/config.json --batch 'input_ids:int64[8,1024]' --device cuda --capacity 80GB --precision bf16-mixed --find-max-batch
  memcallbacks preflight --model mypkg.models:Net --batch 'float32[64,3,32,32]' --optimizer sgd+momentum

A batch spec is NAME:DTYPE[D0,D1,...] (a dict batch, the model is called as model(**batch)) or
DTYPE[...] (positional: one tensor is model(x), two are (x, y) with --loss). Dimension 0 is the
batch size. With --hf-config and no 'labels', labels = input_ids (a causal LM's loss).
"""
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SPEC = re.compile(r"^(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*):)?(?P<dtype>[a-z0-9]+)\[(?P<shape>[0-9, ]+)\]$")


# register() has the shape of cli/estimate.py's: each subcommand declares its own arguments
def register(subparsers: Any) -> None:
    """Add the ``preflight`` sub-command to an ``argparse`` sub-parsers object."""
    parser = subparsers.add_parser(
        "preflight",
        help="predict a training step's memory per phase, activations included",
        description="Run two training steps on fake tensors and print the steady-state step's per-phase peaks.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-config", metavar="PATH", help="a Transformers config.json (or its directory); built on the meta device")
    source.add_argument("--model", metavar="MODULE:CLASS", help="an importable nn.Module class, instantiated with no arguments on the meta device")
    parser.add_argument("--batch", action="append", required=True, metavar="SPEC", help="NAME:DTYPE[D0,...] or DTYPE[D0,...]; repeat for more tensors")
    parser.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, sgd+momentum, rmsprop, adagrad or none (default: adamw)")
    parser.add_argument("--loss", default=None, help="a torch.nn.functional loss for an (x, y) batch, e.g. cross_entropy")
    parser.add_argument("--precision", default="fp32", help=f"one of {', '.join(PRECISIONS)} or Lightning's strings (default: fp32)")
    parser.add_argument("--device", default="cuda", help="target device type (default: cuda)")
    parser.add_argument("--strategy", default="single", help=f"one of {', '.join(STRATEGIES)} (default: single)")
    parser.add_argument("--world-size", default="1", help="data-parallel ranks (default: 1)")
    parser.add_argument("--capacity", default=None, help="device memory, e.g. 80GB (1e9), 80GiB (2**30) or bytes")
    parser.add_argument("--find-max-batch", action="store_true", help="search the largest batch size that fits --capacity")
    parser.add_argument("--hopper", action="store_true", help="a Hopper-or-newer GPU (32 MiB cuBLAS workspace)")
    parser.add_argument("--json", action="store_true", help="print the prediction as JSON")
    parser.set_defaults(func=run)


def parse_bytes(text: str, field: str = "--capacity") -> int:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30, ``"1024"`` -> 1024."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or (unit and unit not in _UNITS) or float(match.group(1)) <= 0:
        raise CliUsageError(f"{field} {text!r} is not a size; pass e.g. 80GB, 80GiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[unit or "b"])


def parse_batch_spec(specs: list[str]) -> tuple[dict[str, tuple[torch.dtype, list[int]]], list[tuple[torch.dtype, list[int]]]]:
    """``['input_ids:int64[8,2048]']`` -> named and positional ``(dtype, shape)`` entries."""
    named: dict[str, tuple[torch.dtype, list[int]]] = {}
    positional: list[tuple[torch.dtype, list[int]]] = []
    for raw in specs:
        for spec in filter(None, (s.strip() for s in raw.split(";"))):
            match = _SPEC.match(spec)
            if match is None:
                raise CliUsageError(f"--batch {spec!r} is not NAME:DTYPE[D0,D1,...]; pass e.g. 'input_ids:int64[8,2048]'")
            dtype = getattr(torch, match.group("dtype"), None)
            if not isinstance(dtype, torch.dtype):
                raise CliUsageError(f"--batch {spec!r}: {match.group('dtype')!r} is not a torch dtype; pass e.g. int64, float32, bfloat16")
            shape = [int(d) for d in match.group("shape").replace(" ", "").split(",") if d]
            if not shape or min(shape) < 1:
                raise CliUsageError(f"--batch {spec!r}: the shape needs at least one dimension, all positive")
            if match.group("name"):
                named[match.group("name")] = (dtype, shape)
            else:
                positional.append((dtype, shape))
    if named and positional:
        raise CliUsageError("--batch mixes named and positional tensors; name all of them (a dict batch) or none")
    return named, positional


def _make_batch_fn(named: dict[str, Any], positional: list[Any], hf: bool) -> Any:
    def make(n: int) -> Any:
        def empty(dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
            return torch.empty([n, *shape[1:]], dtype=dtype, device="meta")

        if named:
            batch = {k: empty(*v) for k, v in named.items()}
            if hf and "labels" not in batch and "input_ids" in batch:
                batch["labels"] = batch["input_ids"]
            return batch
        tensors = [empty(*v) for v in positional]
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    return make


def run(args: argparse.Namespace) -> int:
    """Print the prediction (and the batch that fits); 0, or 2 with one line on stderr for a bad input."""
    try:
        return _run(args)
    except CliUsageError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from memcallbacks._base.units import format_bytes
    from memcallbacks.preflight import PreflightError, max_batch_size, predict

    named, positional = parse_batch_spec(args.batch)
    capacity = parse_bytes(args.capacity) if args.capacity is not None else None
    if args.find_max_batch and capacity is None:
        raise CliUsageError("--find-max-batch needs --capacity; pass e.g. --capacity 80GB")
    if not args.world_size.isdigit() or int(args.world_size) < 1:
        raise CliUsageError(f"--world-size {args.world_size!r} is not a positive integer")
    try:
        canonical_precision(args.precision, "preflight")
        _canonical_strategy(args.strategy, "preflight")
    except ValueError as exc:
        raise CliUsageError(str(exc).replace("preflight(): ", "--")) from None
    loss_fn = None
    if args.loss is not None:
        loss_fn = getattr(torch.nn.functional, args.loss, None)
        if not callable(loss_fn):
            raise CliUsageError(f"--loss {args.loss!r} is not a torch.nn.functional loss; pass e.g. cross_entropy or mse_loss")
    optimizer = None if args.optimizer.lower() == "none" else args.optimizer
    model = load_hf_config(args.hf_config) if args.hf_config else load_model_class(args.model)
    make = _make_batch_fn(named, positional, bool(args.hf_config))
    size = (next(iter(named.values())) if named else positional[0])[1][0]
    kwargs = dict(loss_fn=loss_fn, precision=args.precision, device=args.device, strategy=args.strategy,
                  world_size=int(args.world_size), hopper=args.hopper)
    try:
        prediction = predict(model, make(size), optimizer, **kwargs)
        # the search reuses the prediction at the given batch size when it gets there
        fit = max_batch_size(model, make, capacity, optimizer, known={size: prediction}, **kwargs) if args.find_max_batch else None
    except ValueError as exc:
        raise CliUsageError(one_line(exc)) from None
    except PreflightError as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 1
    explanation = _explain(model, make(size), optimizer, prediction, capacity, args, loss_fn, fit) if capacity is not None else None
    if args.json:
        out = {"batch_size": size, "prediction": prediction.to_dict(), "capacity_bytes": capacity,
               "max_batch_size": fit.batch_size if fit else None, "max_batch_peak_bytes": fit.peak_bytes if fit else None,
               "explanation": explanation.to_dict() if explanation is not None else None}
        print(json.dumps(out, indent=2))
        return 1 if fit is not None and fit.batch_size == 0 else 0
    print(f"batch size {size}")
    print(prediction)
    if capacity is not None:
        verdict = "fits" if prediction.peak_bytes <= capacity else "does NOT fit"
        print(f"capacity {format_bytes(capacity)}: batch size {size} {verdict} "
              f"(peak {format_bytes(prediction.peak_bytes)} in {prediction.peak_phase})")
    if fit is not None:
        print(fit)
    if explanation is not None:
        print(explanation.text())
    if fit is not None and fit.batch_size == 0:  # no batch fits: a failure a script or CI can act on
        return 1
    return 0


def _explain(model: Any, batch: Any, optimizer: Any, prediction: Any, capacity: int, args: argparse.Namespace, loss_fn: Any,
             fit: Any) -> Any:
    """Above ``--capacity``: the explanation an out-of-memory error would get, with each remedy's predicted saving."""
    from memcallbacks.oom import StepModel, explain_prediction

    step = StepModel(model, batch, optimizer, args.precision, args.device, "default",
                     dict(loss_fn=loss_fn, strategy=args.strategy, world_size=int(args.world_size), hopper=args.hopper),
                     known=dict(fit.predictions) if fit is not None else {})
    return explain_prediction(step, prediction, capacity, "--capacity")
