"""The ``memcallbacks`` command line: one sub-command per feature module."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]

# each module defines ``register(subparsers)``, adding its sub-command with ``set_defaults(func=...)``
_SUBCOMMAND_MODULES = (
    "memcallbacks.cli.estimate",
    "memcallbacks.cli.preflight",
    "memcallbacks.cli.report",
    "memcallbacks.cli.compare",
    "memcallbacks.cli.plot",
    "memcallbacks.cli.snapshot",
)


def build_parser() -> argparse.ArgumentParser:
    from memcallbacks import __version__

    parser = argparse.ArgumentParser(prog="memcallbacks", description="Training-memory tools: estimates, reports, snapshots.")
    parser.add_argument("--version", action="version", version=f"memcallbacks {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that feature is not part of this build
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # one line naming them, as for every other bad input (argparse would print the usage first)
        command = f"memcallbacks {args.command}" if getattr(args, "command", None) else "memcallbacks"
        print(f"{command}: error: unrecognized arguments: {' '.join(unknown)} (see {command} --help)", file=sys.stderr)
        return 2
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)
