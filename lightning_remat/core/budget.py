"""The memory budget (a whole step's peak, as ``torch.cuda.max_memory_allocated`` reports it), parsed once, and
byte counts formatted for people; torch is imported only to resolve a percentage."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

MIN_BUDGET = "min"
# The largest budget: what a signed 64-bit integer holds (torch's sizes, a plan's saved byte counts).
MAX_BUDGET_BYTES = 2**63 - 1

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_DECIMAL = ("kb", "mb", "gb", "tb")
# re.ASCII: "١٠GB" (Arabic-Indic digits) is not a budget, whatever float() makes of it.
_SIZE = re.compile(r"^\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)\s*$", re.IGNORECASE | re.ASCII)
_PERCENT = re.compile(r"^\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*%\s*$", re.ASCII)

ACCEPTED_FORMS = (
    'a size such as "10GB", "10 GiB", "512MB", "1.5gb" (decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB), '
    'a positive int of bytes, a percentage of the device\'s total memory such as "80%", '
    'or "min" for the plan of least peak memory'
)


def _reject(value: Any, why: str) -> ValueError:
    return ValueError(f"Invalid memory budget {value!r}: {why}. Accepted: {ACCEPTED_FORMS}.")


def device_total_memory(device: Any = None) -> int:
    """Total memory in bytes of ``device`` (a CUDA/XPU/MPS device, or the host for "cpu")."""
    import torch

    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "xpu":
        return int(torch.xpu.get_device_properties(device).total_memory)
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory())
    # The CPU's "device memory" is the host's physical memory.
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _is_here(device: Any) -> bool:
    """Whether ``device`` is on this machine (planning for a CUDA device from a CPU machine is not)."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return True
    backend = getattr(torch, device.type, None)
    return bool(backend is not None and hasattr(backend, "is_available") and backend.is_available())


@dataclass(frozen=True)
class Budget:
    """A budget as the user gave it (``text``): ``parse`` checks the form, ``resolve`` gives bytes on a device.

    Example:
        >>> b = Budget.parse("10GB")
        >>> b.text, b.nbytes, b.is_min, b.resolve()
        ('10GB', 10000000000, False, 10000000000)
    """

    text: str
    nbytes: int | None = None
    fraction: float | None = None

    @property
    def is_min(self) -> bool:
        return self.nbytes is None and self.fraction is None

    @classmethod
    def parse(cls, value: Any) -> "Budget":
        """Check the form of ``value`` (see ``parse_budget``); a ``Budget`` passes through."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool) or value is None:
            raise _reject(value, f"{type(value).__name__} is not a budget")
        if isinstance(value, int):
            if value <= 0 or value > MAX_BUDGET_BYTES:
                raise _reject(value, "a budget must be a positive number of bytes, at most 2**63 - 1")
            return cls(str(value), nbytes=value)
        if isinstance(value, float):
            if not math.isfinite(value) or value <= 0 or not value.is_integer() or value > MAX_BUDGET_BYTES:
                raise _reject(value, "a float budget must be a positive whole number of bytes, at most 2**63 - 1")
            return cls(str(value), nbytes=int(value))
        if not isinstance(value, str):
            raise _reject(value, f"a {type(value).__name__} is not a budget")
        text = value.strip()
        if text.lower() == MIN_BUDGET:
            return cls(text)
        percent = _PERCENT.match(text)
        if percent:
            fraction = float(percent.group("number")) / 100
            if not 0 < fraction <= 1:
                raise _reject(value, "a percentage must be above 0% and at most 100%")
            return cls(text, fraction=fraction)
        size = _SIZE.match(text)
        if not size:
            raise _reject(value, "it is not a size, a percentage or \"min\"")
        unit = size.group("unit").lower()
        if unit not in _UNITS:
            raise _reject(value, f"unknown unit {size.group('unit')!r}")
        number = float(size.group("number"))
        if unit in ("", "b") and not number.is_integer():
            raise _reject(value, "a number of bytes must be whole")
        if not math.isfinite(number * _UNITS[unit]) or number * _UNITS[unit] > MAX_BUDGET_BYTES:
            raise _reject(value, "the number is too large (at most 2**63 - 1 bytes)")
        nbytes = int(number * _UNITS[unit])
        if nbytes <= 0:
            raise _reject(value, "a budget must be positive")
        return cls(text, nbytes=nbytes)

    @property
    def decimal(self) -> bool:
        """Whether the budget was given in decimal units (kB, MB, GB, TB)."""
        size = _SIZE.match(self.text)
        return bool(size) and size.group("unit").lower() in _DECIMAL

    def format(self, nbytes: int) -> str:
        """``nbytes`` in the units the budget was given in: decimal next to the exact bytes, else binary."""
        if self.decimal:
            return f"{format_bytes(nbytes, decimal=True)} = {int(nbytes)} bytes"
        return format_bytes(nbytes)

    def resolve(self, device: Any = None, total_memory: Any = None) -> int | str:
        """Bytes on ``device`` (or a device of ``total_memory``), or ``"min"``; ValueError above its memory."""
        if self.is_min:
            return MIN_BUDGET
        total = None if total_memory is None else Budget.parse(total_memory).nbytes
        if total_memory is not None and total is None:
            raise ValueError(f"Invalid device memory {total_memory!r}: give a size such as \"80GB\"")
        named = repr(total_memory)
        if total is None and device is not None and _is_here(device):
            total, named = device_total_memory(device), f"of {device}"
        if self.fraction is not None:
            return int(self.fraction * (total if total is not None else device_total_memory(device)))
        assert self.nbytes is not None
        if total is not None and self.nbytes > total:
            raise ValueError(f"The memory budget {self.text!r} ({self.nbytes} bytes) is larger than the device's "
                             f"memory {named} ({total} bytes)")
        return self.nbytes


def parse_budget(value: Any, device: Any = None, total_memory: Any = None) -> int | str:
    """A user's budget (``ACCEPTED_FORMS``) as bytes, or ``"min"``; ``ValueError`` for any other value or one
    above the memory of ``device`` (default: the host) or ``total_memory`` (a device that is not here).

    Example:
        >>> parse_budget("10GB"), parse_budget("1 GiB"), parse_budget(512), parse_budget("MIN")
        (10000000000, 1073741824, 512, 'min')
    """
    return Budget.parse(value).resolve(device=device, total_memory=total_memory)


def format_in_units_of(text: Any, nbytes: float) -> str:
    """``nbytes`` in the units of the budget ``text``: decimal when it was given in kB/MB/GB/TB, else binary.

    Example:
        >>> format_in_units_of("200MB", 207_090_000), format_in_units_of("1GiB", 2**20), format_in_units_of(None, 2**20)
        ('207.09 MB', '1.00 MiB', '1.00 MiB')
    """
    try:
        decimal = isinstance(text, str) and Budget.parse(text).decimal
    except ValueError:
        decimal = False
    return format_bytes(nbytes, decimal=decimal)


def format_budget(text: str, nbytes: int) -> str:
    """``nbytes`` in the units of the budget ``text`` (``Budget.format``); binary when ``text`` is not a budget."""
    try:
        return Budget.parse(text).format(nbytes)
    except ValueError:
        return format_bytes(nbytes)


def format_bytes(nbytes: float, decimal: bool = False) -> str:
    """Bytes as a short human-readable string in binary units (decimal kB/MB/GB/TB with ``decimal``).

    Example:
        >>> format_bytes(1536), format_bytes(3 * 2**30), format_bytes(60 * 10**6, decimal=True)
        ('1.50 KiB', '3.00 GiB', '60.00 MB')
    """
    sign = "-" if nbytes < 0 else ""
    nbytes = abs(float(nbytes))
    step, units = (1000, ("B", "kB", "MB", "GB", "TB")) if decimal else (1024, ("B", "KiB", "MiB", "GiB"))
    for unit in units:
        if nbytes < step or unit == units[-1]:
            return f"{sign}{nbytes:.0f} B" if unit == "B" else f"{sign}{nbytes:.2f} {unit}"
        nbytes /= step
    raise AssertionError("unreachable")
