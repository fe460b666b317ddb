"""Roofline costs: per op, ``max(FLOPs / peak FLOP/s, bytes / bandwidth)``, so memory-bound ops are not free."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from ..installing.sac import context_fn, recomputed_ops  # its import registers attention FLOPs
from ...core import hardware
from ...core.memory_model import Costs


@dataclass(frozen=True)
class Peaks:
    """A device's ceilings: FLOP/s and bytes/s."""

    flops_per_second: float
    bytes_per_second: float


@dataclass(frozen=True)
class OpCost:
    """One op of a recorded pass: the op, its FLOPs and the bytes it reads and writes."""

    func: Any
    flops: int
    bytes: int


def roofline_seconds(ops: Iterable[OpCost], peaks: Peaks) -> float:
    return float(sum(max(op.flops / peaks.flops_per_second, op.bytes / peaks.bytes_per_second) for op in ops))


def device_peaks(device: str, gpu: str | None = None) -> Peaks:
    """The ceilings to price a profile for ``device`` (``target_gpu``): the CPU's fixed (``core.hardware``) so a
    profile prices the same in every process; a known GPU's data sheet; a GPU of unknown name (or another device)
    priced as an H100."""
    kind, key, _ = target_gpu(device, gpu)
    if kind == "cpu":
        return Peaks(hardware.CPU_FLOPS, hardware.CPU_MEMORY_BANDWIDTH)
    spec = hardware.gpu(key or "h100")
    return Peaks(spec.flops(), spec.memory_bandwidth)


def training_flops_per_second(device: str, gpu: str | None = None) -> float:
    """The FLOP/s a training step reaches on the target: its peak (``device_peaks``) times
    ``core.hardware.TRAINING_EFFICIENCY`` (training rarely reaches the data sheet)."""
    return device_peaks(device, gpu).flops_per_second * hardware.TRAINING_EFFICIENCY


def target_gpu(device: str | torch.device, gpu: str | None = None) -> tuple[str, str | None, str | None]:
    """(device type, key in ``core.hardware.GPUS`` or None, the GPU's name) of ``gpu`` when named, else of the device.

    >>> target_gpu("cpu"), target_gpu("cpu", gpu="H100")
    (('cpu', None, None), ('cuda', 'h100', 'H100'))
    """
    if gpu is not None:
        return "cuda", hardware.gpu(gpu).name, gpu
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(dev)
        return "cuda", hardware.match_gpu(name), name
    return dev.type, None, None


# Ops that allocate without writing: an ``empty`` tensor moves no data until an op fills it.
_ALLOCATING = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _storage(t: torch.Tensor) -> StorageWeakRef | None:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (NotImplementedError, RuntimeError):  # tensor subclasses without a storage
        return None


def _moves_no_data(func: Any, args: Any, out: Any) -> bool:
    """Whether ``func`` only allocates or re-labels memory (a view, metadata, ``empty``, ``_unsafe_view``)."""
    if func.is_view or func.namespace == "prim" or func.overloadpacket.__name__ in _ALLOCATING:
        return True
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return False  # in place: it reads and writes
    outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not outputs:
        return False
    inputs = {_storage(t) for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
    inputs.discard(None)
    return all(_storage(t) in inputs for t in outputs)


class OpRecorder(TorchDispatchMode):
    """Records every op under it as an ``OpCost`` in ``ops`` (bytes of distinct inputs and outputs); calls ``on_op``."""

    def __init__(self, on_op: Callable[[OpCost], None] | None = None):
        super().__init__()
        self.ops: list[OpCost] = []
        self.on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func.overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        moved = 0
        # prim ops read metadata; torch issues some only on a first call (a first profile would cost more).
        if not _moves_no_data(func, (args, kwargs), out):
            seen: set[int] = set()
            for t in tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    moved += t.numel() * t.element_size()
        op = OpCost(func, flops, moved)
        self.ops.append(op)
        if self.on_op is not None:
            self.on_op(op)
        return out


@functools.lru_cache(maxsize=None)
def sac_seconds_per_op() -> float:
    """What selective checkpointing's dispatch modes add per op of an eager step here, measured once per process."""
    ops = 100
    x = torch.zeros(32, 32, requires_grad=True)

    def chain(t: torch.Tensor) -> torch.Tensor:
        for _ in range(ops):
            t = t * 1.0
        return t

    def best(extra: dict) -> float:
        times = []
        for _ in range(4):
            start = time.perf_counter()
            checkpoint(chain, x, use_reentrant=False, **extra).sum().backward()
            times.append(time.perf_counter() - start)
        return min(times[1:])

    with torch.enable_grad():
        plain, selective = best({}), best({"context_fn": context_fn("save_matmuls")})
    return max(0.0, (selective - plain) / ops)


# The least a policy's recompute costs under compile (one nanosecond), so a stage whose policy
# recomputes only fused-away ops is kept where memory allows: a plan recomputes what the budget needs.
TIE_SECONDS = 1e-9


def _recompute_priced(ops: Sequence[OpCost], compiled: bool) -> list[OpCost]:
    """The recomputed ``ops`` that cost something: under compile, a pointwise op is fused into the backward kernel."""
    return [op for op in ops if not (compiled and torch.Tag.pointwise in getattr(op.func, "tags", ()))]


def option_costs(name: str, policy: str | None, wrap: Sequence[str], stats: dict[str, Any],
                 peaks: Peaks, seconds_per_op: float = 0.0, compiled: bool = False) -> Costs:
    """The costs of recomputing ``wrap`` (modules of stage ``name``), under op-level ``policy`` if any (then
    ``name`` alone); ``compiled``: pointwise recomputes are fused away (a policy of them only costs ``TIE_SECONDS``)."""
    if not policy:
        costs = Costs()
        for m in wrap:
            priced = roofline_seconds(_recompute_priced(stats[m].ops, compiled), peaks)
            whole = roofline_seconds(stats[m].ops, peaks)
            share = priced / whole if compiled and whole > 0 else 1.0
            costs += Costs(stats[m].seconds * share, stats[m].flops, priced)
        return costs
    ops = stats[name].ops
    recomputed = [op for op, again in zip(ops, recomputed_ops(policy, [op.func for op in ops])) if again]
    roofline = roofline_seconds(_recompute_priced(recomputed, compiled), peaks)
    whole = roofline_seconds(ops, peaks)
    # Only ops are recorded, not their times: the stage's measured time is shared by roofline.
    seconds = stats[name].seconds * (roofline / whole) if whole > 0 else 0.0
    seconds += 0.0 if compiled else len(ops) * seconds_per_op
    if compiled:
        # As the one FLOP below: a recompute fused away still loses the tie with keeping the stage.
        roofline, seconds = max(roofline, TIE_SECONDS), max(seconds, TIE_SECONDS)
    # One FLOP more than its ops count: a policy that recomputes only elementwise ops (0 FLOPs to
    # FlopCounterMode) is not free, so under cost="flops" keeping a stage wins the tie with it.
    return Costs(seconds, int(sum(op.flops for op in recomputed)) + 1, roofline)
