"""``memcallbacks report OUTPUT_DIR``: the text report of a finished (or crashed) run."""

from __future__ import annotations

import argparse
import sys

from memcallbacks._files.report import format_report, load_output_dir

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    try:
        report, history = load_output_dir(args.output_dir)
        text = format_report(report, history)
    except (FileNotFoundError, ValueError) as exc:
        print(f"memcallbacks report: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, AttributeError) as exc:  # a report.json of an unexpected shape deeper down
        print(f"memcallbacks report: {args.output_dir}: report.json has an unexpected shape ({type(exc).__name__}: {exc}); "
              "is it a memcallbacks report?", file=sys.stderr)
        return 2
    print(text)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("report", help="print findings and per-phase peaks from a monitor's output_dir")
    parser.add_argument("output_dir", help="the monitor's output folder (report.json, history.csv), or a run folder that holds it")
    parser.set_defaults(func=_run)
