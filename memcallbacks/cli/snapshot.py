"""``memcallbacks render`` and ``memcallbacks summary``: read any memory snapshot pickle offline."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["register"]


def _add_analysis_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("snapshot", help="a .pickle from torch.cuda.memory._dump_snapshot(), memcallbacks' dump_snapshot() or CpuCapture")
    parser.add_argument("--top", type=int, default=10, metavar="N", help="rows per table (default: 10)")
    parser.add_argument(
        "--between", nargs=2, type=int, metavar=("START", "END"),
        help="trace entry counts bounding the 'allocated but not freed' window "
             "(default: second to last step mark, else a third into the trace to its end)",
    )
    parser.add_argument("--trigger", type=int, metavar="ENTRY", help="mark this trace entry count as the trigger")
    parser.add_argument("--device", type=int, metavar="INDEX", help="only this device's trace (default: every device with data)")


def _load(command: str, path_text: str) -> tuple[Any, int]:
    from memcallbacks.snapshot import SnapshotError, load_snapshot

    path = Path(path_text)
    try:
        exists = path.exists()
    except OSError as exc:  # a name longer than the OS allows, say
        print(f"memcallbacks {command}: cannot look up {path_text[:200]}: {exc.strerror or exc}", file=sys.stderr)
        return None, 2
    if not exists:
        print(f"memcallbacks {command}: no such file: {path_text}", file=sys.stderr)
        return None, 2
    try:
        return load_snapshot(path), 0
    except SnapshotError as exc:
        print(f"memcallbacks {command}: {exc}", file=sys.stderr)
        return None, 2
    except OSError as exc:
        print(f"memcallbacks {command}: cannot read {path_text}: {exc.strerror or exc}", file=sys.stderr)
        return None, 2


def _analysis_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if args.top <= 0:
        raise ValueError(f"--top {args.top} must be positive; try 10.")
    window = tuple(args.between) if args.between else None
    if window is not None and min(window) < 0:
        raise ValueError(f"--between {window[0]} {window[1]}: trace entry counts start at 0; pass two counts >= 0.")
    if window is not None and window[1] < window[0]:
        raise ValueError(f"--between {window[0]} {window[1]}: START must not be after END.")
    if args.trigger is not None and args.trigger < 0:
        raise ValueError(f"--trigger {args.trigger}: trace entry counts start at 0; pass a count >= 0.")
    return {"top": args.top, "window": window, "trigger": args.trigger}


def _check_device(snapshot: dict[str, Any], device: int | None) -> None:
    """``--device`` must name a device the snapshot holds data for."""
    if device is None:
        return
    found = {i for i, trace in enumerate(snapshot.get("device_traces") or []) if trace}
    found |= {int(s.get("device", 0) or 0) for s in snapshot.get("segments") or []}
    if device not in found:
        held = ", ".join(map(str, sorted(found))) or "none"
        raise ValueError(f"--device {device}: the snapshot has no data for that device (devices with data: {held}).")


def _run_summary(args: argparse.Namespace) -> int:
    from memcallbacks.snapshot import format_summary, summarize_snapshot

    snapshot, rc = _load("summary", args.snapshot)
    if snapshot is None:
        return rc
    try:
        _check_device(snapshot, args.device)
        summary = summarize_snapshot(snapshot, source=args.snapshot, device=args.device, **_analysis_kwargs(args))
    except ValueError as exc:
        print(f"memcallbacks summary: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


def _run_render(args: argparse.Namespace) -> int:
    from memcallbacks.snapshot import render_snapshot

    snapshot, rc = _load("render", args.snapshot)
    if snapshot is None:
        return rc
    src = Path(args.snapshot)
    out = Path(args.output) if args.output else src.with_suffix(".html")
    if out.is_dir():
        out = out / f"{src.stem}.html"
    elif out.suffix.lower() not in (".html", ".htm"):
        out = out.with_name(out.name + ".html")
    try:
        kwargs = _analysis_kwargs(args)
        if args.device is not None:
            print("memcallbacks render: --device is for 'summary'; render draws every device.", file=sys.stderr)
        written = render_snapshot(snapshot, out, source=args.snapshot, **kwargs)
    except ValueError as exc:
        print(f"memcallbacks render: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"memcallbacks render: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    for kind in ("html", "png"):
        if kind in written:
            print(f"wrote {written[kind]}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    render = subparsers.add_parser(
        "render",
        help="offline HTML + PNG summary of a memory snapshot pickle (no network needed)",
        description="Write one self-contained HTML file (images inline, no scripts) and a PNG: memory over the "
                    "trace with the trigger marked, the largest live allocations at the peak with their Python "
                    "frames, and what was allocated but not freed between two points.",
    )
    _add_analysis_args(render)
    render.add_argument("-o", "--output", metavar="OUT", help="the HTML file (PNG beside it) or a folder; default: SNAPSHOT with .html")
    render.set_defaults(func=_run_render)

    summary = subparsers.add_parser(
        "summary",
        help="text summary of a memory snapshot pickle: peak, top allocation sites, what stayed alive",
    )
    _add_analysis_args(summary)
    summary.set_defaults(func=_run_summary)
