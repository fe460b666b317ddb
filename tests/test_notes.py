"""What a user reads of a plan: notes as whole sentences with advice only where it changes something, never cut
when shown, and tables written to a file (not a terminal) with every row on one line."""

from __future__ import annotations

import io
import re

import pytest
import torch
from torch import nn

from lightning_remat import plan_remat
from lightning_remat.core.memory_model import Profile, Segment, StageOption, StageProfile
from lightning_remat.core.plan import Plan, StageAction
from lightning_remat.core.allowances import ACCELERATE_LOOP_ALLOWANCE as LOOP_ALLOWANCE
from lightning_remat.integrations.accelerate.recorded_call import with_loop_references


@pytest.mark.parametrize("held, carried", [(0, 0), (4096, 0), (0, 6144), (4096, 6144)])
def test_the_loop_note_is_one_sentence_whatever_the_loop_holds(held, carried):
    keep = StageOption("keep", StageAction("a"), 10, 100)
    profile = Profile((StageProfile("a", (keep,)),), (Segment("head", 1, 50),))
    (note,) = with_loop_references(profile, held, carried).notes
    assert note.startswith("the training loop holds "), note  # it began "and the loss ..." without outputs held
    assert " and and " not in note and "  " not in note
    assert f"the loss ({LOOP_ALLOWANCE} bytes allowed) through the step" in note
    assert ("outputs" in note) == bool(held) and ("more from one micro-batch" in note) == (carried > held)


def _fake_plan_notes(cost: str, gpu: str | None = None) -> tuple[str, ...]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(2)])
    x = torch.randn(4, 16)
    return plan_remat(model, lambda m: m(x).sum(), budget="min", fake=True, cost=cost, gpu=gpu).notes


def test_a_fake_profile_advises_naming_the_gpu_only_where_it_changes_the_costs():
    flops = _fake_plan_notes("flops")
    assert not any("cost=" in n or "FLOPs only" in n for n in flops), flops  # it said "use cost='flops'"
    roofline = _fake_plan_notes("roofline")
    assert sum("pass gpu=" in n for n in roofline) == 1, roofline  # priced for a nominal CPU
    assert not any("gpu=" in n for n in _fake_plan_notes("roofline", gpu="h100"))


def test_the_rich_summary_shows_a_long_note_whole():
    from rich.console import Console

    from lightning_remat.report.render import print_plan, to_text, plan_renderables

    note = " ".join(f"word{k}" for k in range(80)) + " (the end of the note)"
    plan = Plan([StageAction.recompute("h.0")], budget_bytes=2**30, baseline_peak_bytes=2**31,
                predicted_peak_bytes=2**30 - 1, predicted_overhead=0.1, notes=(note,))
    out = io.StringIO()
    print_plan(plan, console=Console(file=out, color_system=None))
    for text in (out.getvalue(), to_text(plan_renderables(plan)), plan.summary()):
        assert f"note: {note}" in re.sub(r"\s+", " ", text)


def _file_console():
    from rich.console import Console

    out = io.StringIO()  # not a terminal: a file or a pipe, as `python train.py > log.txt` gives
    return out, Console(file=out, color_system=None)


def test_a_plan_printed_to_a_file_keeps_every_line_and_row_whole():
    from lightning_remat.core.plan_text import plan_headline
    from lightning_remat.report.render import print_plan

    long_name = "model.decoder.layers.11.self_attention.query_key_value_projection_with_a_long_name"
    plan = Plan([StageAction.recompute(long_name)], budget_bytes=60 * 10**6, baseline_peak_bytes=2**31,
                predicted_peak_bytes=2**25, predicted_overhead=0.174, requested_budget="60MB")
    out, console = _file_console()
    print_plan(plan, title="AutoRemat plan: the step of a model with a long name", console=console)
    lines = out.getvalue().splitlines()
    headline = plan_headline(plan, "AutoRemat plan: the step of a model with a long name")
    assert len(headline) > 120 and headline in [line.rstrip() for line in lines]  # it wrapped at 120: "overhead\n17.4%"
    assert any(long_name in line and "whole" in line for line in lines)


def test_a_table_title_is_one_line_whatever_the_table_is_narrow():
    from types import SimpleNamespace

    from lightning_remat.report.render import pareto_table, print_renderables, to_text

    point = SimpleNamespace(budget_bytes=2**20, predicted_peak_bytes=2**20, predicted_overhead=0.0, modules=0,
                            feasible=True)
    title = "Budgets from the least reachable peak to no recomputation (predicted, cost: flops)"
    out, console = _file_console()
    print_renderables([pareto_table([point], None, "flops")], console)
    for text in (out.getvalue(), to_text([pareto_table([point], None, "flops")], width=60)):
        assert title in text.splitlines()[0], text  # it wrapped at the table's width, after "recomputation"
