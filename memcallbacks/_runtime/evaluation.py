"""Evaluation loops inside a session: validate, test and predict rows, recorded apart from training rows and logged at their end.

The functions behind ``Session.begin_eval``, ``eval_batch`` and ``end_eval``; every fault is
contained by the engine (logged once; the monitor disables itself).
"""

from __future__ import annotations

from typing import Any

from memcallbacks._base.columns import E_STAGE

__all__ = ["begin_eval", "eval_batch", "end_eval"]


def begin_eval(session: Any, stage: str, step: int, epoch: int = 0) -> None:
    engine = session.engine
    if session.config.log_validation and engine.enabled:
        try:
            engine.begin_eval(stage, step, epoch)
        except Exception as exc:
            engine.fail(exc, f"{stage} start")


def eval_batch(session: Any) -> None:
    engine = session.engine
    if engine.enabled:
        try:
            engine.eval_batch()
        except Exception as exc:
            engine.fail(exc, "evaluation batch")


def end_eval(session: Any, log_step: int, emit: bool = True) -> list[Any] | None:
    """Close the evaluation loop's row and, unless ``emit`` is False or it is the sanity check, log it."""
    engine = session.engine
    if not session.config.log_validation:
        return None
    row = None
    if engine.enabled:
        try:
            row = engine.end_eval()
        except Exception as exc:
            engine.fail(exc, "evaluation end")
    stage = row[E_STAGE] if row is not None else "validate"
    if not emit or stage == "sanity_check" or (row is None and engine.world_size <= 1):
        return row
    try:
        session.emit(engine.eval_log_values(row, stage), log_step)
    except Exception as exc:
        engine.fail(exc, "evaluation logging")
    return row
