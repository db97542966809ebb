"""Check memcallbacks' structure rules with the ast module (docs/architecture.md says why).

Rules:
  * every module under memcallbacks/ has at most MODULE_LIMIT lines, an adapter (``monitor.py`` included) at most ADAPTER_LIMIT;
  * every function has at most FUNCTION_LIMIT lines, its docstring excluded;
  * no import circle between memcallbacks modules (imports inside functions and under
    ``TYPE_CHECKING`` count);
  * no ``from x import _private`` of another module's private name;
  * the adapters and the pytest plugin never reach into a session (``session._``, ``._session._``,
    ``.engine.``) nor assign an attribute on it;
  * the libraries never import the runtime (``memcallbacks._runtime``).

Run ``python scripts/check_structure.py``: prints one line per breach and exits 1 if there is any.
``python scripts/check_structure.py --tree`` prints the module tree of docs/architecture.md (each
module's first docstring line). ``tests/docs/test_structure.py`` runs both: the rules, and that the
tree in docs/architecture.md names every module there is and no other.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "memcallbacks"

MODULE_LIMIT = 400
ADAPTER_LIMIT = 300
FUNCTION_LIMIT = 60

# the adapters: they translate a framework's events into the session's protocol and never reach into it
ADAPTERS = ("lightning.py", "accelerate.py", "transformers.py", "monitor.py")
# the adapters held to ADAPTER_LIMIT: all of them, monitor.py (the plain loop's Monitor, the base of the
# Accelerate and Transformers monitors) included; what an adapter does besides translating its loop's
# events into the session's step protocol lives in _runtime/ (lightning_support.py, plain_support.py, ...)
FRAMEWORK_ADAPTERS = ("lightning.py", "accelerate.py", "transformers.py", "monitor.py")
LIBRARIES = ("leaks", "host", "snapshot", "estimate", "preflight", "trackers", "cli")

# Known offenders, each to be removed once its module is split. Empty now; never add to it.
ALLOWED_LONG_MODULES: set[str] = set()
ALLOWED_LONG_FUNCTIONS: set[str] = set()

SESSION_REACH = re.compile(r"session\._|\._session\._|\.engine\.")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def body_lines(node: ast.AST) -> int:
    """A function's lines, from its ``def`` to its last line, less its docstring's lines."""
    length = node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        length -= body[0].end_lineno - body[0].lineno + 1  # type: ignore[operator]
    return length


def function_names(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """Every function with its qualified name (``Class.method``, ``outer.inner``)."""
    found: list[tuple[str, ast.AST]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child))
                walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return found


def resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``from ... import`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, is_package: bool, tree: ast.AST, modules: set[str]) -> set[str]:
    """The memcallbacks modules ``module`` imports, anywhere in its file (``from pkg import sub``
    counts as importing ``pkg.sub``)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            source = resolve_from(module, is_package, node)
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in modules:
                    found.add(target)
                elif source in modules:
                    found.add(source)
    found.discard(module)
    return found


def private_imports(module: str, is_package: bool, tree: ast.AST, modules: set[str]) -> list[str]:
    """``from x import _name`` where ``_name`` is a private attribute of another module (not a submodule)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = resolve_from(module, is_package, node)
            if not source.startswith("memcallbacks") or source == module:
                continue
            for alias in node.names:
                name = alias.name
                if name.startswith("_") and not name.startswith("__") and f"{source}.{name}" not in modules:
                    found.append(f"from {source} import {name}")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = [0]

    def connect(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return groups


def session_reach(path: Path, source: str, tree: ast.AST) -> list[str]:
    """An adapter or the pytest plugin reaching into a session, or assigning on it."""
    found = [f"{rel(path)}:{n}: {line.strip()}" for n, line in enumerate(source.splitlines(), 1) if SESSION_REACH.search(line)]
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if not isinstance(part, ast.Attribute):
                    continue
                owner = part.value
                owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
                if owner_name in ("session", "_session") and isinstance(part.ctx, ast.Store):
                    found.append(f"{rel(path)}:{node.lineno}: assigns {owner_name}.{part.attr}")
    return found


def check() -> list[str]:
    problems: list[str] = []
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p): p for p in files}
    names = set(modules)
    graph: dict[str, set[str]] = {}
    for path in files:
        name = module_name(path)
        where = rel(path)
        source = path.read_text()
        tree = ast.parse(source, filename=str(path))
        is_package = path.name == "__init__.py"
        lines = len(source.splitlines())
        top = path.relative_to(PACKAGE).parts
        adapter = len(top) == 1 and top[0] in ADAPTERS
        limit = ADAPTER_LIMIT if len(top) == 1 and top[0] in FRAMEWORK_ADAPTERS else MODULE_LIMIT
        if lines > limit and where not in ALLOWED_LONG_MODULES:
            problems.append(f"{where}: {lines} lines (limit {limit})")
        for qualname, node in function_names(tree):
            length = body_lines(node)
            short = qualname.rsplit(".", 1)[-1]
            if length > FUNCTION_LIMIT and f"{where}::{short}" not in ALLOWED_LONG_FUNCTIONS:
                problems.append(f"{where}: function {qualname} has {length} lines (limit {FUNCTION_LIMIT})")
        graph[name] = imports_of(name, is_package, tree, names)
        problems += [f"{where}: {imp} (a private name of another module)" for imp in private_imports(name, is_package, tree, names)]
        if adapter or top[0] == "pytest_plugin":
            problems += [f"{p} (an adapter reaching into the session)" for p in session_reach(path, source, tree)]
        if top[0] in LIBRARIES:
            problems += [f"{where}: imports {m} (a library importing the runtime)"
                         for m in sorted(graph[name]) if m.startswith("memcallbacks._runtime")]
    # a package's __init__ is imported by its submodules implicitly; only explicit imports make a circle
    problems += [f"import circle: {' <-> '.join(group)}" for group in cycles(graph)]
    return problems


TREE_WIDTH = 154  # docs/architecture.md's tree lines are cut at this width


def _first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def tree() -> list[str]:
    """The module tree of docs/architecture.md: top-level modules, then each package and its modules."""
    lines = ["memcallbacks/"]

    def entry(indent: int, name: str, doc: str) -> str:
        return (" " * indent + name.ljust(23) + doc)[:TREE_WIDTH].rstrip()

    lines += [entry(4, p.name, _first_line(p)) for p in sorted(PACKAGE.glob("*.py")) if p.name != "__init__.py"]
    for package in sorted(d for d in PACKAGE.iterdir() if (d / "__init__.py").exists()):
        lines.append(entry(4, package.name + "/", _first_line(package / "__init__.py")))
        lines += [entry(8, p.name, _first_line(p)) for p in sorted(package.glob("*.py")) if p.name != "__init__.py"]
    return lines


def main() -> int:
    if "--tree" in sys.argv[1:]:
        print("\n".join(tree()))
        return 0
    problems = check()
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
