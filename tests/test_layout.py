"""The package's layers and its map.

- The core imports no torch (importing it loads none, and no core module imports it at module level).
- Every import of a package module, at module level or inside a function, points down the layers
  (core <- runtime <- report <- service <- integrations) or stays in its own; an upward one inside a
  function is allowed only when ``ALLOWED_UPWARD`` names it, with the reason.
- No two modules import each other, directly or around a longer loop (``test_no_import_cycles``).
- docs/architecture.md names every module file and names no file that does not exist.
"""

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_remat"
LAYERS = ["core", "runtime", "report", "service", "integrations"]

# (importing module, imported module) -> why an import inside a function may point up. Each entry
# must still exist (test_allowed_upward_imports_still_exist), so the list cannot outlive its reason.
# None is needed now (core/plan.py's import of report.render went with core/plan_text.py); an entry
# reads: ("lightning_remat.core.x", "lightning_remat.report.y"): "why it cannot move down".
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the package module imported
    line: int
    inner: bool  # inside a function or class body, not at module level


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The package module a dotted name is, or is in (``a.b.func`` -> ``a.b``)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(path: Path) -> list[Import]:
    """Every import of a package module in ``path``: module level, and inside functions and classes."""
    tree = ast.parse(path.read_text())
    source = _module_name(path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from .pkg import module`` imports the module; ``from .module import name`` the module.
            names = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name) if name.startswith("lightning_remat") else None
            if target is not None and target != source:
                found.append(Import(source, target, node.lineno, id(node) not in top_level))
    return found


ALL_IMPORTS = [i for path in MODULES.values() for i in imports_of(path)]


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_importing_the_core_loads_no_torch():
    code = ("import sys, lightning_remat, lightning_remat.core, lightning_remat.core.batch_fit; "
            "from lightning_remat import solve, parse_budget, Plan, RematConfig, RematError; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'lightning.', 'rich'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_the_import_reader_sees_imports_inside_functions():
    inner = [i for i in ALL_IMPORTS if i.inner]
    assert len(inner) > 30, "imports inside functions are read too"
    assert any(i.source == "lightning_remat.service.planning" and i.target == "lightning_remat.core.offload_model"
               for i in inner)


@pytest.mark.parametrize("path", sorted(p for layer in LAYERS for p in (PACKAGE / layer).rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    own = LAYERS.index(path.relative_to(PACKAGE).parts[0])
    upward = [i for i in imports_of(path) if (_layer(i.target) or 0) > own]
    module_level = [f"{i.target} (line {i.line})" for i in upward if not i.inner]
    assert not module_level, f"{path.relative_to(PACKAGE)} imports from a higher layer at module level: {module_level}"
    unlisted = [f"{i.target} (line {i.line}, inside a function)" for i in upward
                if (i.source, i.target) not in ALLOWED_UPWARD]
    assert not unlisted, (f"{path.relative_to(PACKAGE)} imports from a higher layer: {unlisted}; move the code down, "
                          "or, if it must stay, add the import to ALLOWED_UPWARD in tests/test_layout.py with the reason")


def test_allowed_upward_imports_still_exist():
    edges = {(i.source, i.target) for i in ALL_IMPORTS}
    stale = [pair for pair in ALLOWED_UPWARD if pair not in edges]
    assert not stale, f"ALLOWED_UPWARD lists imports that are gone; remove them: {stale}"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def test_cycle_finder_finds_loops():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    edges: dict[str, set[str]] = {}
    for i in ALL_IMPORTS:
        edges.setdefault(i.source, set()).add(i.target)
    cycles = _cycles(edges)
    assert not cycles, "modules that import each other (directly or around a loop): " + "; ".join(
        " <-> ".join(c) for c in cycles)


# ------------------------------------------------------------------------------ docs/architecture.md


def _is_package_marker(path: Path) -> bool:
    """An ``__init__.py`` that only documents and re-exports (docstring, imports, ``__all__``): no
    job of its own, so docs/architecture.md need not name it."""
    if path.name != "__init__.py":
        return False
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            continue
        return False
    return True


def architecture_files(text: str) -> list[str]:
    """The files the tree of docs/architecture.md names, as paths under ``lightning_remat/``.

    The tree is the page's first fenced block: a line whose first word ends in ``/`` is a folder, one
    whose first word ends in ``.py`` a file; indentation nests them.

    Example:
        >>> architecture_files("# Architecture\\n```\\nlightning_remat/\\n  core/  x\\n    a.py  job\\n"
        ...                    "  b.py  job\\n```\\n")
        ['core/a.py', 'b.py']
    """
    block = text.split("```", 2)[1]
    files, folders = [], []  # folders: (indent, name) of the folders open above the current line
    for line in block.splitlines():
        match = re.match(r"( *)(\S+)", line)
        if not match:
            continue
        indent, word = len(match.group(1)), match.group(2)
        folders = [(i, name) for i, name in folders if i < indent]
        if word.endswith("/"):
            folders.append((indent, word))
        elif word.endswith(".py"):
            files.append("".join(name for _, name in folders[1:]) + word)
    return files


def test_architecture_page_names_every_module_and_only_real_ones():
    named = architecture_files((ROOT / "docs" / "architecture.md").read_text())
    assert len(named) == len(set(named)), f"named twice: {sorted({f for f in named if named.count(f) > 1})}"
    real = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    missing = sorted(f for f in real - set(named) if not _is_package_marker(PACKAGE / f))
    assert not missing, ("docs/architecture.md does not name these module files (add one line each, with its "
                         f"job): {missing}")
    gone = sorted(set(named) - real)
    assert not gone, f"docs/architecture.md names files that do not exist: {gone}"


def test_the_core_imports_no_torch_at_module_level():
    for path in (PACKAGE / "core").rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module and not n.level]
        assert not [m for m in imported if m.split(".")[0] in ("torch", "lightning", "accelerate", "rich")], path


def test_every_module_is_at_most_400_lines():
    """Small modules with one job each: a module past 400 lines is two jobs (split it along its seam)."""
    long = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines: {long}"


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    """Lines of code of a function's body: its docstring, blank lines and comment lines not counted."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if not body:
        return 0
    text = lines[body[0].lineno - 1:function.end_lineno]
    return sum(1 for line in text if line.strip() and not line.strip().startswith("#"))


def test_code_line_counter_counts_only_code():
    source = 'def f(x):\n    """Doc.\n\n    More."""\n    # why\n\n    y = x\n    return y\n'
    function = ast.parse(source).body[0]
    assert _code_lines(function, source.splitlines()) == 2


def test_every_function_is_at_most_60_lines_of_code():
    """One job per function: past 60 lines of code it is several (name the parts)."""
    long = {}
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node, lines) > 60:
                long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = _code_lines(node, lines)
    assert not long, f"functions over 60 lines of code: {long}"


def test_every_public_class_and_function_has_an_example():
    # The guide's rule for what `import lightning_remat` offers. The errors are documented together, by the
    # errors module's example (each is a one-line class whose message its raiser writes).
    import inspect

    import lightning_remat
    from lightning_remat.core.errors import RematError

    missing = []
    for name in lightning_remat.__all__:
        value = getattr(lightning_remat, name)
        if inspect.isclass(value) and issubclass(value, RematError):
            continue
        if (inspect.isclass(value) or inspect.isfunction(value)) and ">>>" not in (inspect.getdoc(value) or ""):
            missing.append(name)
    assert not missing, f"public names without an example in their docstring: {missing}"
