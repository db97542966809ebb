"""How a session starts, resumes and stops: the output folder, the device backend, the plan's intervals, the checks and snapshots, the checkpointed state, and every part undone again.

The functions behind ``Session.start``, ``reset``, ``state_dict``/``load_state_dict`` and
``stop`` (the session delegates to them, so that session.py holds the step protocol). Nothing
here imports a framework.
"""

from __future__ import annotations

import os
from typing import Any

from memcallbacks._files.outputs import check_writable
from memcallbacks._runtime.auto_snapshot import AutoSnapshot
from memcallbacks._runtime.lifecycle import claim_folder, release_folder

__all__ = ["start_run", "reset_run", "saved_state", "restore_state", "stop_run", "output_folder"]


def start_run(
    session: Any,
    device: Any,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    default_output_dir: str | os.PathLike[str] | None = None,
    framework_log_every: int | None = None,
    logs: bool = True,
    log_first_step: bool = False,
    expected_steps: int | None = None,
) -> None:
    """Choose the device backend, the output folder and the sampling/logging intervals (``Session.start``).

    Raises ``PermissionError`` for an unwritable output folder, or one another live monitor
    writes to: environment problems must stop the run before training, not during it. Any
    other fault here is contained (logged once; the monitor disables itself).
    ``expected_steps``: the run's length when the framework knows it (``max_steps``); the
    cadence samples the first steps of every run, so a short one (``fast_dev_run``) still has rows.
    """
    config = session.config
    if config.write_files:
        folder = output_folder(config.output_dir, default_output_dir)
        claim_folder(folder, session, session.owner)
        session.output_dir = check_writable(folder, session.owner)
        if config.auto_snapshot:
            check_writable(os.path.join(folder, "snapshots"), "auto_snapshot")
    session.live = True
    # the plan first: even a monitor whose start fails below must agree with the other ranks on logged steps
    log_every = config.log_every_n_steps or max(int(framework_log_every or 50), 1)
    # a later stage of the same run (fit, then test) keeps the training cadence
    session.plan.configure(log_every=log_every, logs=logs, log_first_step=log_first_step, keep=session.engine.seen_steps > 0)
    try:
        _start_parts(session, device, rank, world_size)
    except Exception as exc:  # backend selection, the first reads, the leak watch: never fatal
        session.engine.fail(exc, "monitor start")


def _start_parts(session: Any, device: Any, rank: int | None, world_size: int | None) -> None:
    config, engine = session.config, session.engine
    engine.start(device, rank=rank, world_size=world_size)
    session.plan.arm(engine.backend)
    session.cadence.guard.announce = (session.log, session.owner) if engine.rank == 0 else None  # the budget's back-off, said once
    session.checks.start(ignore=[session], device_is_host=session.device_kind == "cpu", keep_host=engine.seen_steps > 0)
    if session.snap is not None:
        session.snap.stop()
        session.snap = None
    if config.auto_snapshot and session.output_dir is not None and engine.backend is not None:
        session.snap = AutoSnapshot.for_backend(config, engine.backend, session.output_dir, engine.rank, engine.world_size, session.log)
        session.snap.start()


def reset_run(session: Any) -> None:
    """A new fit (``Session.reset``): no rows, events, findings or open step; nothing quiet yet."""
    session.engine.reset()
    session.files = {}
    session.events = []
    session.sink.reset()
    session.checks.reset()
    session.step_open = session.quiet_step = False
    session.plan.quiet_until = 0


def saved_state(session: Any) -> dict[str, Any]:
    """The engine's checkpointed state plus the run's events and findings (``Session.state_dict``)."""
    state = session.engine.state_dict()
    state["events"] = list(session.events)
    state["findings"] = session.sink.to_list()
    return state


def restore_state(session: Any, state: dict[str, Any], key: str) -> None:
    """Restore a checkpointed state; a bad one raises one ``ValueError`` naming ``key`` (see saved_state.py)."""
    read = session.engine.load_state_dict(state, key)
    if read is None:
        return
    session.events = read["events"]
    session.sink.restore(read["findings"])


def stop_run(session: Any) -> None:
    """Undo everything the session changed in the process (``Session.stop``); each part on its own, safe to call twice."""
    session.live = False
    release_folder(session.output_dir, session)
    session.checks.stop(session.snap)  # the host channel, the snapshots, the leak watch, the model copies
    try:
        session.engine.stop()
    except Exception:
        session.log.exception("%s: could not close its device backend; continuing.", session.owner)
        session.engine.backend = None


def output_folder(output_dir: Any, default: Any) -> str:
    """The one rule for where a run's files go: ``output_dir``, else the adapter's default (the
    framework's log folder), else ``memcallbacks_output`` in the working directory (not
    ``./memcallbacks``: run from a source checkout, that is the package itself). Absolute and
    with links resolved, once, at start: a later ``chdir`` must not move the files."""
    return os.path.realpath(output_dir or default or os.path.join(os.getcwd(), "memcallbacks_output"))
