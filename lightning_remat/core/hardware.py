"""The GPUs the package knows (data-sheet FLOP/s, memory and host-link bandwidth), and a lookup by name."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

# Training rarely reaches the data sheet: seconds priced from FLOPs are FLOPs / (peak * this).
TRAINING_EFFICIENCY = 0.4

# The CPU's roofline ceilings, fixed: the same plan on every machine (only their ratio matters: docs/roofline.md).
CPU_FLOPS = 200e9
CPU_MEMORY_BANDWIDTH = 30e9


@dataclass(frozen=True)
class GpuSpec:
    """The data-sheet figures of one GPU model (SXM where there are SXM and PCIe forms).

    Attributes:
        peak_flops: dense tensor-core FLOP/s per dtype name ("bf16", "fp16"; "fp16" only without bfloat16).
        host_link_bandwidth: effective host <-> device bandwidth, bytes/s, one direction.
        host_memory: host memory per GPU of a typical node with it, bytes (fake planning's default ``host_memory``).
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    host_link_bandwidth: float
    host_memory: int

    def flops(self, dtype: str | None = None) -> float:
        """Peak dense FLOP/s for ``dtype`` ("bf16", "fp16"); None: the 16-bit figure the GPU has."""
        if dtype is None:
            return max(self.peak_flops.values())
        if dtype not in self.peak_flops:
            raise ValueError(f"no {dtype} FLOP/s known for GPU {self.name!r}; known: {', '.join(sorted(self.peak_flops))}")
        return self.peak_flops[dtype]


def _spec(name: str, flops_16bit: float, memory_bandwidth: float, host_link: float, host_gib: int,
          bf16: bool = True) -> GpuSpec:
    dtypes = {"bf16": flops_16bit, "fp16": flops_16bit} if bf16 else {"fp16": flops_16bit}
    return GpuSpec(name, MappingProxyType(dtypes), memory_bandwidth, host_link, host_gib * 2**30)


GPUS: Mapping[str, GpuSpec] = MappingProxyType({spec.name: spec for spec in (
    #     name      FLOP/s   memory B/s host link B/s  host GiB
    _spec("gh200", 989e12, 4.0e12, 400e9, 447),
    _spec("h200", 989e12, 4.8e12, 50e9, 256),
    _spec("h100", 989e12, 3.35e12, 50e9, 256),
    _spec("h100-pcie", 756e12, 2.0e12, 50e9, 128),
    _spec("b200", 2250e12, 8.0e12, 50e9, 512),
    _spec("a100", 312e12, 2.039e12, 25e9, 128),
    _spec("a10g", 70e12, 0.6e12, 25e9, 96),
    _spec("a10", 125e12, 0.6e12, 25e9, 64),
    _spec("l40s", 362e12, 0.864e12, 25e9, 128),
    _spec("l4", 121e12, 0.3e12, 25e9, 96),
    _spec("v100", 125e12, 0.9e12, 12e9, 64, bf16=False),
    _spec("t4", 65e12, 0.32e12, 12e9, 48, bf16=False),
    _spec("rtx4090", 165e12, 1.008e12, 25e9, 64),
    _spec("rtx3090", 71e12, 0.936e12, 25e9, 64),
    _spec("mi300x", 1307e12, 5.3e12, 50e9, 256),
)})


def gpu(name: str) -> GpuSpec:
    """The figures of a GPU named by its table key, case-insensitive ("H100", "a100", "h100-pcie")."""
    key = name.strip().lower()
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}")
    return GPUS[key]


def match_gpu(device_name: str) -> str | None:
    """The table key a device's name contains (spaces and case ignored, the longest key first), or None."""
    lowered = device_name.lower().replace(" ", "")
    for key in sorted(GPUS, key=len, reverse=True):
        if key.replace("-", "") in lowered:
            return key
    return None
