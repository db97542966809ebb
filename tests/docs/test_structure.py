"""The package's structure rules (scripts/check_structure.py) hold, and docs/architecture.md's tree
names every module there is."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_structure.py"


def test_structure_rules_hold() -> None:
    """Module and function sizes, no import circle, no private import, adapters that never reach
    into the session, libraries that never import the runtime (see the script's docstring)."""
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, "scripts/check_structure.py found:\n" + done.stdout + done.stderr


def _names(lines: list[str]) -> list[str]:
    """``package/module.py`` for every module line of a tree (packages end in ``/``)."""
    names, package = [], ""
    for line in lines[1:]:
        match = re.match(r"( +)(\S+)", line)
        if match is None:
            continue
        indent, name = len(match.group(1)), match.group(2)
        if indent == 4:
            package = name if name.endswith("/") else ""
            names.append(name)
        else:
            names.append(package + name)
    return names


def test_architecture_tree_names_every_module() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```\n(memcallbacks/\n.*?)\n```", doc, re.S)
    assert block is not None, "docs/architecture.md has no module tree"
    generated = subprocess.run([sys.executable, str(SCRIPT), "--tree"], capture_output=True, text=True, check=True,
                               timeout=120, cwd=ROOT).stdout.splitlines()
    documented, actual = _names(block.group(1).splitlines()), _names(generated)
    assert documented == actual, (
        "docs/architecture.md's tree is not the package's: run `python scripts/check_structure.py --tree` and paste it in "
        f"(missing: {sorted(set(actual) - set(documented))}, gone: {sorted(set(documented) - set(actual))})"
    )
