import math

import pytest
import torch

from lightning_remat import parse_budget
from lightning_remat.core.budget import Budget, device_total_memory, format_budget, format_bytes


@pytest.mark.parametrize(
    "value, expected",
    [
        ("10GB", 10 * 10**9),
        ("10 GiB", 10 * 2**30),
        ("512mb", 512 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1.5gb", 1_500_000_000),
        ("  2 g ", 2 * 2**30),
        ("100", 100),
        (4096, 4096),
        (4096.0, 4096),
        ("MIN", "min"),
        ("min", "min"),
    ],
)
def test_accepted_forms(value, expected):
    assert parse_budget(value) == expected


def test_percentage_of_device_memory():
    total = device_total_memory("cpu")
    assert parse_budget("80%", device="cpu") == int(0.8 * total)
    assert parse_budget("100%") == total


@pytest.mark.parametrize(
    "value",
    [-1, 0, "0GB", "-5GB", "ten", "10XB", None, math.nan, math.inf, True, False, "", "GB", "150%", "0%",
     "10 G B", [10], 1.5, "min budget"],
)
def test_rejected_forms_name_the_value_and_the_accepted_forms(value):
    with pytest.raises(ValueError) as err:
        parse_budget(value)
    message = str(err.value)
    assert repr(value) in message
    assert "Accepted:" in message and '"min"' in message


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(2**20) == "1.00 MiB"
    assert format_bytes(-3 * 2**30) == "-3.00 GiB"


def test_a_budget_is_shown_in_the_units_it_was_given_and_decimal_next_to_its_bytes():
    # "60MB" was shown as 57.22 MiB and "10GB" as 9.31 GiB.
    assert format_bytes(60 * 10**6, decimal=True) == "60.00 MB" and format_bytes(999, decimal=True) == "999 B"
    assert Budget.parse("60MB").format(60 * 10**6) == "60.00 MB = 60000000 bytes"
    assert Budget.parse("10 gb").format(10**10) == "10.00 GB = 10000000000 bytes"
    assert Budget.parse("10GiB").format(10 * 2**30) == "10.00 GiB"  # binary in, binary out
    assert [Budget.parse(b).format(2**20) for b in ("80%", "min", 4096, "4096")] == ["1.00 MiB"] * 4
    assert format_budget("not a budget", 2**20) == "1.00 MiB"


def test_the_plan_summary_shows_a_decimal_budget_in_decimal_and_logs_bytes():
    from lightning_remat.core.memory_model import Costs, Profile, Segment, StageAction, StageOption, StageProfile
    from lightning_remat.core.solve import solve
    from lightning_remat.report.render import plan_renderables, to_text
    from lightning_remat.service.run import plan_metrics

    keep = StageOption("keep", StageAction("a"), 10**6, 2 * 10**6)
    whole = StageOption("whole", StageAction.recompute("a"), 0, 2 * 10**6, Costs(1.0, 5))
    profile = Profile((StageProfile("a", (keep, whole)),), (Segment("head", 1, 3 * 10**6),), baseline_peak_bytes=4 * 10**6)
    for budget, shown, peak in (("60MB", "budget 60.00 MB = 60000000 bytes,", "predicted peak 4.00 MB"),
                                ("10GiB", "budget 10.00 GiB,", "predicted peak 3.81 MiB")):
        plan = solve(profile, budget, cost="flops")
        headline = plan.summary().splitlines()[0]
        assert shown in headline and shown in to_text(plan_renderables(plan), width=400)
        assert peak in headline  # every size of the line in the budget's units: decimal in, decimal out
    assert plan_metrics(plan)["remat/budget_bytes"] == 10 * 2**30  # the figures logged stay bytes


def test_the_measured_line_and_the_over_budget_warning_speak_the_budgets_units():
    from lightning_remat.core.plan import Plan
    from lightning_remat.service.run import over_budget
    from lightning_remat.service.run import _figure

    plan = Plan([], budget_bytes=60 * 10**6, predicted_peak_bytes=59 * 10**6, requested_budget="60MB")
    assert over_budget(61 * 10**6, plan).startswith("lightning-remat: a training step peaked at 61.00 MB (61000000 bytes)"
                                                    ", above the budget of 60.00 MB (60000000 bytes; predicted 59.00 MB)")
    assert _figure(59 * 10**6, None, "60MB") == "59.00 MB" and _figure(2**20, None, "1GiB") == "1.00 MiB"



@pytest.mark.parametrize("value", ["١٠GB", "1.9", "9" * 400, "9" * 400 + "GB", "1e3GB"])
def test_unicode_digits_fractional_bytes_and_huge_numbers_are_rejected_as_budgets(value):
    with pytest.raises(ValueError, match="Accepted:"):
        parse_budget(value)


def test_a_budget_above_the_device_is_an_error_where_the_device_is_known():
    assert parse_budget("10TB") == 10**13  # no device named: the form alone is checked
    with pytest.raises(ValueError, match="larger than the device's memory of cpu"):
        parse_budget("10TB", device="cpu")
    with pytest.raises(ValueError, match="larger than the device's memory '80GB'"):
        parse_budget("100GB", device="cuda", total_memory="80GB")
    # A device that is not here (planning for a GPU from a CPU machine) is not checked without its size.
    assert parse_budget("100GB", device="cuda") == 10**11 or torch.cuda.is_available()
