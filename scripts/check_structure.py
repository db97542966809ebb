"""Check memcallbacks' structure rules with the ast module (docs/architecture.md says why).

Rules (split by concept, not by size: a cohesive class may be long, a function may not):
  * every class has at most CLASS_LIMIT lines, every module at most MODULE_LIMIT, an adapter
    (``monitor.py`` included) at most ADAPTER_LIMIT;
  * every function has at most FUNCTION_LIMIT lines, its docstring excluded;
  * a function on the step path (STEP_PATH's modules) takes at most STEP_PARAMS positional
    parameters (``self`` aside); more go keyword-only;
  * no function takes ``session: Any`` (an IDE cannot follow it);
  * a module's first docstring line is at most DOC_LINE characters;
  * no import circle between memcallbacks modules (imports inside functions and under
    ``TYPE_CHECKING`` count);
  * no ``from x import _private`` of another module's private name, and no reach into one:
    ``other._name`` or ``getattr(other, "_name")`` where ``_name`` is private to another module;
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

CLASS_LIMIT = 600
MODULE_LIMIT = 700
ADAPTER_LIMIT = 320
FUNCTION_LIMIT = 60
STEP_PARAMS = 5
DOC_LINE = 100
# the modules a training step runs through: their functions keep to STEP_PARAMS positional parameters
STEP_PATH = ("_runtime/session.py", "_runtime/schedule.py", "_runtime/sampling.py", "_runtime/checks.py",
             "_runtime/model_hooks.py", "lightning.py", "accelerate.py", "transformers.py", "monitor.py")

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


def private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines: its functions, classes, methods and attributes (``x._name = ...``)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        name = ""
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            name = node.attr
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            name = node.id
        elif isinstance(node, ast.arg):
            name = node.arg
        if name.startswith("_") and not name.startswith("__"):
            found.add(name)
    return found


def private_reaches(where: str, tree: ast.AST, own: set[str], others: set[str]) -> list[str]:
    """``x._name`` (``x`` not ``self``/``cls``) and ``getattr(x, "_name")`` where ``_name`` is private to
    another memcallbacks module (a framework's private names are not ours to police here)."""
    found = []
    for node in ast.walk(tree):
        name = ""
        if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            name = "" if isinstance(root, ast.Name) and root.id == "torch" else node.attr  # torch's own private API
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            name = node.args[1].value
        if name.startswith("_") and not name.startswith("__") and name in others and name not in own:
            found.append(f"{where}:{node.lineno}: reaches {name} (private to another module)")
    return found


def function_rules(where: str, tree: ast.AST, step_path: bool) -> list[str]:
    """No ``session: Any``; on the step path, at most STEP_PARAMS positional parameters."""
    found = []
    for qualname, node in function_names(tree):
        args = node.args  # type: ignore[attr-defined]
        positional = [a.arg for a in args.posonlyargs + args.args if a.arg not in ("self", "cls")]
        for a in args.posonlyargs + args.args + args.kwonlyargs:
            if a.arg == "session" and isinstance(a.annotation, ast.Name) and a.annotation.id == "Any":
                found.append(f"{where}: function {qualname} takes session: Any")
        if step_path and len(positional) > STEP_PARAMS:
            found.append(f"{where}: function {qualname} takes {len(positional)} positional parameters (limit {STEP_PARAMS}; "
                         "make the rest keyword-only)")
    return found


def class_sizes(where: str, tree: ast.AST) -> list[str]:
    return [f"{where}: class {node.name} has {node.end_lineno - node.lineno + 1} lines (limit {CLASS_LIMIT})"  # type: ignore[operator]
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LIMIT]  # type: ignore[operator]


def check() -> list[str]:
    problems: list[str] = []
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p): p for p in files}
    names = set(modules)
    graph: dict[str, set[str]] = {}
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in files}
    defined = {path: private_names(tree) for path, tree in trees.items()}
    for path in files:
        name = module_name(path)
        where = rel(path)
        source = path.read_text()
        tree = trees[path]
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
        problems += class_sizes(where, tree)
        inner = path.relative_to(PACKAGE).as_posix()
        problems += function_rules(where, tree, inner in STEP_PATH)
        others = set().union(*(names_ for other, names_ in defined.items() if other != path))
        problems += private_reaches(where, tree, defined[path], others)
        first = _first_line(path)
        if len(first) > DOC_LINE:
            problems.append(f"{where}: first docstring line has {len(first)} characters (limit {DOC_LINE})")
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


TREE_WIDTH = 8 + 23 + DOC_LINE  # docs/architecture.md's tree lines: indent, the name column, a first docstring line (never cut)


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
