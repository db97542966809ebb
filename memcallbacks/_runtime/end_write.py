"""The end-of-run write: built by a writer process, not killed with a failing peer, not outliving fit.

The heavy end of a run — the history frames (pandas), ``memory.png`` (matplotlib), the text
report — runs in a process of its own, so the training process pays neither its time nor its
resident memory (``close()`` and ``fit()``'s end: docs/reliability.md). The session appends its
``end`` record to the run's journal (:mod:`memcallbacks._files.journal`) and :func:`run_writer`
starts a fresh interpreter on :mod:`memcallbacks._files.writer_process`, which builds the set from
the journal, commits it, removes the journal and returns the files, the console lines and the
text report. The writer runs in a session of its own, so a signal to the training process or to
its process group does not reach it: under torch.distributed, when one rank raises, the launcher
takes the others down (Lightning's child-process observer SIGKILLs every rank within 5 s of a
child's non-zero exit, torch's ``ProcessContext.join`` SIGTERMs the survivors, torchrun's agent
signals its workers), and a rank killed while writing its files itself would leave ``.tmp`` files
and none of its own. The writer is not a fork: it shares none of the training process's threads
(OpenBLAS/OpenMP, gloo, NCCL), locks or devices, and imports no torch (a forked writer that
plotted after ``fork()`` hung and aborted in gloo runs; ``subprocess`` runs no Python code
between its fork and ``exec``). The training process waits for the writer's result, so
``fit()``/``close()`` return with the files in place, a full disk is still an ``OSError`` there,
and the writer's log records are replayed through its loggers. A writer that cannot start or
gives no result is replaced by the training process writing the set itself.
:func:`wait_for_every_rank` (one collective, after every rank wrote) keeps any rank's ``fit()``
from returning while another rank's files are still being written. :func:`write_at_exit` builds
the set of a plain monitor dropped without ``close()`` when the interpreter exits.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from memcallbacks._base import distributed as _distributed

log = logging.getLogger(__name__)

__all__ = ["WRITER", "WRITER_MODULE", "run_writer", "write_at_exit", "wait_for_every_rank", "WRITE_TIMEOUT_S", "EXIT_TIMEOUT_S"]

#: How long the training process waits for its writer before going on (the writer still finishes on its own).
WRITE_TIMEOUT_S = 300.0
#: How long the interpreter's exit waits for the writer of a monitor dropped without ``close()``.
EXIT_TIMEOUT_S = 120.0

WRITER = True
"""Build the end-of-run files in a writer process (see the module's docstring); False: in the training process."""

WRITER_MODULE = "memcallbacks._files.writer_process"
"""The module the writer process runs (``python -m``); tests put a slowed one in its place."""

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def run_writer(journal: Path, *, owner: str, timeout_s: float = WRITE_TIMEOUT_S) -> dict[str, Any] | None:
    """Build the file set of the run whose ``end`` record closes ``journal`` in a writer process; return its result:
    ``{"files": {kind: path}, "console": [...], "text": ...}``, or ``{"files": {}, "pending": True}`` past ``timeout_s``
    (the writer finishes on its own). Raises ``OSError`` when the writer reported one (a full disk). None when
    the writer cannot start, gives no result or fails otherwise: the caller writes the files itself."""
    if not WRITER or os.name != "posix" or not sys.executable:
        return None
    t0 = time.perf_counter()
    try:
        proc = _start(Path(journal))
    except Exception:
        log.debug("could not start the writer process; writing in this process", exc_info=True)
        return None
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _let_go(proc)
        log.error("%s: the memory files are still being written by process %d after %.0f s; going on without waiting "
                  "(they appear when it is done).", owner, proc.pid, timeout_s)
        return {"files": {}, "pending": True}
    except BaseException:  # a signal handler's exception: the writer finishes on its own
        _let_go(proc)
        raise
    result = _parse(out)
    if result is None:
        log.warning("%s: the writer process ended (exit status %s) without a result; writing the memory files in "
                    "this process.", owner, proc.returncode)
        return None
    _replay(result.get("log") or [])
    log.debug("%s: writer process %d: %.2f s in all (its own work %.2f s)", owner, proc.pid, time.perf_counter() - t0,
              result.get("write_s", float("nan")))
    if isinstance(result.get("files"), dict):
        result["files"] = {str(k): str(v) for k, v in result["files"].items()}
        return result
    if result.get("errno") is not None:
        raise OSError(result["errno"], result.get("strerror") or result.get("error"), result.get("filename"))
    log.warning("%s: the writer process failed (%s); writing the memory files in this process.", owner, result.get("error"))
    log.debug("the writer's traceback:\n%s", result.get("traceback", ""))
    return None


def _start(journal: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", WRITER_MODULE, str(journal.resolve())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=str(journal.parent),
        env=writer_environment(),
        start_new_session=True,  # a signal to the training process's group (torchrun, a terminal) does not reach it
        close_fds=True,
    )


# ---------------------------------------------------------------------- a plain monitor dropped without close()
_left: list[tuple[Path, str]] = []  # journals ended by a dropped monitor, written when the interpreter exits
_exiting = False


def write_at_exit(journal: Path, owner: str) -> None:
    """Build the file set of ``journal`` (ended by a monitor dropped without ``close()``) when the interpreter
    exits, or now when it is exiting already; its console lines are printed then."""
    if _exiting:
        _write_left(journal, owner)
        return
    _left.append((Path(journal), owner))


def _write_all_left() -> None:
    """At exit: the journals left so far; a finalizer that runs after this (weakref.finalize's own exit hook) writes its own."""
    global _exiting
    _exiting = True
    while _left:
        _write_left(*_left.pop(0))


# registered when the monitor is imported, before any monitor's finalizer exists: whichever of the two exit hooks
# runs first, every dropped monitor's files are written (see write_at_exit)
atexit.register(_write_all_left)


def _write_left(journal: Path, owner: str) -> None:
    if not journal.exists():
        return
    try:
        result = run_writer(journal, owner=owner, timeout_s=EXIT_TIMEOUT_S)
    except OSError as exc:
        log.error("%s: could not write the memory files of a monitor dropped without close() to %s (%s); its journal "
                  "%s keeps the run's record (memcallbacks report %s).", owner, journal.parent, exc.strerror or exc,
                  journal.name, journal.parent)
        return
    except Exception:  # pragma: no cover - the interpreter is exiting: nothing may raise here
        log.debug("the at-exit writer failed", exc_info=True)
        return
    for line in (result or {}).get("console") or []:
        print(line)


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
