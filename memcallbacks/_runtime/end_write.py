"""The end-of-run write under distributed training: not killed with a failing peer, not outliving fit.

When one rank raises, the launcher takes the others down: Lightning's child-process observer
SIGKILLs every rank (the main process included) within 5 s of a child's non-zero exit, torch's
``ProcessContext.join`` SIGTERMs the survivors, torchrun's agent signals its workers. A rank
that is still writing its files at that moment would leave ``.tmp`` files and none of its own.
So under torch.distributed the file set is written by a process of its own
(:func:`write_detached`): the rank saves the writer's arguments as plain data to a temporary
file in the output folder and starts a fresh interpreter on
:mod:`memcallbacks._files.writer_process`, in a session of its own, so a signal to the rank or
to its process group does not reach it, and it finishes the set. The writer is not a fork of
the rank: it shares none of the rank's threads (OpenBLAS/OpenMP, gloo, NCCL), locks or devices,
and imports no torch (a forked writer that plotted after ``fork()`` hung and aborted in gloo
runs; ``subprocess`` runs no Python code between its fork and ``exec``). The rank waits for the
writer's result, so on a healthy run ``fit()`` does not return before its files are in place, a
full disk is still an ``OSError`` in the rank, and the writer's log records are replayed through
the rank's loggers. :func:`wait_for_every_rank` (one collective, after every rank wrote) keeps
any rank's ``fit()`` from returning while another rank's files are still being written.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from memcallbacks._base import distributed as _distributed
from memcallbacks._files.fileset import unlink_quietly
from memcallbacks._files.writer_process import save_payload

log = logging.getLogger(__name__)

__all__ = ["DETACH_WRITER", "WRITER_MODULE", "write_detached", "wait_for_every_rank", "WRITE_TIMEOUT_S"]

#: How long a rank waits for its writer before going on (the writer still finishes on its own).
WRITE_TIMEOUT_S = 300.0

DETACH_WRITER = True
"""Under torch.distributed with more than one rank, write the end-of-run files in a process of
the rank's own starting (see the module's docstring); a single process writes them itself."""

WRITER_MODULE = "memcallbacks._files.writer_process"
"""The module the writer process runs (``python -m``); tests put a slowed one in its place."""

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def write_detached(write: Callable[..., dict[str, str]], folder: Path, *, detach: bool, owner: str,
                   timeout_s: float = WRITE_TIMEOUT_S, **arguments: Any) -> dict[str, str]:
    """``write(folder, **arguments)`` (``write_outputs``, returning ``{kind: path}``); by a writer process when ``detach``.

    The writer process runs :func:`~memcallbacks._files.outputs.write_outputs` with the same
    arguments. It raises ``OSError`` when the writer reported one (a full disk) and
    ``RuntimeError`` for any other failure of the writer, as ``write`` itself would. When the
    writer cannot be started, or ends without a result (killed, crashed), this process writes
    the files itself. Past ``timeout_s`` the rank goes on with no files (``{}``) and the writer
    finishes them on its own."""
    if not detach or os.name != "posix" or not sys.executable:
        return write(folder, **arguments)
    t0 = time.perf_counter()
    try:
        proc, payload = _start(Path(folder), arguments)
    except Exception:
        log.debug("could not start the writer process; writing in this process", exc_info=True)
        return write(folder, **arguments)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _let_go(proc)
        log.error("%s: the memory files are still being written by process %d after %.0f s; going on without waiting "
                  "(they appear when it is done).", owner, proc.pid, timeout_s)
        return {}
    except BaseException:  # a signal handler's exception: the writer finishes on its own
        _let_go(proc)
        raise
    result = _parse(out)
    if result is None:
        unlink_quietly(payload)  # when it ended before it read it
        log.warning("%s: the writer process ended (exit status %s) without a result; writing the memory files in "
                    "this process.", owner, proc.returncode)
        return write(folder, **arguments)
    _replay(result.get("log") or [])
    log.debug("%s: writer process %d: %.2f s in all (start and payload %.2f s, files %.2f s)", owner, proc.pid,
              time.perf_counter() - t0, result.get("load_s", float("nan")), result.get("write_s", float("nan")))
    if isinstance(result.get("files"), dict):
        return {str(k): str(v) for k, v in result["files"].items()}
    if result.get("errno") is not None:
        raise OSError(result["errno"], result.get("strerror") or result.get("error"), result.get("filename"))
    raise RuntimeError(f"the writer process failed: {result.get('error')}\n{result.get('traceback', '')}".rstrip())


def _start(folder: Path, arguments: dict[str, Any]) -> tuple[subprocess.Popen, str]:
    payload = save_payload(folder, int(arguments.get("rank", 0)), arguments)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", WRITER_MODULE, payload],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=str(folder),
            env=writer_environment(),
            start_new_session=True,  # a signal to the rank's process group (torchrun, a terminal) does not reach it
            close_fds=True,
        )
    except BaseException:
        unlink_quietly(payload)
        raise
    return proc, payload


def writer_environment() -> dict[str, str]:
    """The rank's environment, with its ``sys.path`` (memcallbacks' own folder first) and one thread per numeric library."""
    entries: list[str] = []
    for entry in [str(Path(__file__).resolve().parents[2]), *sys.path]:
        entry = os.path.abspath(entry or os.curdir)
        if entry not in entries and os.path.exists(entry):
            entries.append(entry)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(entries))
    env.update({name: "1" for name in _THREAD_VARIABLES})  # the writer draws one small plot
    return env


def _let_go(proc: subprocess.Popen) -> None:
    """Stop listening to a writer that goes on alone: its result goes nowhere rather than into a full pipe,
    and a daemon thread reaps it when it is done (no zombie, no "still running" warning)."""
    try:
        if proc.stdout is not None:
            proc.stdout.close()
    except OSError:  # pragma: no cover
        pass
    threading.Thread(target=proc.wait, name="memcallbacks-writer-reaper", daemon=True).start()


def _parse(out: bytes | None) -> dict[str, Any] | None:
    lines = (out or b"").decode("utf-8", "replace").strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return result if isinstance(result, dict) else None


def _replay(records: list[Any]) -> None:
    for record in records:
        try:
            logging.getLogger(str(record["name"])).log(int(record["levelno"]), "%s", record["message"])
        except Exception:  # pragma: no cover - a malformed record is dropped
            pass


def wait_for_every_rank(world_size: int, owner: str) -> None:
    """Under torch.distributed, return when every rank has written its files (one small collective).
    Every rank that took part in the end-of-run gather calls it; a peer gone by now is logged, not raised."""
    if world_size <= 1 or not _distributed.is_distributed():
        return
    try:
        _distributed.gather_objects(None)
    except Exception as exc:
        log.warning("%s: could not wait for the other ranks' memory files (%s: %s); their files may still be in progress.",
                    owner, type(exc).__name__, exc)
