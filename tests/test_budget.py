import math

import pytest
import torch

from lightning_remat import parse_budget
from lightning_remat.core.budget import device_total_memory, format_bytes


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
