"""The ``memcallbacks`` command line: one sub-command per feature module."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]

# each module defines ``register(subparsers)``, adding its sub-commands with ``set_defaults(func=...)``
_SUBCOMMAND_MODULES = {
    "memcallbacks.cli.estimate": ("estimate",),
    "memcallbacks.cli.preflight": ("preflight",),
    "memcallbacks.cli.report": ("report",),
    "memcallbacks.cli.compare": ("compare",),
    "memcallbacks.cli.plot": ("plot",),
    "memcallbacks.cli.snapshot": ("render", "summary"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every sub-command, or with ``command`` only of the module that defines it: the
    others' imports (torch, for ``estimate`` and ``preflight``) are a second that ``report`` need not wait."""
    from memcallbacks import __version__

    parser = argparse.ArgumentParser(prog="memcallbacks", description="Training-memory tools: estimates, reports, snapshots.")
    parser.add_argument("--version", action="version", version=f"memcallbacks {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    known = any(command in commands for commands in _SUBCOMMAND_MODULES.values())
    for name, commands in _SUBCOMMAND_MODULES.items():
        if known and command not in commands:
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that feature is not part of this build
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_in[0] if args_in else None)
    args, unknown = parser.parse_known_args(args_in)
    if unknown:  # one line naming them, as for every other bad input (argparse would print the usage first)
        command = f"memcallbacks {args.command}" if getattr(args, "command", None) else "memcallbacks"
        print(f"{command}: error: unrecognized arguments: {' '.join(unknown)} (see {command} --help)", file=sys.stderr)
        return 2
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)
