"""Snapshots are rank-local: under torch.distributed each rank's files travel to rank zero.

Only rank zero holds the trackers (Lightning's loggers, Accelerate's trackers and the Transformers
callbacks write from the main process), and a non-zero rank's files may sit on another node. So,
inside the one ``all_gather_object`` that already brings every rank's summary to rank zero at the
end of a run, each rank adds its snapshot records and the bytes of their files, up to
:data:`GATHER_LIMIT_BYTES` per rank (the pages and PNGs first, the pickles while room is left).
Rank zero writes the files it does not have into its own ``snapshots`` folder and hands all of
them to the trackers; a file left out names the rank and path where it stayed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from memcallbacks._files.outputs import atomic_write

log = logging.getLogger(__name__)

__all__ = ["GATHER_LIMIT_BYTES", "snapshot_payload", "receive_snapshots"]

GATHER_LIMIT_BYTES = 32 * 2**20
"""Bytes of snapshot files one rank sends to rank zero at the end of a run."""

_ORDER = {"html": 0, "png": 1, "census": 2, "snapshot": 3}


def snapshot_payload(records: list[dict[str, Any]], rank: int, limit: int = GATHER_LIMIT_BYTES) -> dict[str, Any] | None:
    """This rank's snapshot records and as many of their files' bytes as fit in ``limit``."""
    if not records:
        return None
    files = sorted(
        ((kind, Path(path)) for record in records for kind, path in (record.get("files") or {}).items() if Path(path).is_file()),
        key=lambda item: (_ORDER.get(item[0], 9), item[1].stat().st_size),
    )
    blobs: dict[str, bytes] = {}
    left_out: list[str] = []
    used = 0
    for _kind, path in files:
        size = path.stat().st_size
        if used + size > limit:
            left_out.append(str(path))
            continue
        blobs[str(path)] = path.read_bytes()
        used += size
    return {"rank": rank, "records": [dict(r) for r in records], "blobs": blobs, "left_out": left_out}


def receive_snapshots(payloads: list[dict[str, Any] | None], folder: Path | None) -> list[dict[str, Any]]:
    """On rank zero: write the other ranks' files into ``folder/snapshots`` (unless already there, as
    with one output_dir shared by every rank) and return their records with those paths."""
    out: list[dict[str, Any]] = []
    for payload in payloads:
        if not payload:
            continue
        rank = int(payload["rank"])
        for record in payload["records"]:
            local: dict[str, str] = {}
            for kind, path in (record.get("files") or {}).items():
                data = payload["blobs"].get(path)
                if data is None:
                    continue
                # into rank zero's folder (names carry the rank: .rank1.pickle); a shared output_dir already has it
                target = folder / "snapshots" / Path(path).name if folder is not None else Path(path)
                if folder is not None and not (target.is_file() and target.stat().st_size == len(data)):
                    atomic_write(target, lambda fh, d=data: fh.write(d), mode="wb")
                if target.is_file():
                    local[kind] = str(target)
            left = [p for p in (record.get("files") or {}).values() if p in payload["left_out"]]
            if left:
                log.warning("memcallbacks: snapshot files of rank %d stayed on that rank (over %d MiB): %s", rank, GATHER_LIMIT_BYTES >> 20, left)
            out.append(dict(record, rank=rank, files=local, left_on_rank=left))
    return out
