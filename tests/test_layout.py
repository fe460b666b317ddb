"""The package's layers: the core imports no torch, and imports point down only
(core <- runtime <- report <- service <- integrations)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_remat"
LAYERS = ["core", "runtime", "report", "service", "integrations"]


def test_importing_the_core_loads_no_torch():
    code = ("import sys, lightning_remat, lightning_remat.core, lightning_remat.core.batch_fit; "
            "from lightning_remat import solve, parse_budget, Plan, RematConfig, RematError; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'lightning.', 'rich'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def _module_level_imports(path: Path) -> list[str]:
    """Absolute names of the package modules ``path`` imports at module level (not inside functions)."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name == "__init__.py":
        package += ".__init__"
    names = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: -node.level]
            names.append(".".join(base + ([node.module] if node.module else [])))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_remat"):
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.startswith("lightning_remat")]
    return names


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


@pytest.mark.parametrize("path", sorted(p for layer in LAYERS for p in (PACKAGE / layer).rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    own = LAYERS.index(path.relative_to(PACKAGE).parts[0])
    upward = [m for m in _module_level_imports(path) if (_layer(m) or 0) > own]
    assert not upward, f"{path.relative_to(PACKAGE)} imports from a higher layer: {upward}"


def test_the_core_imports_no_torch_at_module_level():
    for path in (PACKAGE / "core").rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module and not n.level]
        assert not [m for m in imported if m.split(".")[0] in ("torch", "lightning", "accelerate", "rich")], path
