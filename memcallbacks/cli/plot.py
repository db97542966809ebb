"""``memcallbacks plot FOLDER``: draw memory.png again from a run's history.csv."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    from memcallbacks._files.outputs import plot_history
    from memcallbacks._files.report import find_output_dir, load_output_dir, read_eval_history

    try:
        folder = find_output_dir(args.folder)
        report, history = load_output_dir(folder)
    except (FileNotFoundError, ValueError) as exc:
        print(f"memcallbacks plot: {exc}", file=sys.stderr)
        return 2
    if history is None or not len(history):
        print(f"memcallbacks plot: {str(folder)!r} has no history rows to draw.", file=sys.stderr)
        return 2
    summary = report.get("summary") or {}
    out = Path(args.output) if args.output else folder / "memory.png"
    title = args.title or f"{report.get('framework', '?')} on {summary.get('device', {}).get('device', '?')}"
    path = plot_history(history, out, title=title, peak_source=summary.get("device", {}).get("peak_source", ""),
                        eval_history=read_eval_history(folder, report), findings=report.get("findings"))
    if path is None:
        print("memcallbacks plot: matplotlib is not installed (pip install matplotlib).", file=sys.stderr)
        return 2
    print(path)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("plot", help="draw memory.png again from a run's history.csv")
    parser.add_argument("folder", help="the monitor's output folder, or a run folder that holds it (e.g. runs/example/version_0)")
    parser.add_argument("-o", "--output", help="the PNG to write (default: memory.png in the output folder)")
    parser.add_argument("--title", help="the plot's title (default: the framework and device)")
    parser.set_defaults(func=_run)
