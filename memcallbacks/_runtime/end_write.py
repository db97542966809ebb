"""The end-of-run write under distributed training: not killed with a failing peer, not outliving ``fit()``.

When one rank raises, the launcher takes the others down: Lightning's child-process observer
SIGKILLs every rank (the main process included) within 5 s of a child's non-zero exit, torch's
``ProcessContext.join`` SIGTERMs the survivors, torchrun's agent signals its workers. A rank
that is still writing its files at that moment would leave ``.tmp`` files and none of its own.
So under torch.distributed the file set is written by a forked child process in a session of
its own (:func:`write_detached`): a signal to the rank, or to its process group, does not reach
it, and it finishes the set. The rank waits for it, so on a healthy run ``fit()`` does not
return before its files are in place, and :func:`wait_for_every_rank` (one collective, after
every rank wrote) keeps any rank's ``fit()`` from returning while another rank's files are
still being written. The child only serialises data the rank already holds (pandas, json,
matplotlib's Agg renderer); it touches no device, no collective and no tracker, and leaves
with ``os._exit`` (no atexit handlers, no finalizers of the rank's objects).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import time
from typing import Callable

from memcallbacks._base import distributed as _distributed

log = logging.getLogger(__name__)

__all__ = ["DETACH_WRITER", "write_detached", "wait_for_every_rank", "WRITE_TIMEOUT_S"]

#: How long a rank waits for its writer before going on (the writer still finishes on its own).
WRITE_TIMEOUT_S = 300.0


DETACH_WRITER = False
"""Off: a forked writer hung for 300 s (and once aborted with "terminate called without an active
exception") in 2-rank gloo runs on a loaded machine. The child plots with matplotlib/numpy after a
fork of a process whose OpenBLAS/OpenMP and gloo threads were running, which is not fork-safe. The
files are written in the rank's own process again; :func:`wait_for_every_rank` still keeps every
rank's ``fit()``/``close()`` from returning before the others' files are written. A writer that
survives a failing peer's SIGKILL needs a fork-safe design (a spawned process, or no plotting in
the child)."""


def write_detached(write: Callable[[], dict[str, str]], *, detach: bool, owner: str, timeout_s: float = WRITE_TIMEOUT_S) -> dict[str, str]:
    """``write()`` (returning ``{kind: path}``), in a forked child when ``detach`` and the platform can fork.

    Raises ``OSError`` when the writer reported one (a full disk) and ``RuntimeError`` for any
    other failure of the writer, as ``write()`` itself would."""
    if not detach or not hasattr(os, "fork"):
        return write()
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        log.debug("could not fork the writer; writing in this process", exc_info=True)
        return write()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected (it leaves by os._exit)
        _child(write, read_end, write_end)
    os.close(write_end)
    try:
        payload = _read_all(read_end, timeout_s)
    finally:
        os.close(read_end)
    if payload is None:
        log.error("%s: the memory files are still being written by process %d after %.0f s; going on without waiting "
                  "(they appear when it is done).", owner, pid, timeout_s)
        return {}
    _reap(pid)
    try:
        result = json.loads(payload.decode("utf-8"))
    except ValueError:
        result = {"error": "the writer process ended without a result", "errno": None}
    if "files" in result:
        return {str(k): str(v) for k, v in result["files"].items()}
    if result.get("errno") is not None:
        raise OSError(result["errno"], result.get("strerror") or result["error"])
    raise RuntimeError(f"the writer process failed: {result['error']}")


def _child(write: Callable[[], dict[str, str]], read_end: int, write_end: int) -> None:  # pragma: no cover
    code = 1
    try:
        os.close(read_end)
        try:
            os.setsid()  # a signal to the rank's process group (torchrun) does not reach the writer
        except OSError:
            pass
        for signum in (signal.SIGTERM, signal.SIGINT):  # not the framework's handlers (Lightning's run collectives)
            try:
                signal.signal(signum, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        try:
            result: dict[str, object] = {"files": write()}
            code = 0
        except OSError as exc:
            result = {"error": f"{type(exc).__name__}: {exc}", "errno": exc.errno, "strerror": exc.strerror}
        except BaseException as exc:
            result = {"error": f"{type(exc).__name__}: {exc}", "errno": None}
        data = json.dumps(result).encode("utf-8")
        while data:
            data = data[os.write(write_end, data):]
    finally:
        os._exit(code)


def _read_all(fd: int, timeout_s: float) -> bytes | None:
    """Everything written to the pipe until the writer closes it; None when ``timeout_s`` passes first."""
    chunks = []
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            ready, _, _ = select.select([fd], [], [], remaining)
        except InterruptedError:  # pragma: no cover - PEP 475 retries select itself
            continue
        if not ready:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # pragma: no cover - reaped elsewhere (a SIGCHLD handler)
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
