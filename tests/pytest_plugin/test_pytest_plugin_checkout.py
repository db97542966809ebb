"""The pytest plugin from a plain checkout: no pytest11 entry point, registered through PYTEST_PLUGINS.

Real subprocess pytest runs. The entry point is taken out of the picture with pytest's own switch,
``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` (no entry-point plugin loads: what a checkout that was never
pip-installed sees), and ``scripts/pytest_plugin_env.sh`` (what scripts/gpu_check.sh sources) must
then register the plugin through ``PYTEST_PLUGINS``, and only then.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV_SCRIPT = ROOT / "scripts" / "pytest_plugin_env.sh"

TEST_FILE = '''
import torch
from torch import nn


def batches(n):
    torch.manual_seed(0)
    return [(torch.randn(16, 32), torch.randn(16, 1)) for _ in range(n)]


def test_keeps_losses(train_memory):
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for x, y in train_memory.track(model, optimizer, batches(6)):
        loss = ((model(x) - y) ** 2).mean()
        losses.append(loss)   # the leak: each step's loss, with its graph
        loss.backward(retain_graph=True)
        optimizer.step()
        optimizer.zero_grad()


def test_clean_loop(train_memory):
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in train_memory.track(model, optimizer, batches(6)):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
'''


# a test that only needs the plugin's fixture (no training: a run that only checks registration stays quick)
FIXTURE_ONLY = '''
def test_fixture_is_there(train_memory):
    assert hasattr(train_memory, "track")
'''


def _env(**changes: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")  # the checkout's package, imported by path
    env.update({k: v for k, v in changes.items() if v is not None})
    return env


def _pytest(tmp_path: Path, env: dict[str, str], *, source_env_script: bool, body: str = TEST_FILE) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_loop.py").write_text(body)
    pytest = f"{sys.executable} -m pytest -q -p no:cacheprovider -W ignore test_loop.py"
    command = f'. "{ENV_SCRIPT}" && memcallbacks_pytest_plugin_env && echo "PYTEST_PLUGINS=${{PYTEST_PLUGINS:-}}" && {pytest}'
    if not source_env_script:
        command = pytest
    # python3 in the env script must be this interpreter (the one with pytest and torch)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def test_without_an_entry_point_the_fixture_is_missing_and_the_env_script_registers_the_plugin(tmp_path: Path) -> None:
    bare = _pytest(tmp_path, _env(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"), source_env_script=False, body=FIXTURE_ONLY)
    assert "fixture 'train_memory' not found" in bare.stdout, bare.stdout[-3000:]  # what the GPU machine saw

    run = _pytest(tmp_path, _env(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"), source_env_script=True)
    assert "PYTEST_PLUGINS=memcallbacks.pytest_plugin\n" in run.stdout, run.stdout[-3000:]
    # the plugin works, not just its fixture: the leak fails naming the holder, the clean loop passes
    assert "1 failed, 1 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    assert "train_memory: test_loop.py::test_keeps_losses failed" in run.stdout
    assert "local losses" in run.stdout


def test_the_env_script_registers_only_where_no_entry_point_loads_it(tmp_path: Path) -> None:
    """Not both: where the entry point is installed the script leaves PYTEST_PLUGINS alone (pluggy would refuse
    the second registration); where it is not, it sets it. Either way the run finds the plugin once."""
    installed = any(ep.value.split(":")[0].strip() == "memcallbacks.pytest_plugin" for ep in entry_points(group="pytest11"))
    run = _pytest(tmp_path, _env(), source_env_script=True, body=FIXTURE_ONLY)
    expected = "PYTEST_PLUGINS=\n" if installed else "PYTEST_PLUGINS=memcallbacks.pytest_plugin\n"
    assert expected in run.stdout, (installed, run.stdout[-3000:])
    assert "1 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    if installed:  # and both at once is the error the script avoids
        both = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_loop.py"], cwd=tmp_path,
                              env=_env(PYTEST_PLUGINS="memcallbacks.pytest_plugin"), capture_output=True, text=True, timeout=240)
        assert both.returncode != 0 and "already registered" in both.stdout + both.stderr, both.stdout[-2000:] + both.stderr[-2000:]
