"""The record that streams: the run's rows, findings and events, one JSON line each, as they happen.

One file per process in the output folder, ``journal.jsonl`` (``journal.rank{r}.jsonl`` under
torch.distributed), opened when a session starts with ``write_files`` on. Every record is one
JSON object on one line (``{"t": <type>, ...}``; docs/journal.md lists every type and field),
appended with one ``os.write`` on an ``O_APPEND`` descriptor: it reaches the kernel when it is
written, so it survives SIGKILL, the kernel's OOM killer and ``os._exit`` (``fsync`` at the
start, at findings, events and the end; power loss may lose what came after the last one). The
training step writes its rows and ticks inline (``session.py``, ``schedule.py``: no call into
this module on the step path); everything else here runs off it. Past :data:`CAP_BYTES` the file
is rewritten atomically from the session's state: older rows thinned, every finding and event
kept. A clean end appends an ``end`` record with the run's final plain data; the writer process
(:mod:`memcallbacks._files.writer_process`) builds the file set from it and removes the journal.
:func:`read_journal` reads one back, tolerating a torn last line. Imports nothing beyond the
standard library and :mod:`memcallbacks._base.limits` (the host's limits, for the ``start`` record).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from memcallbacks._base.limits import HostLimits
from memcallbacks._files.fileset import unlink_quietly

log = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION", "CAP_BYTES", "TICK_MASK", "TICK_BYTES", "UPDATE_EVERY", "RECORD_TYPES", "Journal", "JournalRecord", "journal_name", "find_journals",
    "read_journal", "replay_rows", "start_fields", "tick_path",
]

FORMAT_VERSION = 1
"""The journal's ``start.format``: bumped when a record's field changes meaning or goes away."""

CAP_BYTES = 8 << 20
"""The journal's cap: past it the file is compacted (older rows thinned, never the findings or events)."""

TICK_MASK = 7
"""A tick is written at the start of every step whose count is a multiple of ``TICK_MASK + 1`` (8): the
last step reached is known within 8 steps however quiet the steps are."""

TICK_BYTES = 128
"""The tick file beside the journal (``journal.tick``): one tick record, rewritten in place through a shared memory
map (a store into the page cache, no system call: a ``write`` after a step's compute costs it 20-50 µs). Like the
journal's own writes it survives the process's death, not a power loss."""

UPDATE_EVERY = 8
"""A finding whose figures alone change (a growth's rate, at every step of a leak) is written again once this many
steps passed since it last was: the journal holds its state within 8 steps, at one line per 8 steps."""

RECORD_TYPES = ("start", "row", "eval", "tick", "finding", "event", "end")

# the compacted journal keeps its rows within this share of the cap, its newest rows whole
_ROWS_SHARE = 0.5
_KEEP_NEWEST = 64


def journal_name(rank: int, world_size: int) -> str:
    """``journal.jsonl`` for a single process; ``journal.rank{r}.jsonl`` per rank when distributed."""
    return "journal.jsonl" if world_size <= 1 else f"journal.rank{rank}.jsonl"


def tick_path(journal: str | os.PathLike[str]) -> Path:
    """The tick file beside ``journal`` (:data:`TICK_BYTES`): ``journal.tick``, ``journal.rank{r}.tick``."""
    return Path(journal).with_suffix(".tick")


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, default=_plain, separators=(",", ":")) + "\n").encode()


def _plain(value: Any) -> Any:
    """A value ``json`` does not know (a numpy number, a path): as a float where it is a number, else text."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


class Journal:
    """This process's journal. Closed (``fd == -1``) until :meth:`open`, and after :meth:`close` or a
    write that failed (a full disk: said once, and the run goes on without it). The step path reads
    :attr:`fd` and adds what it writes to :attr:`bytes`; past :attr:`cap` it calls :meth:`compact`."""

    def __init__(self) -> None:
        self.fd = -1
        self.bytes = 0
        self.cap = CAP_BYTES
        self.slot: mmap.mmap | None = None  # the tick file, mapped (None: ticks are journal lines)
        self.path: Path | None = None
        self.run_id = ""
        self.version = -1  # the FindingLog version last written
        self.rows_exact = True  # the rows written replay into the engine's rows exactly (replay_rows)
        self.start: dict[str, Any] = {}
        self.state: Callable[[], tuple[list[list[Any]], list[list[Any]], int]] | None = None  # what compact() writes
        self._findings: dict[str, tuple[int, tuple[Any, ...], bytes]] = {}  # key -> (step, state, the last line written)
        self._events: list[bytes] = []
        self._said = False

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["fd"], state["slot"] = -1, None  # a descriptor or a map does not travel (DDP spawn pickles the session)
        state["state"] = None
        return state

    @property
    def open_(self) -> bool:
        return self.fd >= 0

    # ------------------------------------------------------------------ writing
    def open(self, folder: Path, start: dict[str, Any], *, rank: int, world_size: int, rows: int = 0,
             state: Callable[[], tuple[list[list[Any]], list[list[Any]], int]] | None = None) -> None:
        """Create (or truncate) the journal in ``folder`` and write its ``start`` record, synced. ``rows``: rows
        the engine holds already (a resumed state, a later stage): written only at the end. ``state``: the
        session's rows, evaluation rows and step, for :meth:`compact`."""
        self.close()
        self.state = state
        self.run_id = uuid.uuid4().hex
        self.path = Path(folder) / journal_name(rank, world_size)
        self.start = {"t": "start", "format": FORMAT_VERSION, "run_id": self.run_id, **start}
        self.version = -1
        self.rows_exact = rows == 0
        self._findings = {}
        self._events = []
        self._said = False
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self.fd, self.bytes = fd, 0
        self._write(_line(self.start), sync=True)
        try:  # written whole first, so that a store into the map never needs a new block (a full disk: SIGBUS)
            tick_fd = os.open(tick_path(self.path), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                if os.write(tick_fd, b" " * (TICK_BYTES - 1) + b"\n") == TICK_BYTES:
                    self.slot = mmap.mmap(tick_fd, TICK_BYTES)
            finally:
                os.close(tick_fd)
        except (OSError, ValueError) as exc:  # no shared map here: ticks go into the journal as lines
            log.debug("memcallbacks: no tick file beside the journal (%s); ticks are journal lines", exc)

    def _write(self, data: bytes, sync: bool = False) -> None:
        if self.fd < 0:
            return
        try:
            self.bytes += os.write(self.fd, data)
            if sync:
                os.fsync(self.fd)
        except OSError as exc:
            self.failed(exc)

    def failed(self, exc: BaseException) -> None:
        """A write failed (a full disk, a folder removed): the journal stops, said once; the run goes on."""
        if not self._said:
            self._said = True
            log.warning("memcallbacks: could not write the run's journal %s (%s); it stops here, and the run goes on. "
                        "The files are still written at the end of the run.", self.path,
                        getattr(exc, "strerror", None) or exc)
        self.close()

    def record(self, kind: str, body: dict[str, Any], sync: bool = False) -> None:
        """Append one record of type ``kind`` (off the step path: rows and ticks are written inline)."""
        if self.fd >= 0:
            try:
                self._write(_line({"t": kind, "time": round(time.time(), 3), **body}), sync)
            except (TypeError, ValueError) as exc:  # a value json cannot write: that record is left out
                log.debug("memcallbacks: a %s record could not be written to the journal: %s", kind, exc)

    def note_findings(self, findings: list[Any], version: int) -> None:
        """The findings raised or changed since the last call (``FindingLog.version`` moved). A new finding, or one
        whose state, severity or holders changed, is written and synced; an update that changes only its figures
        (a growth's rate, step by step) is written once :data:`UPDATE_EVERY` steps have passed since the last. A key
        gone from ``findings`` (it joined another cause) is dropped: every finding is written again, the first record
        with ``"gone"``, the keys the reader drops."""
        self.version = version
        if self.fd < 0:
            return
        new, sync = b"", False
        now = round(time.time(), 3)
        keys = {finding.key for finding in findings}
        gone = [key for key in self._findings if key not in keys]
        for key in gone:
            del self._findings[key]
        for finding in findings:
            key = finding.key
            known = self._findings.get(key)
            sign = (finding.state, finding.severity, tuple(finding.holders))
            if not gone and known is not None and known[1] == sign and (known[0] == finding.step or finding.step - known[0] < UPDATE_EVERY):
                continue
            try:
                body = json.dumps(finding.to_dict(), default=_plain, separators=(",", ":"))
            except Exception:  # a finding json cannot write stays out of the journal (report.json has it)
                continue
            line = b'{"t":"finding","time":%.3f,"finding":%b}\n' % (now, body.encode())
            sync = sync or known is None or known[1] != sign or bool(gone)
            self._findings[key] = (finding.step, sign, line)
            if gone and not new:  # the rewrite's first line names the keys gone
                line = b'{"t":"finding","time":%.3f,"gone":%b,"finding":%b}\n' % (now, json.dumps(gone).encode(), body.encode())
            new += line
        if new:
            self._write(new, sync=sync)

    def event(self, event: dict[str, Any]) -> None:
        """An exception or OOM event, synced."""
        if self.fd >= 0:
            line = _line({"t": "event", "time": round(time.time(), 3), "event": event})
            self._events.append(line)
            self._write(line, sync=True)

    def row(self, row: list[Any]) -> None:
        """A kept history row closed off the step path (the run's end closing the open step); the step writes its own inline."""
        if self.fd >= 0:
            try:
                self._write(b'{"t":"row","time":%.3f,"r":%b}\n' % (time.time(), json.dumps(row).encode()))
            except (TypeError, ValueError):
                self.rows_exact = False

    def eval_row(self, row: list[Any] | None) -> None:
        """An evaluation loop's row (None: the loop left none)."""
        if row is not None and self.fd >= 0:
            try:
                self._write(b'{"t":"eval","time":%.3f,"r":%b}\n' % (time.time(), json.dumps(row, default=_plain).encode()))
            except (TypeError, ValueError):
                pass

    def compact(self) -> None:
        """Rewrite the journal from the session's state (:attr:`state`: its rows, evaluation rows and step),
        atomically: the start record, the rows (thinned, oldest first, when they would take more than half the
        cap), the evaluation rows, the latest state of every finding, every event and a tick at the step.
        Reopened for appending after."""
        if self.fd < 0 or self.path is None or self.state is None:
            return
        rows, eval_rows, step = self.state()
        encoded = []
        for row in rows:
            try:
                encoded.append(b'{"t":"row","r":%b}\n' % json.dumps(row, default=_plain).encode())
            except (TypeError, ValueError):
                self.rows_exact = False
        kept = _thin(encoded, int(self.cap * _ROWS_SHARE))
        if len(kept) < len(encoded):
            self.rows_exact = False
        start = dict(self.start, compacted={"time": round(time.time(), 3), "rows_written": len(kept), "rows_held": len(rows)})
        body = b"".join([_line(start), *kept])
        for row in eval_rows[-256:]:
            try:
                body += b'{"t":"eval","r":%b}\n' % json.dumps(row, default=_plain).encode()
            except (TypeError, ValueError):
                pass
        body += b"".join(line for _, _, line in self._findings.values()) + b"".join(self._events)
        body += b'{"t":"tick","step":%d,"time":%.3f}\n' % (int(step), time.time())
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644)
            try:
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
                os.replace(tmp, self.path)
            except BaseException:
                os.close(fd)
                raise
        except OSError as exc:
            unlink_quietly(tmp)
            self.failed(exc)
            return
        os.close(self.fd)
        self.fd, self.bytes = fd, len(body)

    def end(self, payload: dict[str, Any], *, step: int, clean: bool = True) -> Path | None:
        """Append the ``end`` record (the run's final plain data for the writer process), synced, and close.
        Returns the journal's path, or None when it could not be written (the caller writes the files itself)."""
        if self.path is None:
            return None
        if self.fd < 0:
            return None
        before = self.bytes
        line = _line({"t": "end", "time": round(time.time(), 3), "clean": clean, "step": int(step), "run_id": self.run_id,
                      "payload": payload})
        self._write(line, sync=True)
        if self.fd < 0 or self.bytes != before + len(line):
            return None
        path = self.path
        self.close()
        unlink_quietly(tick_path(path))  # the end record says the last step: the tick file has done its work
        return path

    def close(self) -> None:
        """Close the descriptor and the tick file's map; the files stay (safe to call twice)."""
        slot, self.slot = self.slot, None
        if slot is not None:
            slot.close()
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def remove(self) -> None:
        """Close and delete the journal (a clean end whose files are in place, or a run that recorded nothing)."""
        self.close()
        if self.path is not None:
            unlink_quietly(self.path)
            unlink_quietly(tick_path(self.path))


def _thin(lines: list[bytes], budget: int) -> list[bytes]:
    """``lines`` within ``budget`` bytes: the newest :data:`_KEEP_NEWEST` whole, older ones every 2nd, 4th, ... line."""
    total = sum(len(x) for x in lines)
    if total <= budget or len(lines) <= _KEEP_NEWEST:
        return lines
    old, new = lines[:-_KEEP_NEWEST], lines[-_KEEP_NEWEST:]
    stride = 2
    while old and sum(len(x) for x in old[::stride]) + sum(len(x) for x in new) > budget and stride < len(old):
        stride *= 2
    return old[::stride] + new


def start_fields(*, framework: str, owner: str, rank: int, world_size: int, device: dict[str, Any], capacity: int | None,
                 config: dict[str, Any], columns: tuple[str, ...], eval_columns: tuple[str, ...], max_history_rows: int) -> dict[str, Any]:
    """The ``start`` record's fields besides its format and run id (docs/journal.md); the host's limits as
    :meth:`~memcallbacks._base.limits.HostLimits.record` gives them (``limits``, ``rss_bytes``, ``cgroup``)."""
    return {
        "time": round(time.time(), 3), "framework": framework, "owner": owner, "rank": rank, "world_size": world_size,
        "pid": os.getpid(), "host": socket.gethostname(), "device": device, "capacity_bytes": capacity,
        "columns": list(columns), "eval_columns": list(eval_columns), "max_history_rows": max_history_rows,
        "tick_every": TICK_MASK + 1, "cap_bytes": CAP_BYTES, "config": config,
        **HostLimits().record(),
    }


# ---------------------------------------------------------------------- reading
@dataclass
class JournalRecord:
    """One journal read back: its records by type (the latest state of each finding), and what was unreadable."""

    path: Path
    start: dict[str, Any] = field(default_factory=dict)
    rows: list[list[Any]] = field(default_factory=list)
    """The row records in order (replay them with :func:`replay_rows` for the engine's thinned rows)."""
    row_times: list[float] = field(default_factory=list)
    evals: list[list[Any]] = field(default_factory=list)
    findings: dict[str, dict[str, Any]] = field(default_factory=dict)
    finding_times: dict[str, float] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    last_tick: dict[str, Any] | None = None
    end: dict[str, Any] | None = None
    torn: bool = False
    """The last line was cut short (the process died while writing it): left out."""
    bad_lines: int = 0

    @property
    def run_id(self) -> str:
        return str(self.start.get("run_id") or "")

    @property
    def rank(self) -> int:
        return int(self.start.get("rank") or 0)

    def last_step(self) -> tuple[int | None, float | None]:
        """The last step recorded (rows, ticks, and the steps findings and events were recorded at: a finding
        confirmed after the last tick) and when (seconds since the epoch)."""
        step, when = None, None
        if self.rows:
            step, when = int(self.rows[-1][0]), (self.row_times[-1] if self.row_times else None)
        tick = self.last_tick
        if tick is not None and (step is None or int(tick.get("step", -1)) >= step):
            step, when = int(tick["step"]), tick.get("time")
        for item in (*self.findings.values(), *self.events):
            if isinstance(item.get("step"), int) and (step is None or item["step"] > step):
                step = item["step"]
        times = [t for t in (when, *self.finding_times.values(), *(e.get("time") for e in self.events)) if isinstance(t, (int, float))]
        return step, (max(times) if times else self.start.get("time"))


def read_journal(path: str | os.PathLike[str]) -> JournalRecord:
    """Read a journal back: every whole line, a torn last one left out (``torn``), other unreadable lines counted.
    Raises ``OSError`` when the file cannot be read and ``ValueError`` when its first record is no ``start``."""
    record = JournalRecord(Path(path))
    with open(path, "rb") as fh:
        data = fh.read()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        record.torn = True  # no newline at the end: the last write was cut short
        lines.pop()
    for raw in lines:
        try:
            item = json.loads(raw)
        except ValueError:
            record.bad_lines += 1
            continue
        if isinstance(item, dict):
            _add(record, item)
    if not record.start:
        raise ValueError(f"{str(path)!r} has no start record; it is not a memcallbacks journal.")
    try:  # the tick file beside it (TICK_BYTES): a record cut short by the process's death reads as no record
        tick = json.loads(tick_path(path).read_bytes())
    except (OSError, ValueError):
        tick = None
    if isinstance(tick, dict) and isinstance(tick.get("step"), int) and (
            record.last_tick is None or tick["step"] >= int(record.last_tick.get("step", -1))):
        record.last_tick = tick
    return record


def _add(record: JournalRecord, item: dict[str, Any]) -> None:
    kind = item.get("t")
    if kind == "row" and isinstance(item.get("r"), list):
        record.rows.append(item["r"])
        if "time" in item:
            record.row_times.append(item["time"])
    elif kind == "tick":
        record.last_tick = item
    elif kind == "finding" and isinstance(item.get("finding"), dict):
        for gone in item.get("gone") or ():  # joined another cause since its last record: one cause, one finding
            record.findings.pop(str(gone), None)
            record.finding_times.pop(str(gone), None)
        finding = item["finding"]
        key = str(finding.get("key") or finding.get("kind"))
        record.findings[key] = finding
        if "time" in item:
            record.finding_times[key] = item["time"]
    elif kind == "event" and isinstance(item.get("event"), dict):
        record.events.append(dict(item["event"], time=item.get("time")))
    elif kind == "eval" and isinstance(item.get("r"), list):
        record.evals.append(item["r"])
    elif kind == "start":
        if record.start:  # a second start: the file was reused by a new run (should not happen: it is truncated)
            record.rows, record.evals, record.findings, record.events = [], [], {}, []
        record.start = item
    elif kind == "end":
        record.end = item


def replay_rows(rows: list[list[Any]], max_rows: int) -> list[list[Any]]:
    """The engine's history from the row records it wrote: each appended, and halved (every second row kept)
    whenever there are more than ``max_rows``, as :class:`~memcallbacks._runtime.sampling.MemoryEngine` does."""
    kept: list[list[Any]] = []
    for row in rows:
        kept.append(row)
        if len(kept) > max_rows:
            kept = kept[1::2]
    return kept


def find_journals(folder: str | os.PathLike[str]) -> list[Path]:
    """The journals in ``folder`` (``journal.jsonl``, ``journal.rank{r}.jsonl``), in rank order."""
    folder = Path(folder)
    try:
        found = [p for p in folder.glob("journal*.jsonl") if p.is_file()]
    except OSError:
        return []

    def rank(p: Path) -> int:
        digits = p.name[len("journal.rank"):-len(".jsonl")]
        return int(digits) if digits.isdigit() else -1

    return sorted(found, key=rank)
