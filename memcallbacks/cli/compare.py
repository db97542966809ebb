"""``memcallbacks compare A B``: two runs side by side, exit 1 when the step's own memory grew."""

from __future__ import annotations

import argparse
import sys

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    from memcallbacks._files.compare_runs import compare_text, gate_words, increases, parse_threshold, run_figures
    from memcallbacks._files.report import load_output_dir

    names = (args.a_name or "A", args.b_name or "B")
    try:
        threshold = parse_threshold(args.fail_on_increase, "--fail-on-increase") if args.fail_on_increase is not None else None
        loaded = [load_output_dir(folder) for folder in (args.a, args.b)]
        runs = [run_figures(*run) for run in loaded]
    except (FileNotFoundError, ValueError) as exc:
        print(f"memcallbacks compare: {exc}", file=sys.stderr)
        return 2
    for name, folder, (report, _) in zip(names, (args.a, args.b), loaded):
        if report.get("unfinished"):  # read from its journal (docs/journal.md)
            print(f"note: {name} did not finish: its figures are what its journal recorded (memcallbacks report {folder})")
    print(compare_text(runs[0], runs[1], names))
    if threshold is None:
        return 0
    under_floor: list[str] = []
    grown = increases(runs[0], runs[1], *threshold, under_floor=under_floor)
    for line in grown:
        print(f"FAIL: {line}")
    if not grown:
        if under_floor:  # past the threshold, but by less than a CPU step's rise moves by between identical runs
            print(f"ok: {gate_words(*runs)} did not grow past {args.fail_on_increase} by more than it moves by between "
                  f"identical runs on CPU ({'; '.join(under_floor)}: docs/metrics.md#comparing-two-runs)")
        else:
            print(f"ok: {gate_words(*runs)} did not grow past {args.fail_on_increase}")
    return 1 if grown else 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("compare", help="two runs side by side: per-phase peaks, the step's own memory, the floor's change, findings, own time")
    parser.add_argument("a", help="the first run: its output folder or a run folder that holds it (the baseline)")
    parser.add_argument("b", help="the second run (the change)")
    parser.add_argument("--fail-on-increase", metavar="LIMIT",
                        help="exit 1 when the step's own memory in B (what a phase rose above its step's start; off CPU each phase's peak "
                        "too) exceeds A's by more than LIMIT: a percentage of A's figure (5%%) or a size (64MiB); on CPU forward's rise, "
                        "by more than 2 MiB as well (docs/metrics.md#comparing-two-runs)")
    parser.add_argument("--a-name", help="the first run's column title (default A)")
    parser.add_argument("--b-name", help="the second run's column title (default B)")
    parser.set_defaults(func=_run)
