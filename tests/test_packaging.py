"""What pyproject.toml's extras promise: README's ``pip install -e '.[examples]'`` runs every example."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Local helpers the examples put on sys.path (examples/ itself and benchmarks/).
LOCAL_DIRS = (ROOT / "examples", ROOT / "benchmarks")


def _import_name(requirement: str) -> str:
    """``"jsonargparse[signatures]>=4"`` -> ``"jsonargparse"``: the distribution's top-level module."""
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].strip().lower().replace("-", "_")


def _imported_tops(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports, in functions too (lazy imports count)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _third_party(path: Path, seen: set[Path]) -> set[str]:
    """Third-party modules ``path`` needs, following the local helpers it imports."""
    seen.add(path)
    needed = set()
    for name in _imported_tops(path) - set(sys.stdlib_module_names) - {"lightning_remat"}:
        local = [d / f"{name}.py" for d in LOCAL_DIRS if (d / f"{name}.py").exists()]
        if local:
            needed |= set() if local[0] in seen else _third_party(local[0], seen)
        else:
            needed.add(name)
    return needed


def test_import_reader_follows_local_helpers_and_lazy_imports(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import json\ndef f():\n    from peft import LoraConfig\n    import doc_figures\n")
    assert _third_party(script, set()) == {"peft"}


def test_the_examples_extra_brings_every_import_of_every_example():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = {_import_name(r) for r in project["dependencies"] + project["optional-dependencies"]["examples"]}
    missing = {
        example.name: sorted(_third_party(example, set()) - installed)
        for example in sorted((ROOT / "examples").glob("*.py"))
    }
    assert {name: mods for name, mods in missing.items() if mods} == {}
