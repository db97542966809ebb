"""A run that did not finish, read from its journal: where it stopped, what it found, why it ended.

A journal (:mod:`memcallbacks._files.journal`) whose run id has no matching ``report.json`` is a
run that never reached its clean end: killed (SIGKILL, the kernel's OOM killer, a launcher),
``os._exit``, a lost machine, or a file set that could not be written. :func:`unfinished_runs`
finds them in an output folder; :func:`journal_report` turns one into the ``report.json``-like
dict (and history frame) ``memcallbacks report``, ``plot`` and ``compare`` read, with an
``unfinished`` section that :func:`unfinished_lines` says first: that the run did not finish,
the last step recorded and when, memory then and its trend, the open findings with their
holders (and a forecast where the finding has one), and the likely end where Linux tells (the
memory cgroup's OOM-kill count, or memory at the last record near its limit). With several
ranks: each rank's last record, and which rank stopped first.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from memcallbacks._base.columns import ALLOCATED, HOST_RSS, PEAK_ALLOCATED, PEAK_RESERVED, RESERVED, STEP
from memcallbacks._base.findings import step_text
from memcallbacks._base.units import MiB, format_bytes, format_duration
from memcallbacks._base.limits import Cgroup, Room, cgroup_room, oom_kills, runs_out_text
from memcallbacks._files.journal import JournalRecord, find_journals, read_journal, replay_rows
from memcallbacks._files.verdict import fix_words, problems

__all__ = ["unfinished_runs", "journal_report", "unfinished_lines", "likely_end", "NEAR_LIMIT_BYTES", "NEAR_LIMIT_SHARE"]

#: Memory at the last record this close to a limit reads as "near the limit"...
NEAR_LIMIT_BYTES = 64 * MiB
#: ... and so does a resident set that grew by all but this share of the room a limit left at the start.
NEAR_LIMIT_SHARE = 0.1
# rows the trend is taken over (the newest)
_TREND_ROWS = 32


def _report_of(folder: Path, rank: int, world_size: int) -> dict[str, Any] | None:
    name = "report.json" if world_size <= 1 else f"report.rank{rank}.json"
    try:
        report = json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def unfinished_runs(folder: str | Path) -> tuple[list[JournalRecord], dict[int, dict[str, Any]]]:
    """The journals in ``folder`` whose run has no matching report (by run id), in rank order, and the
    reports of the ranks that did finish (rank -> report), for the ranks' comparison."""
    folder = Path(folder)
    left: list[JournalRecord] = []
    for path in find_journals(folder):
        try:
            record = read_journal(path)
        except (OSError, ValueError):
            continue
        report = _report_of(folder, record.rank, int(record.start.get("world_size") or 1))
        if report is not None and (report.get("run") or {}).get("id") == record.run_id:
            continue  # finished: a journal its writer could not remove
        left.append(record)
    finished: dict[int, dict[str, Any]] = {}
    if left and int(left[0].start.get("world_size") or 1) > 1:
        known = {r.rank for r in left}
        for rank in range(int(left[0].start.get("world_size") or 1)):
            report = _report_of(folder, rank, 2)
            if rank not in known and report is not None:
                finished[rank] = report
    return left, finished


def _memory(record: JournalRecord) -> dict[str, Any]:
    """Memory at the last record and its trend per step over the newest rows (the floor: RSS on CPU, allocated elsewhere)."""
    cpu = (record.start.get("device") or {}).get("peak_source") == "rss_high_water_mark"
    column = RESERVED if cpu else ALLOCATED
    rows = [r for r in record.rows[-_TREND_ROWS:] if isinstance(r[column], (int, float)) and r[column] == r[column]]
    out: dict[str, Any] = {"what": "resident memory (RSS)" if cpu else "allocated"}
    if rows:
        out.update(bytes=rows[-1][column], step=rows[-1][STEP], host_rss=rows[-1][HOST_RSS])
        if len(rows) >= 2 and rows[-1][STEP] > rows[0][STEP]:
            out.update(per_step=(rows[-1][column] - rows[0][column]) / (rows[-1][STEP] - rows[0][STEP]),
                       over=(rows[0][STEP], rows[-1][STEP]))
    tick = record.last_tick
    if tick is not None and tick.get("rss") and (not rows or tick.get("step", -1) > rows[-1][STEP]):
        out["tick_rss"], out["tick_step"] = tick["rss"], tick.get("step")
    return out


def _host_memory(memory: dict[str, Any]) -> float | None:
    """The process's resident memory at the last record: the later tick's, else the last row's."""
    for key in ("tick_rss", "host_rss"):
        value = memory.get(key)
        if isinstance(value, (int, float)) and value == value and value > 0:
            return float(value)
    return None


def likely_end(record: JournalRecord, memory: dict[str, Any]) -> str | None:
    """Why the run ended, where Linux tells: the memory cgroup counted an OOM kill since the run started (read now,
    on the same host), or memory at the last record was near a limit: the resident set grew by all but a tenth
    (:data:`NEAR_LIMIT_SHARE`), or all but :data:`NEAR_LIMIT_BYTES`, of the room a limit left at the start. None:
    it cannot tell."""
    start = record.start
    counted = _oom_killed(start) if start.get("host") == socket.gethostname() else None
    if counted is not None:
        return counted
    rss, at_start = _host_memory(memory), start.get("rss_bytes")
    if rss is None or not isinstance(at_start, (int, float)):
        return None
    for room in filter(None, map(Room.from_dict, start.get("limits") or [])):
        left = room.room_bytes - (rss - at_start)
        if left <= max(room.room_bytes * NEAR_LIMIT_SHARE, NEAR_LIMIT_BYTES):
            what = "an allocation refused at the address-space limit" if room.source == "rlimit_as" else "the kernel's OOM killer"
            return (f"{what}, likely: resident memory at the last record was {format_bytes(rss)}, which left about "
                    f"{format_bytes(max(0, left))} under {room.describe()}")
    return None


def _oom_killed(start: dict[str, Any]) -> str | None:
    """The kernel's OOM killer, where the run's memory cgroup (still there) counts more kills now than at the start."""
    recorded = start.get("cgroup") if isinstance(start.get("cgroup"), dict) else {}
    cgroup = Cgroup.from_dict(recorded)
    if cgroup is None:
        return None
    before, after = recorded.get("oom_kills"), oom_kills(cgroup)
    if not isinstance(before, int) or after is None or after <= before:
        return None
    room, name = cgroup_room(cgroup), cgroup.name(cgroup.dirs[0])
    where = f"{name}, limit {format_bytes(room.limit_bytes)}" if room is not None and room.where == name else name
    text = f"the kernel's OOM killer: its memory cgroup ({where}) counted {after - before} OOM kill{'s' if after - before != 1 else ''} since the run started"
    return text + (f", under {room.describe()}" if room is not None and room.where != name else "")


def _counts(rows: list[list[Any]], last_step: int | None, rank: int, world_size: int) -> dict[str, Any]:
    peaks = [r[PEAK_ALLOCATED] for r in rows if isinstance(r[PEAK_ALLOCATED], (int, float)) and r[PEAK_ALLOCATED] == r[PEAK_ALLOCATED]]
    reserved = [r[PEAK_RESERVED] for r in rows if isinstance(r[PEAK_RESERVED], (int, float)) and r[PEAK_RESERVED] == r[PEAK_RESERVED]]
    return {"steps_recorded": len(rows), "steps_seen": (last_step + 1) if last_step is not None else len(rows),
            "steps_sampled": len(rows), "history_stride": 1, "max_allocated_bytes": int(max(peaks)) if peaks else 0,
            "max_reserved_bytes": int(max(reserved)) if reserved else 0, "rank": rank, "world_size": world_size,
            "disabled_after_error": False}


def journal_report(folder: str | Path, records: list[JournalRecord], finished: dict[int, dict[str, Any]] | None = None) -> tuple[dict[str, Any], Any]:
    """A ``report.json``-like dict and the history frame of the first unfinished rank, from its journal; its
    ``unfinished`` section holds what :func:`unfinished_lines` says of every unfinished rank (imports pandas)."""
    from memcallbacks._files.outputs import REPORT_VERSION
    from memcallbacks._files.report_shape import row_peak, shape_report
    from memcallbacks._runtime.readout import history_frame, summarise

    record = records[0]
    start = record.start
    world_size = int(start.get("world_size") or 1)
    rows = replay_rows(record.rows, int(start.get("max_history_rows") or 200_000))
    device = dict(start.get("device") or {})
    summary = summarise(_counts(rows, record.last_step()[0], record.rank, world_size), rows, record.evals, device, start.get("capacity_bytes"))
    peak = row_peak(rows)
    if peak is not None:
        summary["peak"] = peak
    report = shape_report({
        "version": REPORT_VERSION, "framework": start.get("framework"), "config": start.get("config") or {},
        "summary": summary, "findings": list(record.findings.values()), "events": list(record.events), "files": {},
        "run": {"id": record.run_id, "started_at": start.get("time"), "ended_at": None},
        "unfinished": {"ranks": [_rank_state(r, Path(folder)) for r in records], "finished_ranks": _finished_states(finished or {}),
                       "eval_rows": record.evals},
    }, Path(folder))
    return report, history_frame(rows, str(device.get("kind", "cpu")))


def _rank_state(record: JournalRecord, folder: Path) -> dict[str, Any]:
    step, when = record.last_step()
    memory = _memory(record)
    end = record.end
    world_size = int(record.start.get("world_size") or 1)
    earlier = _report_of(folder, record.rank, world_size)
    return {"earlier_report": None if earlier is None else ("report.json" if world_size <= 1 else f"report.rank{record.rank}.json"),"rank": record.rank, "journal": record.path.name, "last_step": step, "last_time": when,
            "started_at": record.start.get("time"), "memory": memory, "likely_end": likely_end(record, memory),
            "events": list(record.events), "findings": list(record.findings.values()), "torn": record.torn,
            "end": None if end is None else {"clean": end.get("clean"), "step": end.get("step"), "time": end.get("time")}}


def _finished_states(finished: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for rank, report in sorted(finished.items()):
        events = [e for e in report.get("events") or [] if isinstance(e, dict)]
        out.append({"rank": rank, "ended_at": (report.get("run") or {}).get("ended_at"),
                    "steps": (report.get("summary") or {}).get("steps_seen"), "event": events[0] if events else None})
    return out


def _clock(when: Any) -> str:
    """A record's time, to the tenth of a second (ranks that stopped within a second of each other still sort)."""
    if not isinstance(when, (int, float)):
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) + f".{int(when * 10) % 10}"


def unfinished_lines(report: dict[str, Any]) -> list[str]:
    """What a reader sees first of a run that did not finish: where each rank stopped, memory then, the likely
    end, the open findings with holders; with several ranks, which one stopped first."""
    section = report.get("unfinished") or {}
    ranks = section.get("ranks") or []
    if not ranks:
        return []
    several = len(ranks) > 1 or bool(section.get("finished_ranks"))
    first = min(ranks, key=lambda r: r.get("last_time") or float("inf"))
    if several:
        lines = [f"memcallbacks: this run did not finish: rank {first['rank']} stopped first (its last record at "
                 f"{_clock(first.get('last_time'))}, step {first.get('last_step')})."]
        for done in section.get("finished_ranks") or []:
            event = done.get("event")
            what = "an out-of-memory error" if isinstance(event, dict) and event.get("kind") == "oom" else "an exception"
            how = f"ended with {what} at step {event.get('step')}" if isinstance(event, dict) else "finished"
            lines.append(f"  rank {done['rank']:<4} {how} at {_clock(done.get('ended_at'))} (its files are written)")
    else:
        lines = []
    for state in ranks:
        lines += _rank_lines(state, several)
    return lines


def _rank_lines(state: dict[str, Any], several: bool) -> list[str]:
    step, when = state.get("last_step"), state.get("last_time")
    who = f"rank {state['rank']}" if several else "this run"
    end = state.get("end")
    if end is not None and end.get("clean") is False:
        head = f"{who} did not finish: its monitor was dropped without close() at step {end.get('step')}, and its files were not written"
    elif end is not None:
        head = f"{who} reached its end at step {end.get('step')}, but its files were not written"
    else:
        head = f"{who} did not finish: its record ({state.get('journal')}) stops with no end"
    lines = [(f"  {head}." if several else f"memcallbacks: {head}.")]
    started = state.get("started_at")
    after = f" ({format_duration(when - started)} after the start)" if isinstance(when, (int, float)) and isinstance(started, (int, float)) else ""
    lines.append(f"  last step recorded         {step if step is not None else 'none'} at {_clock(when)}{after}")
    lines.append(f"  memory then                {_memory_text(state.get('memory') or {})}")
    for event in state.get("events") or []:
        lines.append(f"  event                      {event.get('kind')} at step {event.get('step')}: {str(event.get('error', ''))[:160]}")
    end_text = state.get("likely_end")
    lines.append(f"  likely end                 {end_text or _unknown_end(state)}")
    found = problems({"findings": state.get("findings") or []})
    lines.append(f"  open findings              {len(found) or 'none'}" + (" (as last recorded)" if found else ""))
    for f in found:
        holders = f.get("holders") or []
        fix = fix_words(f"Fix: {f['details']['fix']}" if "fix" in (f.get("details") or {}) else str(f.get("message") or ""))
        lines.append(f"    - {f.get('kind')}, {step_text(f)}" + (f"; fix: {fix}" if fix else ""))
        for holder in holders[:5]:
            lines.append(f"        held by {holder}")
        runs_out = (f.get("details") or {}).get("runs_out")
        if runs_out:
            text = runs_out_text(runs_out, seconds=False) if isinstance(runs_out, dict) else str(runs_out)
            lines.append(f"        forecast: {text[:1].lower()}{text[1:]}")
    if state.get("torn"):
        lines.append("  note: its last record was cut short when the process died; it is left out")
    if state.get("earlier_report"):
        lines.append(f"  note: {state['earlier_report']} in this folder is an earlier run's (the files beside it are that run's)")
    return lines


def _memory_text(memory: dict[str, Any]) -> str:
    if memory.get("bytes") is None:
        text = "no row recorded"
    else:
        text = f"{format_bytes(memory['bytes'])} {memory.get('what')} at the start of step {memory.get('step')}"
        if memory.get("per_step") is not None:
            a, b = memory["over"]
            text += f", {'rising' if memory['per_step'] > 0 else 'falling' if memory['per_step'] < 0 else 'flat'} " \
                    f"{format_bytes(abs(memory['per_step']))}/step over steps {a}-{b}"
    if memory.get("tick_rss"):
        text += f"; resident {format_bytes(memory['tick_rss'])} at step {memory.get('tick_step')}"
    return text


def _unknown_end(state: dict[str, Any]) -> str:
    if state.get("events"):
        return "the exception recorded above, before the files were written"
    return ("not known: no OOM kill counted by its memory cgroup and memory not near its limit at the last record "
            "(a signal such as SIGKILL or SIGTERM, os._exit, a lost machine or a crash of the interpreter)")
