"""Reading a checkpointed monitor state: older versions migrate, anything else is one clear error.

``state_dict()`` writes ``{"version": STATE_VERSION, "columns": [...], "rows": [...], ...}``. A
state from an older version (fewer columns, no ``version``) loads with the missing columns
filled; a state from a newer version is skipped with a warning (its meaning is unknown here);
a state of the wrong shape raises ``ValueError`` naming the checkpoint key it came from.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from memcallbacks._base.columns import COLUMNS, EVAL_COLUMNS

__all__ = ["read_state", "COLUMN_DEFAULTS"]

#: What a column missing from an older state holds (the others: NaN, "not measured").
COLUMN_DEFAULTS = {"epoch": 0, "batch_idx": 0, "micro_batches": 1, "optimizer_steps": 1}
_INT_COLUMNS = ("step", "epoch", "batch_idx", "micro_batches", "optimizer_steps")


def _bad(key: str, what: str) -> ValueError:
    return ValueError(
        f"memcallbacks: the checkpoint's monitor state under {key!r} is not one this version can read: {what}. "
        f"Drop that entry from the checkpoint (checkpoint['callbacks'].pop({key!r}) for Lightning) to resume "
        "with a fresh memory history."
    )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_state(state: Any, key: str, current_version: int) -> dict[str, Any] | None:
    """Validate and migrate ``state``; None for a newer version (skip it). Raises ``ValueError``."""
    if not isinstance(state, Mapping):
        raise _bad(key, f"expected a dict, got {type(state).__name__}")
    if not any(name in state for name in ("version", "columns", "rows")):
        raise _bad(key, f"expected the dict a monitor's state_dict() returns (with 'version', 'columns' and 'rows'), got "
                        f"{'an empty dict' if not state else 'a dict with keys ' + repr(sorted(map(str, state))[:8])}")
    version = state.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise _bad(key, f"version {version!r} is not a positive integer")
    if version > current_version:
        return None
    columns = state.get("columns", list(COLUMNS))
    rows = state.get("rows", [])
    if not isinstance(columns, (list, tuple)) or not all(isinstance(c, str) for c in columns):
        raise _bad(key, "'columns' is not a list of column names")
    if "step" not in columns:
        raise _bad(key, "'columns' has no 'step' column")
    if not isinstance(rows, (list, tuple)):
        raise _bad(key, f"'rows' is a {type(rows).__name__}, not a list")
    index = [columns.index(c) if c in columns else None for c in COLUMNS]
    out_rows = []
    for n, row in enumerate(rows):
        if not isinstance(row, (list, tuple)) or len(row) != len(columns):
            raise _bad(key, f"row {n} has {len(row) if isinstance(row, (list, tuple)) else type(row).__name__} values for {len(columns)} columns")
        new = [row[i] if i is not None else COLUMN_DEFAULTS.get(name, math.nan) for i, name in zip(index, COLUMNS)]
        if not all(v is None or _number(v) for v in new):
            raise _bad(key, f"row {n} holds a value that is not a number")
        new = [math.nan if v is None else v for v in new]
        if any(v != v for v in (new[COLUMNS.index(c)] for c in _INT_COLUMNS)):
            raise _bad(key, f"row {n} has no step/epoch/batch number")
        out_rows.append(new)
    eval_rows = state.get("eval_rows", [])
    if not isinstance(eval_rows, (list, tuple)) or not all(isinstance(r, (list, tuple)) and len(r) == len(EVAL_COLUMNS) for r in eval_rows):
        raise _bad(key, f"'eval_rows' is not a list of {len(EVAL_COLUMNS)}-value rows")
    counts = {}
    for name, default in (("stride", 1), ("seen_steps", len(out_rows)), ("sampled_steps", len(out_rows)), ("max_allocated", 0), ("max_reserved", 0)):
        value = state.get(name, default)
        if not _number(value) or value != value:
            raise _bad(key, f"{name!r} is {value!r}, not a number")
        counts[name] = int(value)
    events, findings = state.get("events", []), state.get("findings", [])
    if not isinstance(events, (list, tuple)) or not isinstance(findings, (list, tuple)):
        raise _bad(key, "'events' or 'findings' is not a list")
    return {"rows": out_rows, "eval_rows": [list(r) for r in eval_rows], "events": [e for e in events if isinstance(e, dict)],
            "findings": [f for f in findings if isinstance(f, dict)], **counts}
