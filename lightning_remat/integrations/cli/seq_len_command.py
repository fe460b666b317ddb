"""``lightning-remat seq-len``: the longest sequence a factory's step fits in a budget (``find_remat_seq_len``);
the factory returns ``(model, make_step[, optimizer])``, ``make_step(seq_len)`` giving ``step(model) -> loss``."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import asdict
from typing import Any

from ...core.errors import BudgetTooSmallError
from .factory import UsageError
from .plan_command import EXIT_NO_PLAN, EXIT_OK, _config, _target, one_line_error


def add_seq_len_flags(parser: argparse.ArgumentParser) -> None:
    """The search's own flags (``find_remat_seq_len``'s arguments) and the output flag."""
    search = parser.add_argument_group("the search (find_remat_seq_len's arguments)")
    search.add_argument("--max-seq-len", type=int, default=2**20, help="the longest length searched. Default: 1048576")
    search.add_argument("--multiple-of", type=int, default=64, help="lengths searched are its multiples. Default: 64")
    search.add_argument("--init-val", type=int, default=None,
                        help="the first length profiled (then twice and four times it). Default: 16 x --multiple-of")
    search.add_argument("--max-overhead", type=float, default=None,
                        help="the largest recompute cost accepted, a share of a step. Default: any")
    search.add_argument("--max-profiles", type=int, default=12,
                        help="profiles at most (3 or more); then the answer is predicted from them. Default: 12")
    search.add_argument("--advice", action="store_true",
                        help="evaluate the knobs at the first length that does not fit (each re-profiles: slow)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON only")


def run_seq_len(args: argparse.Namespace) -> int:
    """The ``seq-len`` subcommand: search, then print the answer, what binds and the lengths profiled."""
    from ...service.seq_len import find_remat_seq_len

    config = _config(args)  # a malformed flag fails before anything heavy runs
    if config.budget.is_min:
        raise UsageError('--budget is required for seq-len: a size such as "80GB" or "80%" ("min" has no longest length)')
    target, _ = _target(args, lambda _: None)
    options = {k: v for k, v in asdict(config.profile).items() if k != "warmup"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = find_remat_seq_len(target.model, target.step, args.budget, optimizer=target.optimizer,
                                        init_val=args.init_val, max_seq_len=args.max_seq_len,
                                        multiple_of=args.multiple_of, max_overhead=args.max_overhead, cost=args.cost,
                                        max_profiles=args.max_profiles, advice=args.advice, apply=False, verbose=not args.json, **options)
        except BudgetTooSmallError as err:
            print(json.dumps({"error": str(err)}) if args.json else one_line_error(err),
                  file=sys.stdout if args.json else sys.stderr)
            return EXIT_NO_PLAN
        except (TypeError, ValueError) as err:
            raise UsageError(f"{type(err).__name__}: {err}") from err
    if args.json:
        print(json.dumps(_as_json(result), indent=1))
    else:
        print(result.summary())
    return EXIT_OK


def _as_json(result: Any) -> dict[str, Any]:
    return {"seq_len": result.seq_len, "first_failing": result.first_failing, "budget_bytes": result.budget_bytes,
            "predicted_peak_bytes": result.plan.predicted_peak_bytes, "predicted_overhead": result.predicted_overhead,
            "measured_peak_bytes": result.measured_peak_bytes, "binding": result.binding,
            "failing_binding": result.failing_binding, "failing_knobs": result.failing_knobs, "tried": [asdict(r) for r in result.tried],
            "plan": result.plan.to_dict(), "seconds": result.seconds, "notes": result.notes}
