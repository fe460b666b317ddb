"""Bounds of the settings every entry point takes: a typo (``world_size=10**30``) fails where it is read."""

from __future__ import annotations

from typing import Any

from .budget import Budget

# Bounds of the whole-number settings: far above any real use, low enough that a typo (10**20) fails at once.
MAX_WARMUP = 1_000
MAX_STEPS = 100_000  # profile_steps, accumulation_steps
MAX_WORLD_SIZE = 65_536
# The least device memory a target may have: below it not even a toy model's step fits (0 or "1KB": typos).
MIN_DEVICE_MEMORY = 2**20
# torch's device types, so that the core (no torch) refuses ``device="banana"`` as the setting it is.
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "hpu", "mtia", "meta", "xla", "lazy", "ipu", "hip", "ve", "fpga",
                "maia", "vulkan", "mkldnn", "opengl", "opencl", "ideep", "privateuseone", "npu")


def check_int(name: str, value: Any, low: int, high: int, why: str = "") -> int:
    """``value`` if it is an int from ``low`` to ``high``, else a ValueError naming ``name`` and ``why``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int >= {low} and <= {high}{why}, got {value!r}")
    return value


def check_device(device: Any) -> str | None:
    """A device's name (``"cuda"``, ``"cuda:1"``, a ``torch.device``) as text; None stays None."""
    if device is None:
        return None
    text = str(device).strip()
    kind, _, index = text.partition(":")
    if kind not in DEVICE_TYPES or (index and not (index.isdigit() and int(index) <= MAX_WORLD_SIZE)):
        raise ValueError(f"device must be a device type with an optional index, such as 'cuda' or 'cuda:1' (a type "
                         f"among {', '.join(DEVICE_TYPES)}), got {device!r}")
    return text


def check_device_memory(total: Any) -> Any:
    """A target device's total memory (a size of at least 1 MiB), returned as given; None stays None."""
    if total is None:
        return None
    try:
        nbytes = Budget.parse(total).nbytes
    except ValueError:
        nbytes = None
    if nbytes is None or nbytes < MIN_DEVICE_MEMORY:
        raise ValueError(f"device_memory must be a size of at least 1 MiB ({MIN_DEVICE_MEMORY} bytes): the target "
                         f"device's total memory, such as \"80GB\"; got {total!r}")
    return total
