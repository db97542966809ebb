"""``memcallbacks compare A B``: two runs side by side; exit 1 when a phase's peak grew past a limit."""

from __future__ import annotations

import argparse
import sys

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    from memcallbacks._files.compare_runs import compare_text, increases, parse_threshold, run_figures
    from memcallbacks._files.report import load_output_dir

    try:
        threshold = parse_threshold(args.fail_on_increase) if args.fail_on_increase is not None else None
        runs = [run_figures(*load_output_dir(folder)) for folder in (args.a, args.b)]
    except (FileNotFoundError, ValueError) as exc:
        print(f"memcallbacks compare: {exc}", file=sys.stderr)
        return 2
    print(compare_text(runs[0], runs[1], (args.a_name or "A", args.b_name or "B")))
    if threshold is None:
        return 0
    grown = increases(runs[0], runs[1], *threshold)
    for line in grown:
        print(f"FAIL: {line}")
    if not grown:
        print(f"ok: no phase's peak grew past {args.fail_on_increase}")
    return 1 if grown else 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("compare", help="two runs side by side: per-phase peaks, step-start growth, findings, own time")
    parser.add_argument("a", help="the first run: its output folder or a run folder that holds it (the baseline)")
    parser.add_argument("b", help="the second run (the change)")
    parser.add_argument("--fail-on-increase", metavar="LIMIT",
                        help="exit 1 when a phase's peak in B exceeds A's by more than LIMIT: a percentage of A's peak (5%%) or a size (64MiB)")
    parser.add_argument("--a-name", help="the first run's column title (default A)")
    parser.add_argument("--b-name", help="the second run's column title (default B)")
    parser.set_defaults(func=_run)
