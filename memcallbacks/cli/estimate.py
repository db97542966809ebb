"""``memcallbacks estimate``: model-state memory per rank for strategies and world sizes, a table."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memcallbacks.estimate import (
    GB,
    OPTIMIZERS,
    PRECISIONS,
    STRATEGIES,
    MemoryEstimate,
    compare,
    estimate_grid,
)

log = logging.getLogger(__name__)

__all__ = ["register", "run"]

_PROG = "memcallbacks estimate"

#: ``--params`` without ``--largest-layer``: the largest unit is assumed to hold this share of the
#: parameters (one block of a 32-block transformer, as in Llama-2-7B), and the output says so.
DEFAULT_LAYER_SHARE = 32
_EXAMPLES = """examples:
  memcallbacks estimate --params 4e9 --largest-layer 1e9 --precision bf16-mixed --strategies fsdp2 --world-sizes 8 --unit GB
  memcallbacks estimate --hf-config ./llama/config.json --strategies ddp,fsdp2,zero3 --world-sizes 8,64
  memcallbacks estimate --model mypkg.models:Net --optimizer sgd+momentum --format csv
"""


class CliUsageError(Exception):
    """A bad command line: reported as one line on stderr with exit code 2."""


def register(subparsers: Any) -> None:
    """Add the ``estimate`` sub-command to an ``argparse`` sub-parsers object."""
    parser = subparsers.add_parser(
        "estimate",
        help="estimate params/grads/optimizer/sharding memory per rank",
        description="Model-state memory per rank (no activations) for strategies and world sizes side by side.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", metavar="N", help="total parameter count, e.g. 7e9")
    source.add_argument("--hf-config", metavar="PATH", help="a Transformers config.json (or its directory); built on the meta device")
    source.add_argument("--model", metavar="MODULE:CLASS", help="an importable nn.Module class, instantiated with no arguments on the meta device")
    parser.add_argument("--largest-layer", metavar="N", help="parameters of the largest FSDP unit / ZeRO-3 gathered layer (with --params; "
                        f"default: params/{DEFAULT_LAYER_SHARE}, one block of a {DEFAULT_LAYER_SHARE}-block transformer, said in the output)")
    parser.add_argument("--trainable", metavar="N", help="parameters that are trained (with --params; default: all)")
    parser.add_argument("--layer-cls", metavar="NAMES", help="comma-separated class names of the FSDP units (with a model)")
    parser.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZERS)} with +flags (e.g. adamw+amsgrad), or bytes/param (default: adamw)")
    parser.add_argument("--precision", default="fp32", help=f"one of {', '.join(PRECISIONS)} or Lightning's strings (default: fp32)")
    parser.add_argument("--strategies", default="single,ddp,fsdp2,zero2,zero3", help=f"comma-separated, from {', '.join(STRATEGIES)}")
    parser.add_argument("--world-sizes", default="8", help="comma-separated data-parallel sizes (default: 8)")
    parser.add_argument("--sharding", default="full", help="FSDP sharding: full, grad_op or hybrid (default: full)")
    parser.add_argument("--shard-group-size", type=_int_flag("--shard-group-size"), default=None, help="ranks per shard group with --sharding hybrid")
    parser.add_argument("--offload-optimizer", action="store_true", help="ZeRO: optimizer state and master weights on the host")
    parser.add_argument("--offload-param", action="store_true", help="ZeRO-3/FSDP: sharded parameters on the host")
    parser.add_argument("--grad-accum", type=_int_flag("--grad-accum"), default=1, help="gradient accumulation steps (default: 1)")
    parser.add_argument("--ranks-per-node", type=_int_flag("--ranks-per-node"), default=None, help="ranks sharing a host (default: min(world size, 8))")
    parser.add_argument("--conservative", action="store_true", help="also count the backward-prefetched layer and reduced grad shards")
    parser.add_argument("--unit", default="GiB", choices=("GB", "GiB", "MB", "MiB", "bytes"), help="GB = 1e9 bytes, GiB = 2**30 (default: GiB)")
    parser.add_argument("--format", default="markdown", choices=("markdown", "csv"), help="output format (default: markdown)")
    parser.set_defaults(func=run)
    parser.error = _one_line_error  # type: ignore[method-assign]  # argparse's own errors: one line too, not usage + error


def _one_line_error(message: str) -> None:
    head, sep, rest = message.partition(": ")
    if head.startswith("argument --") and rest.startswith(head[len("argument "):]):
        message = rest  # our flag types name the flag themselves
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


#: Larger inputs are typos (1e30 for 1e13): the biggest models trained have ~1e12 parameters.
MAX_PARAMS = 1e15
MAX_RANKS = 10_000_000


def _int_flag(flag: str) -> Any:
    """An argparse type for a positive integer flag, with a message naming the flag and an example."""
    def parse(text: str) -> int:
        return _integer(text, flag)

    parse.__name__ = flag  # argparse names the type in its message when the conversion fails otherwise
    return parse


def _integer(text: str, flag: str, example: str = "8") -> int:
    stripped = text.strip()
    try:
        value = int(stripped)
    except ValueError:
        raise _usage(f"{flag} {text!r} is not a whole number; pass e.g. {flag} {example}") from None
    if not 1 <= value <= MAX_RANKS:
        raise _usage(f"{flag} {value} is out of range; pass a whole number from 1 to {MAX_RANKS:,}")
    return value


def _usage(message: str) -> Exception:
    # inside argparse (a flag's type) an ArgumentTypeError is reported as it is; elsewhere CliUsageError
    return argparse.ArgumentTypeError(message)


def run(args: argparse.Namespace) -> int:
    """Print the table; return 0, or 2 with a one-line message on stderr for a bad input."""
    try:
        estimates = _estimates(args)
    except (CliUsageError, ValueError) as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    table = compare(estimates, unit=args.unit)
    assumption = getattr(args, "assumption", None)
    if assumption:  # on stderr under --format csv, so the CSV stays machine-readable
        print(f"note: {assumption}", file=sys.stderr if args.format == "csv" else sys.stdout)
    if args.format == "csv":
        sys.stdout.write(table.to_csv())
    else:
        first = estimates[0]
        print(
            f"model states per rank: {first.num_params / GB:.3f}B params, largest layer {first.layer_params / GB:.3f}B, "
            f"optimizer {first.optimizer}, precision {first.precision}; activations not included"
        )
        print()
        print(_markdown(table))
    return 0


def _estimates(args: argparse.Namespace) -> list[MemoryEstimate]:
    strategies = _list(args.strategies, "--strategies", "ddp,fsdp2")
    world_sizes = [_int_list_item(w, "--world-sizes") for w in _list(args.world_sizes, "--world-sizes", "8,64")]
    common: dict[str, Any] = dict(
        optimizer=_optimizer_arg(args.optimizer),
        precision=args.precision,
        sharding=args.sharding,
        shard_group_size=args.shard_group_size,
        offload_optimizer=args.offload_optimizer,
        offload_param=args.offload_param,
        gradient_accumulation_steps=args.grad_accum,
        conservative=args.conservative,
    )
    if args.ranks_per_node is not None:
        common["ranks_per_node"] = args.ranks_per_node
    if args.params is not None:
        common["num_params"] = _number(args.params, "--params")
        if args.largest_layer is not None:
            common["largest_layer_params"] = _number(args.largest_layer, "--largest-layer")
        elif any(s.startswith("fsdp") or s == "zero3" for s in strategies):
            common["largest_layer_params"] = common["num_params"] / DEFAULT_LAYER_SHARE
            args.assumption = (
                f"assuming --largest-layer {common['largest_layer_params']:.3g} (params/{DEFAULT_LAYER_SHARE}: one block of a "
                f"{DEFAULT_LAYER_SHARE}-block transformer); pass --largest-layer for your model's largest FSDP unit / ZeRO-3 layer"
            )
        if args.trainable is not None:
            common["trainable_params"] = _number(args.trainable, "--trainable")
        if args.layer_cls:
            raise CliUsageError("--layer-cls needs a model (--hf-config or --model); with --params pass --largest-layer")
        model = None
    else:
        if args.trainable is not None:
            raise CliUsageError("--trainable applies to --params only")
        model = load_hf_config(args.hf_config) if args.hf_config else load_model_class(args.model)
        if args.largest_layer is not None:
            common["largest_layer_params"] = _number(args.largest_layer, "--largest-layer")
        if args.layer_cls:
            common["layer_cls"] = [c.strip() for c in args.layer_cls.split(",") if c.strip()]
    try:
        return estimate_grid(model, strategies=strategies, world_sizes=world_sizes, **common)
    except ValueError as exc:
        # the library names its own arguments; the CLI user knows the flags
        raise CliUsageError(_flag_names(str(exc))) from None


_FLAG_NAMES = {
    "estimate(): ": "",
    "estimate_grid(): ": "",
    "find_layers(): ": "",
    "largest_layer_params=": "--largest-layer ",
    "trainable_params=": "--trainable ",
    "num_params=": "--params ",
    "layer_cls=": "--layer-cls ",
    "shard_group_size=": "--shard-group-size ",
    "gradient_accumulation_steps=": "--grad-accum ",
    "ranks_per_node=": "--ranks-per-node ",
    "world_size=": "--world-sizes ",
    "offload_optimizer=": "--offload-optimizer ",
    "offload_param=": "--offload-param ",
    "strategy=": "--strategies ",
    "precision=": "--precision ",
    "optimizer=": "--optimizer ",
    "sharding=": "--sharding ",
}


def _flag_names(message: str) -> str:
    """The library's message with its argument names replaced by this command's flags."""
    for name, flag in _FLAG_NAMES.items():
        message = message.replace(name, flag)
    return message.replace(" None is required", " is required")


def _list(text: str, flag: str, example: str) -> list[str]:
    """A comma-separated flag's items; an empty list or an empty item (``8,,16``) is a usage error."""
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise CliUsageError(f"{flag} is empty; pass e.g. {flag} {example}")
    if not all(items):
        raise CliUsageError(f"{flag} {text!r} has an empty item (two commas, or one at an end); pass e.g. {flag} {example}")
    return items


def _number(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise CliUsageError(f"{flag} {text!r} is not a number; pass e.g. 7e9") from None
    if not value > 0 or value != value:
        raise CliUsageError(f"{flag} {text!r} must be > 0")
    if not value <= MAX_PARAMS:
        raise CliUsageError(f"{flag} {text!r} is more parameters than any model has (at most {MAX_PARAMS:.0e} is accepted); "
                          "pass e.g. 7e9 for 7 billion")
    return value


def _int_list_item(text: str, flag: str) -> int:
    try:
        return _integer(text, flag, example="8,64")
    except argparse.ArgumentTypeError as exc:
        raise CliUsageError(str(exc)) from None


def _optimizer_arg(text: str) -> str | float:
    try:
        return float(text)
    except ValueError:
        return text


def load_hf_config(path_text: str) -> nn.Module:
    path = Path(path_text).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CliUsageError(f"--hf-config {path_text!r}: no such file (expected a config.json or a directory holding one)")
    try:
        import transformers
    except ImportError:
        raise CliUsageError("--hf-config needs the 'transformers' package; pip install transformers") from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many types for a bad file
        raise CliUsageError(f"--hf-config {path_text!r} is not a Transformers config: {one_line(exc)}") from None
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:
            log.debug("%s is not a causal LM config; using AutoModel", path, exc_info=True)
            try:
                return transformers.AutoModel.from_config(config)
            except Exception as exc:
                raise CliUsageError(f"--hf-config {path_text!r}: cannot build a model from it: {one_line(exc)}") from None


def load_model_class(spec: str) -> nn.Module:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliUsageError(f"--model {spec!r} is not MODULE:CLASS; pass e.g. --model mypkg.models:Net")
    if "" not in sys.path and os.getcwd() not in sys.path:  # the installed script, like `python -m`, imports from here
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliUsageError(f"--model {spec!r}: cannot import {module_name!r}: {one_line(exc)}") from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise CliUsageError(f"--model {spec!r}: {module_name!r} has no attribute {attr!r}")
    with torch.device("meta"):
        try:
            model = target()
        except Exception as exc:
            raise CliUsageError(f"--model {spec!r}: calling it with no arguments failed: {one_line(exc)}") from None
    if not isinstance(model, nn.Module):
        raise CliUsageError(f"--model {spec!r} built a {type(model).__name__}, not an nn.Module")
    return model


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _markdown(table: Any) -> str:
    header = ["quantity", *[str(c) for c in table.columns]]
    rows = [[str(index), *[_fmt(v) for v in row]] for index, row in zip(table.index, table.itertuples(index=False))]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |"]
    lines.append("|" + "|".join([":" + "-" * (widths[0] + 1)] + ["-" * (w + 1) + ":" for w in widths[1:]]) + "|")
    for r in rows:
        lines.append("| " + " | ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]) + " |")
    return "\n".join(lines)


def _fmt(value: float) -> str:
    return f"{value:,.2f}" if abs(value) < 1e6 else f"{value:,.0f}"
