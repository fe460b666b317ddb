"""Figures README and docs quote, recorded by the scripts that print them, and checked against the text.

Each quote is a sentence with ``{name}`` where the figure stands; ``check_quotes`` compares the number
written with the recorded one, within the quote's tolerance (default 0.5%) plus half a last digit.

Example:
    >>> import json, tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (root / "README.md").write_text("a step from 340.17 MiB\\nto 207.06 MiB measured")
    >>> record_figures(root / "figures.json", "examples/train_gpt.py", {"before": 340.1712, "after": 207.0581})
    >>> data = json.loads((root / "figures.json").read_text())
    >>> data["quotes"] = [{"file": "README.md", "command": "examples/train_gpt.py",
    ...                    "text": "a step from {before} MiB to {after} MiB measured"}]
    >>> check_quotes(root, data)
    []
    >>> data["figures"]["examples/train_gpt.py"]["values"]["after"] = 210.08
    >>> check_quotes(root, data)
    ['README.md: after is 207.06 in the text, 210.08 recorded by examples/train_gpt.py (tolerance 0.5%)']
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DEFAULT_TOLERANCE = 0.005
_PLACEHOLDER = re.compile(r"\{(\w+)\}")
_NUMBER = r"(-?[0-9][0-9,]*(?:\.[0-9]+)?)"


def figures_key(script: str, argv: list[str]) -> str:
    """The key a script's figures are recorded under: its path and arguments without ``--figures PATH``.

    Example:
        >>> figures_key("examples/plan_llama7b.py", ["--batch", "4", "--figures", "docs/figures.json"])
        'examples/plan_llama7b.py --batch 4'
    """
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--figures":
            skip = True
        elif not arg.startswith("--figures="):
            kept.append(arg)
    return " ".join([script, *kept])


def record_figures(path: str | Path, command: str, values: dict[str, float]) -> None:
    """Record ``values`` (as printed, before rounding) under ``command`` in the JSON file ``path``.

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "figures.json"
        >>> record_figures(path, "examples/batch_size.py", {"batch": 27})
        >>> load_figures(path)["figures"]["examples/batch_size.py"]["values"]
        {'batch': 27}
    """
    path = Path(path)
    data = load_figures(path) if path.exists() else {"figures": {}, "quotes": []}
    data["figures"][command] = {"values": dict(values)}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def load_figures(path: str | Path) -> dict[str, Any]:
    """The figures file: ``{"figures": {command: {"values": {...}}}, "quotes": [...]}``."""
    return json.loads(Path(path).read_text())


def _squash(text: str) -> str:
    return " ".join(text.split())


def _pattern(text: str) -> tuple[re.Pattern, list[str]]:
    """A quote's sentence as a regular expression, one number captured per placeholder."""
    parts = _PLACEHOLDER.split(_squash(text))
    names = parts[1::2]
    literal = [re.escape(p).replace(r"\ ", r"\s+") for p in parts[0::2]]
    body = "".join(lit + (_NUMBER if k < len(names) else "") for k, lit in enumerate(literal))
    return re.compile(body), names


def _within(written: str, recorded: float, tolerance: float) -> bool:
    decimals = len(written.split(".")[1]) if "." in written else 0
    slack = 0.5 * 10 ** -decimals + tolerance * abs(recorded)
    return abs(float(written.replace(",", "")) - recorded) <= slack + 1e-12


def check_quotes(root: str | Path, data: dict[str, Any]) -> list[str]:
    """Every quote of ``data`` checked in the files under ``root``: the problems found (example above)."""
    problems: list[str] = []
    for quote in data.get("quotes", []):
        file, command = quote["file"], quote["command"]
        values = data["figures"].get(command, {}).get("values")
        if values is None:
            problems.append(f"{file}: no figures recorded by {command}")
            continue
        pattern, names = _pattern(quote["text"])
        found = pattern.search(_squash((Path(root) / file).read_text()))
        if found is None:
            problems.append(f"{file}: not found: {quote['text']!r}")
            continue
        tolerances = quote.get("tolerance", {})  # name -> relative tolerance, where one is stated
        for name, written in zip(names, found.groups()):
            tolerance = tolerances.get(name, DEFAULT_TOLERANCE)
            if name not in values:
                problems.append(f"{file}: {name} is not a figure of {command}")
            elif not _within(written, values[name], tolerance):
                problems.append(f"{file}: {name} is {written} in the text, {values[name]} recorded by {command} "
                                f"(tolerance {tolerance:.1%})")
    return problems
