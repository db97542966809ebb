"""Plain-text rendering of a monitor's report: where memory went, per phase, in a form a person reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memcallbacks._base.columns import frame_column
from memcallbacks._base.findings import evidence_lines, finding_counts, finding_label, step_text
from memcallbacks._base.units import format_bytes, format_delta, ordinal
from memcallbacks._files.verdict import measure_names, verdict_lines

__all__ = ["format_report", "load_output_dir", "find_output_dir", "read_eval_history"]


def find_output_dir(folder: str | Path) -> Path:
    """The monitor's output folder for ``folder``: itself when it holds a report, else the one
    report folder below it (a run folder such as ``runs/example/version_0`` holds ``memcallbacks/``).
    Several below it: a ``ValueError`` listing them."""
    folder = Path(folder)
    try:
        if not folder.is_dir() or _has_report(folder):
            return folder
        found = sorted({p.parent for depth in ("*", "*/*", "*/*/*") for name in ("report.json", "report.rank*.json", "journal*.jsonl")
                        for p in folder.glob(f"{depth}/{name}")})
    except OSError:
        return folder  # load_output_dir says what is wrong with it
    if len(found) > 1:
        listed = ", ".join(str(p) for p in found[:5]) + (" ..." if len(found) > 5 else "")
        raise ValueError(f"{str(folder)!r} holds {len(found)} memcallbacks output folders ({listed}); pass one of them.")
    return found[0] if found else folder


def _has_report(folder: Path) -> bool:
    return (folder / "report.json").is_file() or any(folder.glob("report.rank*.json")) or any(folder.glob("journal*.jsonl"))


def load_output_dir(folder: str | Path) -> tuple[dict[str, Any], Any]:
    """Read ``report.json`` (or the rank-zero one) and its history CSV from a monitor's output_dir; for a run
    that did not finish (a journal whose run id no report matches: unfinished.py), what its journal recorded,
    with an ``unfinished`` section that :func:`format_report` says first.

    Raises ``FileNotFoundError`` or ``ValueError`` with one line naming the file and what is
    wrong: not a folder, no report, a report of the wrong shape, a history that is not a
    memcallbacks CSV or not the one the report was written with."""
    from memcallbacks._files.fileset import check_fingerprint

    folder = find_output_dir(folder)
    try:
        is_dir = folder.is_dir()
    except OSError as exc:  # a name longer than the OS allows, say
        raise FileNotFoundError(f"{str(folder)[:200]!r} cannot be looked up ({exc.strerror or exc}).") from None
    if not is_dir:
        raise FileNotFoundError(f"{str(folder)!r} is not a folder; pass the monitor's output_dir (it holds report.json).")
    from memcallbacks._files.unfinished import journal_report, unfinished_runs

    left, finished = unfinished_runs(folder)
    if left:
        return journal_report(folder, left, finished)
    candidates = [folder / "report.json", *sorted(folder.glob("report.rank*.json"))]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise FileNotFoundError(f"no report.json in {str(folder)!r} or the folders below it; pass the monitor's "
                                "output_dir or the run folder that holds it.")
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON ({exc}); the file may be truncated.") from None
    _check_shape(report, path)
    history = None
    for candidate in _history_candidates(report, folder):
        if candidate.is_file():
            check_fingerprint(candidate, (report.get("integrity") or {}).get("history"), path)
            history = _read_history(candidate)
            break
    return report, history


def read_eval_history(folder: str | Path, report: dict[str, Any]) -> Any:
    """The evaluation loops' rows (``eval_history.csv``) next to a report, or None."""
    import pandas as pd

    if isinstance(report.get("unfinished"), dict):  # a run that did not finish: its journal's evaluation rows
        from memcallbacks._runtime.readout import eval_frame

        return eval_frame(report["unfinished"].get("eval_rows") or [])
    folder = find_output_dir(folder)
    name = (report.get("files") or {}).get("eval_history")
    for path in ([folder / Path(name).name] if isinstance(name, str) and name else []) + [folder / "eval_history.csv", folder / "eval_history.rank0.csv"]:
        if path.is_file():
            try:
                return pd.read_csv(path).rename(columns=frame_column)
            except (UnicodeDecodeError, ValueError, pd.errors.ParserError, pd.errors.EmptyDataError):
                return None
    return None


def _check_shape(report: Any, path: Path) -> None:
    if not isinstance(report, dict):
        raise ValueError(f"{str(path)!r} holds a JSON {type(report).__name__}, not a memcallbacks report (an object with 'summary').")
    for key, kind in (("summary", dict), ("files", dict), ("findings", list), ("events", list), ("model_states", dict), ("snapshots", list)):
        if key in report and report[key] is not None and not isinstance(report[key], kind):
            raise ValueError(f"{str(path)!r}: '{key}' is a {type(report[key]).__name__}, not a{'n' if kind is dict else ''} "
                             f"{'object' if kind is dict else 'list'}; this is not a memcallbacks report.")
    if "summary" not in report:
        raise ValueError(f"{str(path)!r} has no 'summary'; this is not a memcallbacks report.")


def _history_candidates(report: dict[str, Any], folder: Path) -> list[Path]:
    name = (report.get("files") or {}).get("history")
    # the report's own name for it first, looked up in this folder (the run may have been copied here)
    found = [folder / Path(name).name] if isinstance(name, str) and name else []
    return found + [folder / "history.csv", folder / "history.rank0.csv"]


def _read_history(path: Path) -> Any:
    import pandas as pd

    try:
        history = pd.read_csv(path)
        history = history.rename(columns=frame_column)  # the file's names carry their unit; the frame's do not
    except (UnicodeDecodeError, ValueError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise ValueError(f"{str(path)!r} is not a CSV file memcallbacks wrote ({type(exc).__name__}: {str(exc)[:200]}).") from None
    missing = [c for c in ("step", "allocated", "peak_allocated") if c not in history.columns]
    if missing:
        raise ValueError(f"{str(path)!r} has no {', '.join(missing)} column(s); it is not a memcallbacks history.")
    return history


def format_report(report: dict[str, Any], history: Any = None) -> str:
    """A short text report: the verdict first, then per-phase peaks, the step-start floor, the
    evaluation loops, the checks, the monitor's own time, the findings and the files."""
    s = report.get("summary", {})
    names = measure_names(report)
    lines = []
    if report.get("unfinished"):  # a run that did not finish says so first (unfinished.py), then what it recorded
        from memcallbacks._files.unfinished import unfinished_lines

        lines += unfinished_lines(report) + ["", "what it recorded until then:"]
    lines += verdict_lines(report, history)
    lines += _measure_lines(s, names, report.get("events") or [])
    lines += _peak_lines(s, names, history)
    for stage, e in (s.get("eval") or {}).items():
        lines.append(f"  {stage:<26} {e['runs']} run(s), peak {format_bytes(e['peak_allocated_bytes'])} {names['peak']}")
    lines += _model_state_lines(report.get("model_states") or {})
    lines += _preflight_lines(report.get("preflight"))
    lines += _host_lines(report)
    snaps = report.get("snapshots") or []
    if snaps:
        lines.append(f"  snapshots                  {len(snaps)}: " + "; ".join(f"step {r.get('step')} ({r.get('trigger')})" for r in snaps[:3]))
    lines += _rows_lines(s, history, "rows in history.csv" if not report.get("unfinished") else "rows in the journal")
    lines += _cost_lines(s, report.get("config") if isinstance(report.get("config"), dict) else {}, report.get("findings") or [])
    lines += _closing_lines(report, s)
    return "\n".join(lines)


def _capacity_text(s: dict[str, Any], names: dict[str, str], events: list[Any]) -> str:
    """The host's RAM or the device's capacity; before it, where an out-of-memory error's explanation read the limit the
    run ran into (an address-space limit, a per-process fraction, ``capacity_bytes``), that limit (docs/oom.md)."""
    held = format_bytes(s["capacity_bytes"]) + (" (host RAM)" if names["cpu"] else "") if s.get("capacity_bytes") else ""
    memory = next(((e.get("explanation") or {}).get("memory") or {} for e in events if isinstance(e, dict) and e.get("kind") == "oom"), {})
    limit, source = memory.get("capacity_bytes"), memory.get("capacity_source") or ""
    if not limit or source in ("host RAM", "device total", "device capacity"):
        return held
    source = "the address-space limit, RLIMIT_AS" if source == "RLIMIT_AS" else source
    return f"{format_bytes(limit)} ({source}, at the out-of-memory error)" + (f"; {held}" if held else "")


def _measure_lines(s: dict[str, Any], names: dict[str, str], events: list[Any] = ()) -> list[str]:
    """What was read, in the reader's terms, and the run's highest figures."""
    device = s.get("device", {})
    if names["cpu"]:
        what = "resident memory (RSS) and its high-water mark per phase; the C heap (glibc) at step start"
    else:
        what = f"the allocator's allocated and reserved bytes ({device.get('peak_source', '?')} peaks)"
    lines = [f"  device                     {device.get('device', '?')}: {what}"]
    capacity = _capacity_text(s, names, list(events))
    if capacity:
        lines.append(f"  capacity                   {capacity}")
    if names["cpu"]:
        lines.append(f"  peak over the run          {format_bytes(s.get('max_reserved_bytes'))} resident memory (the process's "
                     "high-water mark, between the steps too; the verdict's peak is the steps')")
    else:
        lines.append(f"  peak over the run          {format_bytes(s.get('max_allocated_bytes'))} allocated, "
                     f"{format_bytes(s.get('max_reserved_bytes'))} reserved")
    return lines


def _peak_lines(s: dict[str, Any], names: dict[str, str], history: Any) -> list[str]:
    """Per-phase peaks and how far each rose above the step-start floor; the floor's and the heap's change."""
    lines = [f"  per-phase peaks ({names['peak']}), and the most each rose above {names['floor']}:"]
    for phase in ("forward", "backward", "optimizer"):
        rise = s.get(f"peak_{phase}_above_baseline_bytes")
        rise = max(rise, 0) if isinstance(rise, (int, float)) else rise  # a peak never lies below where its step began
        lines.append(f"    {phase:<10} {format_bytes(s.get(f'peak_{phase}_bytes')):>12}   {format_delta(rise)}")
    if history is not None and len(history) and names["floor_column"] in history:
        floor = history[names["floor_column"]].dropna()
        if len(floor):
            first, last = floor.iloc[0], floor.iloc[-1]
            lines.append(f"  {names['floor']:<26} {format_bytes(first)} (first row) -> {format_bytes(last)} (last row), "
                         f"change {format_delta(last - first)}")
    first, last = s.get("first_allocated_bytes"), s.get("last_allocated_bytes")
    if first is not None and last is not None:
        label = names["heap"] or names["floor"]
        if names["cpu"] or history is None or not len(history):
            lines.append(f"  {label:<26} {format_bytes(first)} (first row) -> {format_bytes(last)} (last row), "
                         f"change {format_delta(last - first)}")
    return lines


def step_segments(steps: list[int]) -> list[str]:
    """``[0..9, 19, 29, 39]`` -> ``["0-9", "every 10th from 19 to 39"]`` (``"every 2nd ..."``): which steps have rows, in words."""
    out: list[str] = []
    i = 0
    while i < len(steps):
        j = i
        gap = steps[i + 1] - steps[i] if i + 1 < len(steps) else 1
        while j + 1 < len(steps) and steps[j + 1] - steps[j] == gap:
            j += 1
        if j == i:
            out.append(str(steps[i]))
        elif gap == 1:
            out.append(f"{steps[i]}-{steps[j]}")
        elif j - i == 1:
            out += [str(steps[i]), str(steps[j])]
        else:
            out.append(f"every {ordinal(gap)} from {steps[i]} to {steps[j]}")
        i = j + 1
    return out


def _rows_lines(s: dict[str, Any], history: Any, where: str) -> list[str]:
    """Which steps have a row in ``where`` (history.csv, or an unfinished run's journal), said from the rows themselves, and why the others have none."""
    seen = s.get("steps_seen", 0)
    if history is None or not len(history) or "step" not in history:
        return [f"  {where:<26} {s.get('steps_recorded', 0)} of {seen} steps"]
    steps = sorted({int(x) for x in history["step"].dropna()})
    if len(steps) >= seen:
        return [f"  {where:<26} every step ({len(steps)})"]
    segments = step_segments(steps)
    shown = ", ".join(segments[:4]) + (", ..." if len(segments) > 4 else "")
    cadence = s.get("cadence") or {}
    why = ("the monitor measured fewer steps to stay within its time budget"
           if cadence.get("sample_interval_source") == "overhead_budget" else "sample_every_n_steps")
    if cadence.get("sample_every_n_steps"):
        n = cadence["sample_every_n_steps"]
        if n > seen:  # an interval longer than the run: no step at it
            why += f": after the first ones only those at the logging interval (its own, {n} steps, is longer than this run)"
        else:
            why += f": {'every step' if n == 1 else f'every {ordinal(n)} step'} after the first ones, and those at the logging interval"
    return [f"  {where:<26} {len(steps)} of {seen} steps ({shown})",
            f"                             the other steps were only watched for leaks ({why})"]


# the own time's parts in words (summary.cadence.overhead_by_part), in the order the text lists them
_PART_WORDS = {"hooks": "hooks", "dispatch": "torch's dispatch (estimate)", "read": "reads", "sample": "sampled steps",
               "watch": "leak watch", "lingering": "lingering checks", "tripwire": "RSS tripwire", "journal": "journal ticks", "gc": "collection watch",
               "imports": "imports"}


def _part_line(cadence: dict[str, Any]) -> list[str]:
    """``by part: hooks 0.21%, reads 0.10%, ...``: the share's parts, largest first (the imports always)."""
    shares = cadence.get("overhead_by_part")
    if not isinstance(shares, dict):
        return []
    order = list(_PART_WORDS)
    shown = [(-v, order.index(k), k) for k, v in shares.items() if k in _PART_WORDS and (v >= 5e-5 or k == "imports")]
    words = [f"{_PART_WORDS[k]} {-v * 100:.2f}%" for v, _, k in sorted(shown)]
    return [f"    by part: {', '.join(words)}"] if words else []


def _apart_lines(cadence: dict[str, Any], findings: list[dict[str, Any]]) -> list[str]:
    """The one-off diagnoses, each with its step and time and the finding it named holders for, and the run's end."""
    lines = []
    diagnoses = cadence.get("diagnoses")
    if diagnoses is None and cadence.get("finding_time_s"):  # a report.json from before diagnoses were listed
        diagnoses = [{"step": None, "seconds": cadence["finding_time_s"]}]
    diagnoses = [d for d in diagnoses or [] if d.get("seconds", 0.0) >= 0.005]  # report.json lists every one
    for d in diagnoses[:4]:
        step = d.get("step")
        named = [f for f in findings if step is not None and isinstance(f.get("first_step", f.get("step")), int)
                 and f.get("first_step", f.get("step")) <= step and f.get("kind") != "oom"]
        where = f" at step {step}" if step is not None else ""
        if named:
            f = max(named, key=lambda f: f.get("first_step", f.get("step")))
            first = f.get("first_step", f.get("step"))
            what = f"to name what holds the {f.get('kind')} found at step {first}" if first != step else f"to name what holds the {f.get('kind')} found there"
        else:
            what = "a census for a suspicion that raised no finding"
        lines.append(f"    plus {d.get('seconds', 0.0):.2f} s once{where}, {what}")
    if diagnoses and len(diagnoses) > 4:
        rest = diagnoses[4:]
        lines.append(f"    plus {sum(d.get('seconds', 0.0) for d in rest):.2f} s in {len(rest)} more diagnoses (report.json: summary.cadence.diagnoses)")
    own, wall = cadence.get("end_of_run_s") or 0.0, cadence.get("end_wall_s")
    if isinstance(wall, (int, float)) and wall >= own + 0.05:  # a writer process built the files
        lines.append(f"    plus {own:.2f} s of this process's time at the end of the run; the end took {wall:.2f} s up to this "
                     "report, most of it the writer process that builds the files (pandas, matplotlib), which the run's end waits for")
    elif own or wall:
        lines.append(f"    plus {own:.2f} s at the end of the run (its report and files)")
    return lines


def _cost_lines(s: dict[str, Any], config: dict[str, Any], findings: list[dict[str, Any]] | None = None) -> list[str]:
    """The monitor's own time during the steps against its budget, its parts, what it spent once apart
    from it (diagnoses, the run's end), and what to do when it is over."""
    cadence = s.get("cadence") or {}
    overhead, budget = cadence.get("overhead"), cadence.get("overhead_budget")
    cost = s.get("monitor_time_per_step_us") or {}
    if overhead is None:
        return [f"  monitor's own time         {cost['median']:.0f} µs median per measured step"] if cost.get("median") else []
    text = f"  monitor's own time         {100 * overhead:.2f}% of step time"
    after = cadence.get("overhead_after_start")
    if after is not None and cadence.get("dense_read_steps"):
        text += f" ({100 * after:.2f}% after the first {cadence['dense_read_steps']} steps)"
    if budget:
        text += f", budget {100 * budget:g}%"
    lines = [text, *_part_line(cadence), *_apart_lines(cadence, findings or [])]
    extra = [f"{n} {what}" for n, what in ((cadence.get("read_bursts"), "burst(s) of every-step reads after a risen floor"),
                                           (cadence.get("rss_trips"), "read(s) the RSS tripwire asked for")) if n]
    if cadence.get("backoffs"):
        parts = sorted({b["part"] for b in cadence["backoffs"]})
        extra.append(f"{len(cadence['backoffs'])} back-off(s) to keep the budget ({', '.join(parts)})")
    if extra:
        lines.append(f"    {'; '.join(extra)}")
    if budget and max(overhead, after or 0.0) > budget:
        if cadence.get("sample_interval_source") == "config" or config.get("sample_every_n_steps"):
            lines.append(f"    over budget: sample_every_n_steps={cadence.get('sample_every_n_steps')} is set; "
                         "leave it unset to let the monitor measure fewer steps")
        elif after is not None and after <= budget:
            lines.append(f"    the first {cadence.get('dense_read_steps')} steps are read every step by design "
                         "(a leak in the training code leaks from step 0); after them it is within its budget")
        elif cadence.get("backoffs"):
            lines.append(f"    over budget: the monitor measured fewer steps to bring it down "
                         f"({len(cadence['backoffs'])} back-off(s))")
        elif after is not None and after > budget and cadence.get("over_budget_windows"):
            lines.append("    over budget: nothing it can measure less often is left; the rest is the logged steps "
                         "(a larger log_every_n_steps lowers it) and its hooks' calls")
        elif after is not None:  # no window long enough for the guard yet
            lines.append(f"    over budget after the first {cadence.get('dense_read_steps')} steps: too few steps since "
                         "for the monitor to measure fewer (it checks every 32 steps)")
        else:  # the run never left its first steps (a user check: "14.29% of step time" on 60 steps of 0.7 ms, unexplained)
            lines.append("    over budget: this run's steps were all among the first ones, which are read every step by design "
                         "(a leak in the training code leaks from step 0); a longer run spreads them")
    return lines


def _model_state_lines(states: dict[str, Any]) -> list[str]:
    """The live theory check: the model states expected at the checked step, and what they leave unexplained."""
    if states.get("expected_steady_bytes") is None:
        return []
    exp = states.get("expected", {})
    unexplained = states.get("unexplained_bytes")
    # below the level the theory explains (a CPU heap that freed what it held at the run's start): nothing unexplained
    tail = (f"unexplained {format_bytes(unexplained)}" if not isinstance(unexplained, (int, float)) or unexplained >= 0 else
            f"nothing unexplained (the step started {format_bytes(-unexplained)} below the level they explain)")
    return [f"  model states (theory)      {format_bytes(states['expected_steady_bytes'])} expected at step {states.get('step')} "
            f"({states.get('strategy')}, {states.get('precision')}, world size {states.get('world_size')}: params "
            f"{format_bytes(exp.get('params'))}, grads {format_bytes(exp.get('grads'))}, optimizer {format_bytes(exp.get('optimizer'))}); "
            f"{tail}"]


def _closing_lines(report: dict[str, Any], s: dict[str, Any]) -> list[str]:
    """The findings with their holders, the events, an internal error, and the files."""
    findings = report.get("findings") or []
    lines = [f"  findings                   {finding_counts(findings)}"]
    for f in findings:
        message = str(f.get("message"))
        if f.get("kind") == "oom":  # the whole explanation is its own section below
            message = message.splitlines()[0] + " (below)"
        lines.append(f"    [{finding_label(f)}] {step_text(f)}: {message}")
        for holder in f.get("holders", [])[:5]:
            lines.append(f"        held by {holder}")
        lines.extend(f"        {line}" for line in evidence_lines(f))
    for event in report.get("events") or []:
        lines.append(f"  event: {event.get('kind')} at step {event.get('step')}: {event.get('error', '')[:200]}")
        explanation = event.get("explanation") or {}
        if explanation.get("text"):  # docs/oom.md
            where = f" ({event['oom_file']})" if event.get("oom_file") else ""
            lines.append(f"  out of memory, explained{where}:")
            lines.extend(f"    {line}" for line in str(explanation["text"]).splitlines())
    if s.get("disabled_after_error"):
        lines.append("  note: the monitor hit an internal error and disabled itself (see the log for the traceback)")
    files = report.get("files") or {}
    if files:
        lines.append("  files:")
        for kind, path in files.items():
            lines.append(f"    {kind:<14} {path}")
    return lines


HOST_KINDS = ("host_growth", "worker_growth", "rank_imbalance")
"""Finding kinds of the host channel (docs/findings.md, "Host memory"): listed in the host section too."""


def _host_lines(report: dict[str, Any]) -> list[str]:
    """The host section (docs/host.md): private memory, Python objects, DataLoader workers, per rank,
    the host findings and the channel's cost, from ``report["host"]`` and ``summary.rank_figures``."""
    host = report.get("host")
    config = report.get("config") if isinstance(report.get("config"), dict) else {}
    if not isinstance(host, dict):
        return ["  host                       off (watch_host=False)"] if config.get("watch_host") is False else []
    s = report.get("summary") or {}
    figures = s.get("rank_figures") if isinstance(s.get("rank_figures"), dict) else {}
    lines = ["  host (docs/host.md)" + ("" if host.get("enabled", True) else ": the channel turned itself off after an error (see the log)")]

    def change(key: str) -> str:
        value = figures.get(key)
        return f" (change {format_delta(value)} since the first read)" if value is not None else ""

    if figures.get("host_private_bytes") is not None:
        rss = f", resident {format_bytes(figures['host_rss_bytes'])}" if figures.get("host_rss_bytes") is not None else ""
        lines.append(f"    private memory           {format_bytes(figures['host_private_bytes'])}{change('host_private_growth_bytes')}{rss}")
    if figures.get("host_python_bytes") is not None:
        lines.append(f"    Python objects           ~{format_bytes(figures['host_python_bytes'])}{change('host_python_growth_bytes')}")
    if len(lines) == 1:
        lines.append("    no reading               (no step read the host)")
    workers = host.get("workers") if isinstance(host.get("workers"), dict) else {}
    if workers.get("workers"):
        sets = workers.get("generations") or 0
        lines.append(f"    DataLoader workers       {workers['workers']} live: {format_bytes(workers.get('uss_bytes'))} private (USS), "
                     f"{format_bytes(workers.get('pss_bytes'))} proportional (PSS); {sets} worker set{'s' if sets != 1 else ''}, "
                     f"{workers.get('reads', 0)} reads")
    elif workers.get("reads"):
        lines.append(f"    DataLoader workers       none live at the end ({workers.get('generations') or 0} worker set(s) seen)")
    ranks = [r.get("rank_figures") if isinstance(r, dict) else None for r in report.get("ranks") or []]
    if any(isinstance(r, dict) and r.get("host_private_bytes") is not None for r in ranks):
        lines.append("    per rank (private)       " + ", ".join(
            f"rank {i} {format_bytes(r.get('host_private_bytes')) if isinstance(r, dict) else '?'}" for i, r in enumerate(ranks)))
    found = [f for f in report.get("findings") or [] if isinstance(f, dict) and f.get("kind") in HOST_KINDS]
    # a host growth that settled says so in its details (docs/findings.md, "Host memory")
    found = [dict(f, state="settled") if (f.get("details") or {}).get("open") is False else f for f in found]
    lines.append(f"    host findings            {finding_counts(found)}")
    for f in found:
        holders = f.get("holders") or []
        what = f"held by {holders[0]}" if holders else str(f.get("message") or "")[:160]
        key = f.get("key") if f.get("key") not in (None, f.get("kind")) else ""  # host_growth:native, rank_imbalance:host
        lines.append(f"      [{finding_label(f)}] {key + ' ' if key else ''}{step_text(f)}: {what}")
    reads, seconds = host.get("reads") or 0, host.get("seconds") or 0.0
    cost = f"{reads} reads, {1e6 * seconds / reads:.0f} µs each" if reads else "no reads"
    census = host.get("census_seconds") or 0.0
    if census:
        cost += f"; censuses after suspicion {census:.2f} s"
    lines.append(f"    cost                     {cost}")
    return lines


def _preflight_lines(pre: dict[str, Any] | None) -> list[str]:
    """The pre-flight section: status, predicted vs measured per phase, capacity (docs/preflight.md)."""
    if not pre:
        return []
    status = pre.get("status")
    if status != "predicted":
        why = pre.get("error") or pre.get("reason") or "no training forward was seen"
        return [f"  pre-flight                 {status}: {why}"]
    p = pre.get("prediction") or {}
    frame = "above the RSS at step start" if pre.get("frame") == "above_step_start" else "allocated"
    comparison = pre.get("comparison") or {}
    peaks = pre.get("peaks") or {}  # as the framework orders the step (Lightning: last step's grads through forward)
    phase = max(peaks, key=peaks.__getitem__) if peaks else p.get("peak_phase")
    lines = [f"  pre-flight                 predicted peak {format_bytes(peaks.get(phase, p.get('peak_bytes')))} in {phase} "
             f"({p.get('device')}, {p.get('precision')}, batch size {pre.get('batch_size')}); measured vs predicted, "
             f"{frame}, max over {comparison.get('steps_compared', 0)} steady step(s):"]
    for phase, c in (comparison.get("phases") or {}).items():
        ratio = f"x{c['ratio']:.3f}" if c.get("ratio") is not None else ""
        lines.append(f"    {phase:<10} predicted {format_bytes(c.get('predicted_bytes')):>12}   measured "
                     f"{format_bytes(c.get('measured_max_bytes')):>12}   {ratio}")
    if pre.get("capacity_bytes"):
        fit = pre.get("max_batch_size")
        verdict = "fits" if pre.get("fits") else "exceeds"
        tail = "" if not fit else f"; largest batch size that fits: {fit['batch_size']}" if fit["batch_size"] else "; no batch size fits"
        lines.append(f"    {verdict} {format_bytes(pre['capacity_bytes'])} ({pre.get('capacity_source')}){tail}")
    return lines
