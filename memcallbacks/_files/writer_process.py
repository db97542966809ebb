"""A run's end-of-run files, built by a fresh interpreter from its journal (``python -m`` this module).

The training process (see :mod:`memcallbacks._runtime.end_write`) appends the run's ``end``
record to its journal (:mod:`memcallbacks._files.journal`): the report and the rank summaries
as JSON values, the evaluation rows, the plot's title, and the history rows themselves only
where the journal's row records do not replay into them exactly. It then starts this module on
the journal, in a session of its own. The writer imports no torch and no framework; it shares no
thread, lock or device with the training process (it is not a fork of it), which pays neither
the time nor the resident memory of pandas, matplotlib and the drawing. It reads the journal,
builds the history frames, writes the set with the same :func:`write_outputs` the training
process would call (so the files are the ones it would write), removes the journal, and writes
one JSON line to its standard output: ``{"files": {kind: path}, "console": [...], "text": ...}``
(the end-of-run console lines and the text report), or ``{"error": ..., "errno": ...}`` (a full
disk stays an ``OSError`` in the training process), with the log records of level INFO and
above, which the training process replays through its own loggers. A training process killed
meanwhile is not waited for: the set is finished all the same, and the result goes nowhere.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["build_files", "main"]

PAYLOAD_VERSION = 2


class _Records(logging.Handler):
    """The writer's log records, for the training process to replay."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
            self.records.append({"name": record.name, "levelno": record.levelno, "message": message})
        except Exception:  # pragma: no cover - a record that cannot be formatted is dropped
            pass


def _rows_check(rows: list[list[Any]]) -> list[Any]:
    """What the end record says of the engine's rows, to check a replay against: count, first and last step, step sum."""
    steps = [row[0] for row in rows]
    return [len(rows), steps[0] if steps else None, steps[-1] if steps else None, sum(steps)]


def build_files(journal: Path) -> dict[str, Any]:
    """Write the file set of the run whose ``end`` record closes ``journal``; return the files, the console
    lines and the text report. Raises ``ValueError`` for a journal without one, or whose rows do not replay."""
    from memcallbacks._files.journal import read_journal, replay_rows
    from memcallbacks._files.outputs import write_outputs
    from memcallbacks._files.report import format_report
    from memcallbacks._files.verdict import console_lines
    from memcallbacks._runtime.readout import eval_frame, history_frame, predicted_columns

    record = read_journal(journal)
    end = record.end
    if end is None or not isinstance(end.get("payload"), dict):
        raise ValueError(f"{journal} has no end record: the run did not finish (memcallbacks report reads it as it is).")
    payload = end["payload"]
    try:  # a relative output folder means what it meant in the training process
        os.chdir(payload["cwd"])
    except (OSError, KeyError):
        pass
    rows = payload.get("rows")
    if rows is None:
        rows = replay_rows(record.rows, int(payload["max_history_rows"]))
        if _rows_check(rows) != payload.get("rows_check"):
            raise ValueError(f"{journal}: its row records do not replay into the run's {payload.get('rows_check')} rows.")
    history = predicted_columns(history_frame(rows, payload.get("device_kind", "cpu")), payload.get("predicted"))
    eval_history = eval_frame(payload.get("eval_rows") or [])
    report = payload["report"]
    files = write_outputs(Path(payload["folder"]), rank=int(payload["rank"]), world_size=int(payload["world_size"]),
                          history=history, eval_history=eval_history, report=report, plot=bool(payload.get("plot")),
                          title=str(payload.get("title") or ""), ranks=payload.get("ranks"), end_started=payload.get("end_started"))
    try:
        os.unlink(journal)  # the set is in place: the stream it replaces goes
    except OSError:
        pass
    result: dict[str, Any] = {"files": files}
    if payload.get("console"):
        result["console"] = console_lines(dict(report, files=files), history)
    if payload.get("text", True):
        with open(files["report"]) as fh:
            result["text"] = format_report(json.load(fh), history)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    started = time.perf_counter()
    # the result goes to the standard output as it was given; anything else printed there, nowhere
    result_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    records = _Records()
    root = logging.getLogger()
    root.addHandler(records)
    root.setLevel(logging.INFO)
    result: dict[str, Any]
    try:
        result = build_files(Path(argv[0]))
        result["write_s"] = time.perf_counter() - started
    except OSError as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "errno": exc.errno, "strerror": exc.strerror,
                  "filename": None if exc.filename is None else str(exc.filename)}
    except BaseException as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "errno": None,
                  "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()}
    result["log"] = records.records
    result["torch_imported"] = "torch" in sys.modules
    data = (json.dumps(result, default=str) + "\n").encode("utf-8")
    try:
        while data:
            data = data[os.write(result_fd, data):]
    except OSError:  # the training process is gone (killed by its launcher): the files are written all the same
        pass
    return 0 if "files" in result else 1


if __name__ == "__main__":
    os._exit(main())  # no interpreter teardown to wait for: the files are synced and the result is sent
