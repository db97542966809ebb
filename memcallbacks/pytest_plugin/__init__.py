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
``--train-memory-fail-on-increase`` also fails when a phase peak rose against the test's last
passing run (pytest's cache). Loading the plugin imports no training framework.
See docs/pytest.md.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterator

import pytest

from memcallbacks._base.units import format_bytes
from memcallbacks._base.units import parse_size
from memcallbacks.pytest_plugin.limits import PHASE_NAMES, Limits, parse_fail_on

if TYPE_CHECKING:  # pragma: no cover
    from memcallbacks.pytest_plugin.session import TrainMemory

__all__ = ["train_memory"]

_SESSION = pytest.StashKey["Any"]()
_CACHE_PREFIX = "memcallbacks/train_memory/"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memcallbacks", "memcallbacks: training-memory checks (@pytest.mark.train_memory)")
    group.addoption(
        "--train-memory-fail-on-increase", action="store_true", default=False,
        help="fail a train_memory test whose per-phase peaks rose against its last passing run (kept in pytest's cache)",
    )
    group.addoption(
        "--train-memory-tolerance", type=float, default=0.05, metavar="FRACTION",
        help="relative rise of a phase peak tolerated by --train-memory-fail-on-increase (default 0.05)",
    )
    parser.addini(
        "train_memory_fail_on", type="args", default=[],
        help="findings that fail a train_memory test besides open problems: advice (a lingering output kept one "
        "step), settled (growth that stopped); default: neither",
    )
    group.addoption(
        "--train-memory-floor", default="1 MiB", metavar="SIZE",
        help="absolute rise of a phase peak always tolerated by --train-memory-fail-on-increase (default '1 MiB')",
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
    tolerance = config.getoption("--train-memory-tolerance")
    if not 0 <= tolerance < 10:
        raise pytest.UsageError(f"--train-memory-tolerance={tolerance} must be a fraction such as 0.05 (5%).")
    try:
        parse_size(config.getoption("--train-memory-floor"), "--train-memory-floor")
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
        _fail_on_oom(item, exc)
        raise
    session = item.stash.get(_SESSION, None)
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
        pytest.fail(text, pytrace=False)
    _store(item, session)
    return result


def _fail_on_oom(item: pytest.Item, exc: BaseException) -> None:
    """A watched test that ran out of memory fails with the explanation (where, what filled it, what makes it fit) as its message."""
    from memcallbacks.oom import explain_oom, is_oom

    session = item.stash.get(_SESSION, None)
    if session is None or not session.probes or not is_oom(exc):
        return
    def explained() -> list[str]:
        return [f.message for probe in session.probes for f in probe.core.findings if f.kind == "oom"]

    texts = explained()
    if not texts:  # no monitor saw it unwind (``train_memory.track()``'s loop body): record it, close them
        for probe in session.probes:
            probe.core.record_exception(exc, probe.core.current_step)
        session.close_monitors()  # their run end explains it, with the model and optimizer they watch
        texts = explained()
    if not texts:  # the loop's monitor had closed before the error reached the test (its generator closed while unwinding)
        model, optimizer = session.tracked or (None, None)
        try:
            texts = [explain_oom(exc, model=model, optimizer=optimizer, step=session.probes[-1].core.current_step).text()]
        except Exception:
            return
    pytest.fail(f"train_memory: {item.nodeid} ran out of memory ({type(exc).__name__})\n" + "\n".join(texts), pytrace=False)


def _warn_short(item: pytest.Item, session: TrainMemory) -> None:
    warmup = session.current_limits.warmup
    for probe in session.probes:
        if 0 < probe.steps <= warmup:
            item.warn(pytest.PytestWarning(
                f"train_memory: {probe.name} ran {probe.steps} step(s), not more than warmup={warmup}; the leak "
                "check needs at least one step after warm-up. Run more steps or lower warmup."
            ))


def _regressions(item: pytest.Item, session: TrainMemory) -> list[str]:
    config = item.config
    if not config.getoption("--train-memory-fail-on-increase") or getattr(config, "cache", None) is None:
        return []
    stored = config.cache.get(_CACHE_PREFIX + item.nodeid, None)
    peaks, source = session.phase_peaks()
    if not stored or stored.get("source") != source:
        return []
    tolerance = config.getoption("--train-memory-tolerance")
    floor = parse_size(config.getoption("--train-memory-floor"), "--train-memory-floor")
    out = []
    for phase in PHASE_NAMES:
        before, now = stored["peaks"].get(phase), peaks.get(phase)
        if before is None or now is None:
            continue
        if now > before * (1 + tolerance) and now - before > floor:
            out.append(
                f"peak {phase} rose to {format_bytes(now)} from {format_bytes(before)} in the last passing run "
                f"(+{format_bytes(now - before)}, {100 * (now - before) / max(before, 1):.1f}%; tolerance "
                f"{100 * tolerance:.0f}% and {format_bytes(floor)}; measured as {source})"
            )
    if out:
        out.append(
            "    fix: find what the change added to that phase, or accept the new peaks by running once without "
            "--train-memory-fail-on-increase (a passing run stores its peaks)."
        )
    return out


def _store(item: pytest.Item, session: TrainMemory) -> None:
    if getattr(item.config, "cache", None) is None:
        return
    peaks, source = session.phase_peaks()
    if peaks:
        item.config.cache.set(_CACHE_PREFIX + item.nodeid, {"peaks": {k: int(v) for k, v in peaks.items()}, "source": source})
