"""One run's files as one set: every file staged under a temporary name, then all renamed together.

A failure while staging (a full disk, a plot that raises) removes the staged files and leaves
the folder as it was, so the files there are always one run's. ``report.json`` is renamed last
and records the size and SHA-256 of the CSV files it belongs with; ``memcallbacks report``
checks them, so a set cut short between two renames (a crash in the few microseconds between
them) is refused rather than printed as one run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

__all__ = ["FileSet", "write_temporary", "fingerprint", "check_fingerprint"]


def fingerprint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of a file."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 16), b""):  # small reads: it also runs at an out-of-memory error
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def check_fingerprint(path: Path, expected: Any, report_path: Path) -> None:
    """Raise ``ValueError`` when ``path`` is not the file ``report.json`` was written with."""
    if not isinstance(expected, dict) or "sha256" not in expected:
        return  # a report from before fingerprints: nothing to check against
    actual = fingerprint(path)
    if actual["sha256"] != expected["sha256"]:
        raise ValueError(
            f"{path.name} ({actual['bytes']} bytes) is not the file {report_path.name} was written with "
            f"({expected.get('bytes')} bytes): the two come from different runs, or a run stopped while writing them. "
            "Re-run training, or read the files separately."
        )


def write_temporary(folder: Path, name: str, write: Callable[[Any], None], mode: str = "w") -> str:
    """Write ``name``'s content to a new temporary file in ``folder``, synced, mode 0644; return its path.

    The one way memcallbacks writes a file: :func:`~memcallbacks._files.outputs.atomic_write`
    renames the result into place at once, :class:`FileSet` renames a whole set together. A
    failure removes the temporary file and raises.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; reports are meant to be shared like any log file
        with os.fdopen(fd, mode) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        unlink_quietly(tmp)
        raise
    return tmp


class FileSet:
    """Stage files in ``folder``, then :meth:`commit` them (renamed in the order staged) or :meth:`discard`."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.staged: dict[str, tuple[str, Path]] = {}  # kind -> (temporary path, final path)

    def stage(self, kind: str, name: str, write: Callable[[Any], None], mode: str = "w") -> Path:
        final = self.folder / name
        self.staged[kind] = (write_temporary(self.folder, name, write, mode), final)
        return final

    def staged_fingerprint(self, kind: str) -> dict[str, Any]:
        return fingerprint(self.staged[kind][0])

    def discard(self) -> None:
        for tmp, _ in self.staged.values():
            unlink_quietly(tmp)
        self.staged = {}

    def commit(self, stale: list[str] = ()) -> dict[str, str]:  # type: ignore[assignment]
        """Remove ``stale`` names (this set's files another run left, which this run does not write),
        then rename every staged file into place in the order staged; return ``{kind: path}``."""
        for name in stale:
            unlink_quietly(self.folder / name)
        written = {}
        for kind, (tmp, final) in self.staged.items():
            os.replace(tmp, final)
            written[kind] = str(final)
        self.staged = {}
        try:  # the renames themselves reach the disk
            fd = os.open(self.folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:  # pragma: no cover - some file systems refuse fsync on a folder
            pass
        return written


def unlink_quietly(path: str | os.PathLike[str]) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        log.debug("could not remove %s", path, exc_info=True)
