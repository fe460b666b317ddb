"""The ``lightning-remat`` command line: where does my memory go, and what would a budget cost?

    lightning-remat plan examples/factories.py:gpt2 --budget 200MB
    lightning-remat plan train.py:make_model --budget 80% --cost flops --out report/
    lightning-remat plan train.py:make_model --budget min --json > plan.json
    lightning-remat plan train.py:make_model --budget 1GB --candidates GPT2Block --policies save_matmuls --cost roofline
    lightning-remat plan examples/factories.py:llama7b --fake --device cuda --device-memory 80GB --budget 90% --gpu h100
    lightning-remat plan examples/factories.py:llama7b --fake --gpu h100 --device-memory 80GB --world-size 8
    lightning-remat seq-len examples/factories.py:llama_lengths --budget 8MB --multiple-of 32

``FILE.py:FACTORY`` names a function in a Python file that takes no arguments and returns one of

- ``(model, step)``: ``step(model)`` runs a forward pass on a representative batch and returns the
  scalar loss (the command runs backward itself);
- ``(model, step, optimizer)``: the optimizer's state counts in the budget (Adam: two tensors the
  size of each parameter, counted before its first step too);
- ``(lightning_module, batch)``: the step is ``lightning_module.training_step(batch, 0)`` (its
  loss, or ``["loss"]`` of the dict it returns); the optimizer from ``configure_optimizers()``.

The command profiles one training step, prints where the memory goes (parameters, gradients,
optimizer state, activations, temporaries, the blocks that save the most), the least-cost plan
within ``--budget`` and a table of budgets from the least reachable peak to no recomputation, and
writes plots (memory over one step before and after the plan, peak against overhead) and the plan
as JSON to ``--out``.

The budget is the peak memory of a whole training step, in the forms of ``parse_budget``: "10GB",
"512MiB", a number of bytes, "min", or a percentage, which is a percentage of the device's total
memory (for a model on the CPU, the host's RAM), as everywhere in lightning-remat.

Exit codes: 0 success; 1 the budget cannot be met (the smallest reachable peak is printed) or the
step failed while profiling; 2 bad input, whatever it is (a missing file or factory, a factory that
raises or returns something else, a malformed budget, device, GPU or any other flag's value, a
candidate that matches no module).
Errors are one line on stderr: "lightning-remat: error: ...".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from .factory import UsageError
from .commands import (EXIT_NO_PLAN, EXIT_OK, EXIT_USAGE, ProfilingFailed,  # noqa: F401 - exit codes are public
                       one_line_error, run_plan, run_seq_len)


# The command line plans the least peak unless told otherwise; every other default is the field's.
_CLI_DEFAULTS = {"budget": "min"}


def _help(text: str, default: Any) -> str:
    """A field's help for ``--help``, with its default (argparse's ``%`` escaped)."""
    if default is True:
        text += ". Default: on"
    elif default not in (None, False, ()):
        text += f". Default: {default}"
    return text.replace("%", "%%")


def _subcommand(sub: Any, name: str, target_help: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand taking ``FILE.py:FACTORY`` and every field of ``RematConfig`` and ``ProfileOptions`` as a flag."""
    from dataclasses import fields

    from ...core.config import ProfileOptions, RematConfig

    parser = sub.add_parser(name, **kwargs)
    parser.add_argument("target", metavar="FILE.py:FACTORY", help=target_help)
    settings = parser.add_argument_group(
        "what to plan for (the fields of RematConfig and ProfileOptions: plan_remat's arguments, same names)")
    target = parser.add_argument_group(
        "planning without the hardware",
        "profile on fake tensors (no memory, nothing real runs): a model larger than this machine, a GPU not here")
    for cls in (RematConfig, ProfileOptions):
        for f in fields(cls):
            if f.type == "ProfileOptions" or f.name == "profile":
                continue
            default = _CLI_DEFAULTS.get(f.name, f.default)
            group = target if f.metadata.get("group") == "target" else settings
            flag: dict[str, Any] = {"dest": f.name, "help": _help(f.metadata["help"], default)}
            if isinstance(default, bool):
                flag.update(action=argparse.BooleanOptionalAction if default else "store_true", default=default)
            else:
                flag["default"] = default
                if isinstance(default, int):
                    flag["type"] = int
                if "choices" in f.metadata:
                    flag["choices"] = f.metadata["choices"]
                elif "parse" in f.metadata:
                    flag["metavar"] = "A,B,..."
            group.add_argument("--" + f.name.replace("_", "-"), **flag)
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-remat",
        description="Plan activation recomputation (gradient checkpointing) to fit a training step in a memory budget.")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = _subcommand(
        sub, "plan", "a function returning (model, step), (model, step, optimizer) or (lightning_module, batch)",
        help="profile a training step, show where memory goes and the least-cost plan within a budget",
        # The module text, unwrapped: argparse would re-flow its lists.
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None, formatter_class=argparse.RawDescriptionHelpFormatter)
    output = plan.add_argument_group("output")
    output.add_argument("--out", type=Path, default=Path("remat-report"),
                        help="folder for the plots and plan.json. Default: ./remat-report")
    output.add_argument("--no-plots", action="store_true", help="write no files")
    output.add_argument("--points", type=int, default=10,
                        help="budgets in the table from least peak to baseline. Default: 10")
    output.add_argument("--top", type=int, default=10, help="blocks to list by saved activation bytes. Default: 10")
    output.add_argument("--json", action="store_true", help="print machine-readable JSON only (no tables, no progress)")
    seq_len = _subcommand(
        sub, "seq-len", "a function returning (model, make_step[, optimizer])",
        help="search the longest sequence whose training step fits a budget (find_remat_seq_len)",
        description="Search the longest sequence (tokens per sequence) whose training step fits --budget with optimal "
                    "recomputation, offload and chunking; print it, what binds there and at the first length that "
                    "does not fit, and the lengths profiled. FACTORY returns (model, make_step) or (model, make_step, "
                    "optimizer), make_step(seq_len) giving step(model) -> loss.")
    search = seq_len.add_argument_group("the search (find_remat_seq_len's arguments)")
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
    seq_len.add_argument("--json", action="store_true", help="print machine-readable JSON only")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-remat``; returns the exit code (0 ok, 1 no plan fits, 2 usage error)."""
    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        run = run_seq_len if args.command == "seq-len" else run_plan
        return run(args)
    except UsageError as err:
        print(one_line_error(err), file=sys.stderr)
        return EXIT_USAGE
    except ProfilingFailed as err:
        print(one_line_error(err), file=sys.stderr)
        return EXIT_NO_PLAN
    except KeyboardInterrupt:
        print("lightning-remat: interrupted", file=sys.stderr)
        return 130
