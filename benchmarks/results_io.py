"""What the small benchmark scripts share: a timestamped log line, and writing a table and its JSON.

    from results_io import log, write_results
    write_results("benchmarks/results", "gpu_targets", results, table_text)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def log(text: str) -> None:
    """Print ``text`` after the wall-clock time, flushed (progress of a long run)."""
    print(time.strftime("%H:%M:%S"), text, flush=True)


def write_results(out: str | Path, stem: str, results: Any, table: str) -> None:
    """Print ``table``, and write it as ``out/stem.md`` beside ``results`` as ``out/stem.json``."""
    print(table)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (out / f"{stem}.md").write_text(table + "\n")
    print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.md'}")
