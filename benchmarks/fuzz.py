#!/usr/bin/env python
"""The long run of the invariants harness (issue 29; docs/invariants.md): generated cases through every
integration, a table of the invariants each (model, integration) broke, and each failure shrunk.

Pass 1 draws ``--examples`` cases per (model, integration) with Hypothesis (``tests/invariants``:
model x integration x 6-12 batch shapes x a budget between the least and the plain peak) and checks
every step of each: peak within the budget (or a ``RematError`` before the step), installed equal to
the plan in effect, losses equal to the run without the package, user hooks unaware of profiling,
no unjustified refusal, no crash. Pass 2 shrinks, per (model, integration) and per invariant broken
in pass 1, the smallest failing case to one that still breaks it (``tests/invariants/shrink.py``:
steps cut and dropped, the budget half-way, seed 0; at most ``--shrink-seconds`` each).

    python benchmarks/fuzz.py                                  # 4 cases per pair, every pair, shrunk
    python benchmarks/fuzz.py --examples 20 --model token cnn --integration lightning accelerate
    python benchmarks/fuzz.py --examples 2 --no-shrink         # a quick look

Writes ``benchmarks/results/fuzz.json`` and ``fuzz.md`` (``--out``, ``--name``); torch.profiler's C++
log lines (one per measured step) go to ``fuzz.stderr.log`` there.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from results_io import RESULTS, log, write_results  # noqa: E402

from tests.invariants.harness import INVARIANTS, Case, Outcome, integrations_for, run_case  # noqa: E402
from tests.invariants.runners import RUNNERS  # noqa: E402
from tests.invariants.shrink import breaks_later, shrink_case  # noqa: E402
from tests.invariants.strategies import cases, long  # noqa: E402
from tests.invariants.zoo import ZOO  # noqa: E402

_DONE: dict[Case, Outcome] = {}


def outcome_of(case: Case) -> Outcome:
    """``run_case``, once per case (Hypothesis replays the examples it reports)."""
    if case not in _DONE:
        try:
            _DONE[case] = run_case(case)
        except Exception as error:  # noqa: BLE001 - the harness's own failure: recorded, the run goes on
            log(f"harness error on {case.describe()}: {error!r}")
            _DONE[case] = Outcome(case, harness_error=repr(error)[:300])
    return _DONE[case]


def generate(model: str, integration: str, examples: int, seed: int) -> list[Outcome]:
    """Pass 1: ``examples`` cases of one pair, each run and checked."""
    seen: list[Outcome] = []

    @hypothesis_seed(seed)
    @settings(long(examples))
    @given(cases(model, integration))
    def draw(case: Case) -> None:
        outcome = outcome_of(case)
        seen.append(outcome)
        broken = ", ".join(outcome.broken) or "ok"
        log(f"  {case.describe()}: {broken} ({outcome.seconds:.0f} s, worst {outcome.worst_ratio():.3f}x)")

    draw()
    return seen


def shrink(seen: list[Outcome], invariant: str, seconds: float, later: bool) -> Outcome:
    """Pass 2: the smallest failing case of pass 1 for ``invariant`` (``later``: broken after the first
    step), shrunk (``tests/invariants/shrink.py``)."""
    failing = [o for o in seen if invariant in o.broken and (not later or breaks_later(o, invariant))]
    start = min(failing, key=lambda o: (len(o.case.shapes), o.case.fraction))
    return outcome_of(shrink_case(start.case, invariant, outcome_of, seconds, later))


def kinds(seen: list[Outcome]) -> list[tuple[str, bool]]:
    """The failures to shrink: each invariant broken, at the first step or only later (``later``)."""
    found = []
    for name in INVARIANTS:
        broken = [o for o in seen if name in o.broken]
        if any(any(v.invariant == name and not v.step for v in o.violations) for o in broken):
            found.append((name, False))
        if any(breaks_later(o, name) for o in broken):
            found.append((name, True))
    return found


def table(rows: list[dict], shrunk: list[dict]) -> str:
    head = ("| model | integration | cases | failing | " + " | ".join(INVARIANTS)
            + " | step 0 over budget | over budget, no warning | worst peak / budget | s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        counts = " | ".join(str(r["broken"].get(name, 0)) for name in INVARIANTS)
        lines.append(f"| {r['model']} | {r['integration']} | {r['cases']} | {r['failing']} | {counts} | "
                     f"{r['first_step_over']} | {r['silent']} | "
                     f"{r['worst']:.3f} | {r['seconds']:.0f} |")
    total, errors = sum(r["cases"] for r in rows), sum(len(r["harness_errors"]) for r in rows)
    lines.append(f"\n{total} cases, {sum(r['failing'] for r in rows)} failing"
                 + (f"; {errors} where the run without the package failed (the harness's)." if errors else "."))
    if shrunk:
        lines.append("\nShrunk failures (smallest case found per model x integration x invariant):\n")
        for s in shrunk:
            lines.append(f"- **{s['invariant']}**, {s['model']} x {s['integration']}: `{s['case']}`")
            lines += [f"  - {text}" for text in s["violations"][:4]]
            if s["invariant"].startswith("budget"):
                lines.append(f"  - the package warned: {s['warned'] or 'nothing'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=4, help="cases per (model, integration) (default 4)")
    parser.add_argument("--model", nargs="+", default=sorted(ZOO), choices=sorted(ZOO))
    parser.add_argument("--integration", nargs="+", default=list(RUNNERS), choices=list(RUNNERS))
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis's seed (the same cases for the same seed)")
    parser.add_argument("--shrink-seconds", type=float, default=240.0, help="time to shrink each failure (default 240)")
    parser.add_argument("--no-shrink", action="store_true", help="pass 1 only")
    parser.add_argument("--shrink-per", choices=("pair", "model", "invariant"), default="pair",
                        help="shrink each invariant once per (model, integration) (default), per model (at its first "
                             "failing integration) or once in all")
    parser.add_argument("--out", default=str(RESULTS), help="where the results go")
    parser.add_argument("--name", default="fuzz", help="the results' file stem (default fuzz: fuzz.json, fuzz.md)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # torch.profiler's C++ layer logs every start and stop on stderr: into a file.
    stderr = open(out / f"{args.name}.stderr.log", "w")  # noqa: SIM115 - open for the whole run
    os.dup2(stderr.fileno(), 2)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    pairs = [(m, i) for m in args.model for i in args.integration if i in integrations_for(m)]
    start, rows, shrunk, shrunk_for = time.perf_counter(), [], [], set()
    for model, integration in pairs:
        log(f"{model} x {integration}: {args.examples} case(s)")
        begun = time.perf_counter()
        seen = generate(model, integration, args.examples, args.seed)
        broken = {name: sum(name in o.broken for o in seen) for name in INVARIANTS}
        first_over = sum(any(v.invariant == "budget" and v.step == 0 for v in o.violations) for o in seen)
        rows.append(dict(model=model, integration=integration, cases=len(seen), failing=sum(bool(o.broken) for o in seen),
                         first_step_over=first_over, silent=sum(o.silent for o in seen),
                         broken={k: v for k, v in broken.items() if v}, seconds=time.perf_counter() - begun,
                         harness_errors=[o.harness_error for o in seen if o.harness_error],
                         worst=max((o.worst_ratio() for o in seen), default=0.0),
                         examples=[dict(case=o.case.describe(), violations=[str(v) for v in o.violations[:8]],
                                        warnings=o.warnings[:3]) for o in seen if o.broken]))
        for invariant, later in ([] if args.no_shrink else kinds(seen)):
            scope = {"pair": (model, integration), "model": (model,), "invariant": ()}[args.shrink_per]
            if (invariant, later, *scope) in shrunk_for:
                continue
            shrunk_for.add((invariant, later, *scope))
            label = f"{invariant} ({'a later step' if later else 'the first step or any'})"
            log(f"  shrinking {label} ...")
            small = shrink(seen, invariant, args.shrink_seconds, later)
            shrunk.append(dict(model=model, integration=integration, invariant=label, case=small.case.describe(),
                               violations=[str(v) for v in small.violations if v.invariant == invariant][:6],
                               warned=small.warnings[0][:200] if small.warnings else None))
            log(f"    {small.case.describe()}")
    results = dict(rows=rows, shrunk=shrunk, seconds=time.perf_counter() - start, examples=args.examples,
                   seed=args.seed, torch=torch.__version__)
    write_results(out, args.name, results, table(rows, shrunk) + f"\n\nRun time {results['seconds']:.0f} s.")


if __name__ == "__main__":
    main()
