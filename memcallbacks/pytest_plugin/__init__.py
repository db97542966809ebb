"""pytest plugin: fail a training test when a step leaks or outgrows its memory budget.

Installed with memcallbacks (a ``pytest11`` entry point); nothing to configure::

    @pytest.mark.train_memory(max_leak="0 B", max_peak="2 GiB")
    def test_fit(tmp_path):
        trainer = L.Trainer(max_steps=8, ...)      # a MemoryMonitor joins it for this test
        trainer.fit(model, loader)

Every Lightning ``Trainer``, Accelerate ``Accelerator`` and Transformers ``Trainer`` built in a
marked test gets a monitor; the ``train_memory`` fixture watches hand-written loops. The test
fails, after its body, on a lingering/growth/cycle finding, on Python objects on the host that grew
by more than ``max_leak`` (the host channel's ``host_growth``, named by a host census), on tensor
memory alive after the last step beyond what was alive after warm-up (an exact census of tensor
storages), on tensors that only
a ``gc.collect()`` at the end census freed (reference cycles), and on a phase peak over its limit.
``--train-memory-fail-on-increase`` also fails when the step's own memory (what a phase rose above
its step's start) or a phase peak rose against the test's last passing run (pytest's cache).
Loading the plugin imports no training framework.
See docs/pytest.md.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Iterator

import pytest

from memcallbacks._base.units import format_bytes, parse_threshold
from memcallbacks.pytest_plugin.limits import PHASE_NAMES, Limits, parse_fail_on

if TYPE_CHECKING:  # pragma: no cover
    from memcallbacks.pytest_plugin.session import TrainMemory

__all__ = ["train_memory"]

log = logging.getLogger(__name__)

_SESSION = pytest.StashKey["Any"]()
_OOM_TEXT = pytest.StashKey[str]()
#: The title of the section that follows an out-of-memory error's traceback in a failed test's report.
OOM_SECTION = "memcallbacks: out of memory, explained"
_CACHE_PREFIX = "memcallbacks/train_memory/"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memcallbacks", "memcallbacks: training-memory checks (@pytest.mark.train_memory)")
    group.addoption(
        "--train-memory-fail-on-increase", action="store_true", default=False,
        help="fail a train_memory test whose step's own memory (each phase's rise above the step's start) or per-phase "
        "peaks rose against its last passing run (kept in pytest's cache)",
    )
    group.addoption(
        "--train-memory-tolerance", default="5%", metavar="PERCENT",
        help="relative rise tolerated by --train-memory-fail-on-increase, a percentage of the last passing run's figure (default 5%%)",
    )
    parser.addini(
        "train_memory_fail_on", type="args", default=[],
        help="findings that fail a train_memory test besides open problems: advice (a lingering output kept one "
        "step), settled (growth that stopped); default: neither",
    )
    group.addoption(
        "--train-memory-floor", default="1 MiB", metavar="SIZE",
        help="absolute rise always tolerated by --train-memory-fail-on-increase, a size (default '1 MiB')",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "train_memory(max_leak='0 B', max_peak=None, warmup=2, phases=None, fail_on=None, **monitor_config): fail the test when a "
        "training step leaks (lingering/growth/cycle findings, Python objects on the host growing by more than max_leak, "
        "or tensor memory alive after the last step beyond "
        "what was alive after `warmup` steps by more than max_leak) or a phase peaks above max_peak / phases={...}. "
        "Monitors are attached to every Lightning Trainer, Accelerate Accelerator and Transformers Trainer the test "
        "builds (memcallbacks, docs/pytest.md).",
    )
    try:
        _tolerances(config)
        parse_fail_on(config.getini("train_memory_fail_on"), "train_memory_fail_on (ini)")
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def _marker_limits(node: pytest.Item) -> Limits | None:
    marker = node.get_closest_marker("train_memory")
    if marker is None:
        return None
    try:
        return Limits.from_marker(marker)
    except ValueError as exc:
        problem = str(exc)
    pytest.fail(f"{node.nodeid}: @pytest.mark.{problem}", pytrace=False)


@pytest.fixture
def train_memory(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Memory checks for this test: ``train_memory.track(model, optimizer, batches)`` for plain loops,
    ``train_memory.limits(...)`` to set limits; marked tests get it automatically."""
    from memcallbacks.pytest_plugin.session import TrainMemory

    limits = _marker_limits(request.node) or Limits()
    if limits.fail_on is None:
        limits = dataclasses.replace(limits, fail_on=tuple(request.config.getini("train_memory_fail_on")))
    session = TrainMemory(limits, tmp_path_factory.mktemp("train_memory"))
    request.node.stash[_SESSION] = session
    if request.node.get_closest_marker("train_memory") is not None:
        session.start()
    try:
        yield session
    finally:
        session.stop()
        # the verdict was given in pytest_runtest_call; items live until the session ends, and their
        # stash must not keep this test's trainers, models and batches alive for the next tests
        if _SESSION in request.node.stash:
            del request.node.stash[_SESSION]


@pytest.fixture(autouse=True)
def _train_memory_marker(request: pytest.FixtureRequest) -> None:
    # marked tests get the fixture without naming it; unmarked tests pay one marker lookup
    if request.node.get_closest_marker("train_memory") is not None:
        request.getfixturevalue("train_memory")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    try:
        result = yield
    except BaseException as exc:
        _end_runs(item, exc)
        raise  # the test fails with its own error, unchanged; an OOM's explanation follows it (pytest_runtest_makereport)
    session = item.stash.get(_SESSION, None)
    if session is not None:
        session.close_loops()  # a track() loop the test left with break: its end census before the verdict
    if session is None or not session.probes:
        if session is not None and item.get_closest_marker("train_memory") is not None:
            session.stop()
            item.warn(pytest.PytestWarning(
                "train_memory: this test built no Lightning Trainer, Accelerator or Transformers Trainer after its "
                "fixtures ran, and used no train_memory.track(); nothing was checked. Build the trainer in the test "
                "body (after `import lightning`/`accelerate`/`transformers`), or use train_memory.track()."
            ))
        return result
    failures = session.failures()
    _warn_short(item, session)
    regressions = _regressions(item, session) if not failures else []
    if failures or regressions:
        text = session.report(item.nodeid) if failures else f"train_memory: {item.nodeid}"
        if regressions:
            text += "\n\n" + "\n".join(regressions)
        # the failure's traceback keeps this frame: without its session, the test's trainer, model and data are
        # freed with the test, not kept alive into the next tests' censuses (and their peaks)
        session = None
        pytest.fail(text, pytrace=False)
    _store(item, session)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    report = yield
    text = item.stash.get(_OOM_TEXT, None)
    if text and call.when == "call" and report.failed and hasattr(report.longrepr, "addsection"):
        report.longrepr.addsection(OOM_SECTION, text)  # after the error's own traceback, as pytest shows it
        del item.stash[_OOM_TEXT]
    return report


def _end_runs(item: pytest.Item, exc: BaseException) -> None:
    """The test body raised: every run still open ends as an uncaught exception ends it (recorded, an OOM explained,
    the files written: ``Session.on_uncaught``), and an OOM's explanation is kept for the test's report. Never raises."""
    session = item.stash.get(_SESSION, None)
    if session is None or not session.probes:
        return
    try:
        for probe in session.probes:
            if probe.core.live:
                probe.core.ending.on_uncaught(exc)
        session.close_monitors()
        text = _oom_text(session, exc)
    except Exception:  # the test's own error is what the test reports
        log.warning("train_memory: the monitors could not record the test's error", exc_info=True)
        return
    if text:
        item.stash[_OOM_TEXT] = text


def _oom_text(session: TrainMemory, exc: BaseException) -> str | None:
    """The explanations of ``exc`` the test's monitors wrote, with their ``oom.json``; else one made now from the loop's
    model and optimizer (no monitor saw the error); None for an error that is not an OOM."""
    from memcallbacks.oom import explain_oom, is_oom

    if not is_oom(exc):
        return None
    findings = [f for probe in session.probes for f in probe.core.findings if f.kind == "oom"]
    texts = [f.message + (f"\n  written to {f.details['file']}" if f.details.get("file") else "") for f in findings]
    if not texts:
        model, optimizer = session.tracked or (None, None)
        texts = [explain_oom(exc, model=model, optimizer=optimizer, step=session.probes[-1].core.current_step).text()]
    return "\n".join(texts)


def _warn_short(item: pytest.Item, session: TrainMemory) -> None:
    warmup = session.current_limits.warmup
    for probe in session.probes:
        if 0 < probe.steps <= warmup:
            item.warn(pytest.PytestWarning(
                f"train_memory: {probe.name} ran {probe.steps} step(s), not more than warmup={warmup}; the leak "
                "check needs at least one step after warm-up. Run more steps or lower warmup."
            ))


def _tolerances(config: pytest.Config) -> tuple[float, int]:
    """``--train-memory-tolerance`` (a percentage, as a fraction) and ``--train-memory-floor`` (bytes); a
    number without a unit is refused with the fix, not read as a fraction or as bytes."""
    tolerance, _ = parse_threshold(config.getoption("--train-memory-tolerance"), "--train-memory-tolerance", size=False)
    floor, _ = parse_threshold(config.getoption("--train-memory-floor"), "--train-memory-floor", percent=False)
    if tolerance >= 10:
        raise ValueError(f"--train-memory-tolerance {config.getoption('--train-memory-tolerance')!r} is over 1000%; pass e.g. 5%.")
    return tolerance, int(floor)


def _regressions(item: pytest.Item, session: TrainMemory) -> list[str]:
    """The step's own memory (each phase's rise above its step's start) and the phase peaks against the
    last passing run's: a rise past both the tolerance and the floor is a regression."""
    config = item.config
    if not config.getoption("--train-memory-fail-on-increase") or getattr(config, "cache", None) is None:
        return []
    stored = config.cache.get(_CACHE_PREFIX + item.nodeid, None)
    peaks, source = session.phase_peaks()
    if not stored or stored.get("source") != source:
        return []
    tolerance, floor = _tolerances(config)
    measured = ((stored.get("rises") or {}, session.phase_rises(), "the step's own memory (its rise above the step's start)"),
                (stored["peaks"], peaks, "its peak"))
    out = []
    for phase in PHASE_NAMES:
        grew = []
        for before_figures, now_figures, what in measured:
            before, now = before_figures.get(phase), now_figures.get(phase)
            if before is not None and now is not None and now > before * (1 + tolerance) and now - before > floor:
                grew.append(f"{what} rose to {format_bytes(now)} from {format_bytes(before)} "
                            f"(+{format_bytes(now - before)}, +{100 * (now - before) / max(before, 1):.1f}%)")
        if grew:
            out.append(f"{phase}: {'; '.join(grew)}")
    if out:
        out.append(f"    against the last passing run; tolerance {100 * tolerance:g}% and {format_bytes(floor)}; measured as {source}")
        out.append(
            "    fix: find what the change added to that phase (a larger batch, a new activation or temporary), or accept "
            "the new figures by running once without --train-memory-fail-on-increase (a passing run stores them)."
        )
    return out


def _store(item: pytest.Item, session: TrainMemory) -> None:
    if getattr(item.config, "cache", None) is None:
        return
    peaks, source = session.phase_peaks()
    if peaks:
        rises = {k: int(v) for k, v in session.phase_rises().items()}
        item.config.cache.set(_CACHE_PREFIX + item.nodeid, {"peaks": {k: int(v) for k, v in peaks.items()}, "rises": rises, "source": source})
