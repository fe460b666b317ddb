"""Re-run every command whose figures README and docs quote, record what each prints, and check the quotes.

``docs/figures.json`` holds, per command (``examples/train_gpt.py``, ``examples/plan_llama7b.py
--batch 4``, ...), the figures it printed when last run, and the sentences of README and docs that
quote them. This script runs each command again with ``--figures docs/figures.json`` (which rewrites
its figures), then checks every quote (``benchmarks/doc_figures.py``'s ``check_quotes``) and exits 1
when a quoted number is off beyond its tolerance: then edit the sentence to what the code prints
now. ``tests/test_docs_figures.py`` runs the same check on every test run, without re-running.

    python benchmarks/figures.py                         # every command (about 2 minutes on 2 CPU cores)
    python benchmarks/figures.py --only examples/batch_size.py
    python benchmarks/figures.py --check                 # only check the quotes against the recorded figures
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))
from doc_figures import check_quotes, load_figures  # noqa: E402

FIGURES = ROOT / "docs" / "figures.json"


def rerun(command: str) -> None:
    """Run ``command`` (a script and its arguments, from the repository root) with ``--figures``."""
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, *shlex.split(command), "--figures", str(FIGURES)], cwd=ROOT, env=env,
                   check=True, stdout=subprocess.DEVNULL)
    print(f"{command}: {time.perf_counter() - started:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=None, help="re-run only this command (repeatable)")
    parser.add_argument("--check", action="store_true", help="re-run nothing; check the quotes")
    args = parser.parse_args(argv)
    if not args.check:
        for command in args.only or sorted(load_figures(FIGURES)["figures"]):
            rerun(command)
    problems = check_quotes(ROOT, load_figures(FIGURES))
    for problem in problems:
        print(problem)
    print(f"{len(problems)} quoted figure(s) disagree with what the code prints" if problems
          else "every quoted figure agrees with what the code prints")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
