"""This rank's end-of-run files, written by a fresh interpreter (``python -m`` this module).

The rank (see :mod:`memcallbacks._runtime.end_write`) saves what :func:`write_outputs` needs as
plain data (the history frames, the report and the rank summaries as JSON values, the plot's
title) to ``PAYLOAD``, a temporary file in the output folder, and starts this module in a
session of its own. It imports no torch and no framework; it shares no thread, lock or device
with the rank (it is not a fork of it). It loads the payload, removes it, writes the set with
the same :func:`write_outputs` the rank would call, and writes one JSON line to its standard
output: ``{"files": {kind: path}}``, or ``{"error": ..., "errno": ...}`` (a full disk stays an
``OSError`` in the rank), with the log records of level INFO and above, which the rank replays
through its own loggers. A rank killed meanwhile is not waited for: the set is finished all the
same, and the result goes nowhere.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["save_payload", "plain_json", "main"]

PAYLOAD_VERSION = 1


def plain_json(value: Any) -> Any:
    """``value`` as the JSON values ``report.json`` would hold (what the file is written from, unchanged)."""
    from memcallbacks._files.outputs import json_safe

    return json.loads(json.dumps(json_safe(value), default=str))


def save_payload(folder: Path, rank: int, arguments: dict[str, Any]) -> str:
    """Write ``write_outputs(folder, **arguments)``'s arguments to a new temporary file in ``folder``; return its path.

    ``report`` and ``ranks`` are turned into JSON values here (nothing in the payload needs torch
    to load); the history frames go as pandas pickles, so their columns' types are kept."""
    arguments = dict(arguments)
    for key in ("report", "ranks"):
        if arguments.get(key) is not None:
            arguments[key] = plain_json(arguments[key])
    data = pickle.dumps({"version": PAYLOAD_VERSION, "folder": str(folder), "cwd": os.getcwd(), "arguments": arguments},
                        protocol=pickle.HIGHEST_PROTOCOL)
    fd, path = tempfile.mkstemp(prefix=f".memcallbacks-writer.rank{rank}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    except BaseException:
        _unlink(path)
        raise
    return os.path.abspath(path)


class _Records(logging.Handler):
    """The writer's log records, for the rank to replay."""

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
        try:
            with open(argv[0], "rb") as fh:
                payload = pickle.load(fh)  # pandas is imported here, for the frames
        finally:
            _unlink(argv[0])
        loaded = time.perf_counter()
        try:  # a relative output folder means what it meant in the rank (the writer started in the folder itself)
            os.chdir(payload["cwd"])
        except OSError:
            pass
        from memcallbacks._files.outputs import write_outputs

        files = write_outputs(Path(payload["folder"]), **payload["arguments"])
        result = {"files": files, "load_s": loaded - started, "write_s": time.perf_counter() - loaded}
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
    except OSError:  # the rank is gone (killed by its launcher): the files are written all the same
        pass
    return 0 if "files" in result else 1


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


if __name__ == "__main__":
    os._exit(main())  # no interpreter teardown to wait for: the files are synced and the result is sent
