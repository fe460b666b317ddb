"""Where offloading is offered (accelerator targets only: elsewhere the host is the device) and the link's cost."""

from __future__ import annotations

from typing import Any

import torch

from ...core.budget import Budget
from ...core.config import ProfileOptions
from ...core.errors import RematError
from ...core.memory_model import Profile
from ...core import hardware
from ...core.offload_model import with_offload_costs
from ..measuring.roofline import training_flops_per_second

_MEASURE_BYTES = 64 * 2**20


def check_offload_target(options: ProfileOptions, model_device: torch.device) -> None:
    """Raise ``RematError`` unless the profile targets an accelerator."""
    target = options.device if options.fake else str(model_device)
    if (options.fake and options.gpu is not None) or (target and torch.device(target).type == "cuda"):
        return
    where = f"device={options.device!r}" if options.fake else f"the model is on {model_device}"
    raise RematError(f"offload=True: offloading activations to host memory has nothing to gain without an "
                     f"accelerator target ({where}, and there the host is the device). Plan for a GPU on fake "
                     "tensors (fake=True, gpu='h100'), or profile a CUDA model")


def measured_bandwidth(device: torch.device) -> float:
    """The slower direction of a pinned host <-> device copy of 64 MiB, in bytes/s (CUDA only)."""
    host = torch.empty(_MEASURE_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(_MEASURE_BYTES, dtype=torch.uint8, device=device)
    seconds = []
    for copy in (lambda: dev.copy_(host, non_blocking=True), lambda: host.copy_(dev, non_blocking=True)):
        copy()  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return _MEASURE_BYTES / max(seconds)


def link_bandwidth(options: ProfileOptions, device: str) -> tuple[float, str]:
    """(bytes/s, where the figure comes from) of the target's host link."""
    if options.gpu is not None:
        return hardware.gpu(options.gpu).host_link_bandwidth, f"{options.gpu}'s data sheet"
    dev = torch.device(device)
    if not options.fake and dev.type == "cuda" and torch.cuda.is_available():
        return measured_bandwidth(dev), "measured here"
    match = hardware.match_gpu(torch.cuda.get_device_name(dev)) if dev.type == "cuda" and torch.cuda.is_available() else None
    if match is not None:
        return hardware.gpu(match).host_link_bandwidth, f"{match}'s data sheet"
    return hardware.gpu("h100").host_link_bandwidth, "assumed PCIe 5 (no GPU named)"


def hidden_limits(observed: Any, options: ProfileOptions, device: str, timed: bool) -> dict[str, int]:
    """Per stage but the last, the bytes the host link moves during the next stage's forward (``offload:hidden``)."""
    bandwidth, _ = link_bandwidth(options, device)
    rate = None if timed else training_flops_per_second(device, options.gpu)
    seconds = [observed.stats[n].seconds if timed else observed.stats[n].flops / rate for n in observed.order]
    limits = {n: int(bandwidth * s) for n, s in zip(observed.order, seconds[1:])}  # the next stage's seconds
    return {n: v for n, v in limits.items() if v > 0}


def price_offload(profile: Profile, options: ProfileOptions, device: str) -> Profile:
    """``profile`` with its offload options priced for the target's host link (and a note)."""
    bandwidth, source = link_bandwidth(options, device)
    return with_offload_costs(profile, bandwidth, training_flops_per_second(device, options.gpu)).noted(
        f"offload offered: host link {bandwidth / 1e9:.0f} GB/s ({source}); a stage's transfer is hidden behind "
        "the next stage's compute where it is shorter")


def host_limit_bytes(options: ProfileOptions) -> int:
    """The host memory offloading may use: ``host_memory``, a named GPU's share of a node, or this machine's free.

    >>> host_limit_bytes(ProfileOptions(fake=True, gpu="h100", host_memory="64GiB")) // 2**30
    64
    """
    if options.host_memory is not None:
        return int(Budget.parse(options.host_memory).nbytes)
    if options.fake and options.gpu is not None:
        return hardware.gpu(options.gpu).host_memory
    return host_free_bytes()


def host_free_bytes() -> int:
    """Host memory available now, by psutil (a dependency of Accelerate's)."""
    import psutil

    return int(psutil.virtual_memory().available)
