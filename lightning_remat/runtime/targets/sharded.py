"""Plan an FSDP2 step for N GPUs in one process: the fake twin sharded over a fake group of N ranks."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ...core.errors import ShardingError
from ..measuring.optimizers import map_optimizers
from .fake import _shallow_module_copy, clone_optimizer


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[object]:
    """A process group of ``world_size`` fake ranks and a CPU mesh, gone on exit; ``ShardingError`` if one exists."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_available():
        raise ShardingError("planning a sharded step needs torch.distributed, which this torch build lacks")
    if dist.is_initialized():
        raise ShardingError(
            "world_size > 1 plans a sharded step in this one process on a fake process group, but this process "
            "already has a process group (a real distributed run)",
            "Plan inside the real sharded run with world_size=1 (each rank profiles its own shard), or plan "
            "with fake=True and world_size=N in a separate process before torch.distributed starts.")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        # Made outside any fake mode: the mesh reads its rank table's values.
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def shard_model(model: nn.Module, units: Sequence[str], mesh: object, mode: object,
                param_dtype: torch.dtype | None = None) -> None:
    """``fully_shard`` each of ``units`` and then ``model`` itself, in the fake ``mode``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    modules = dict(model.named_modules())
    kwargs: dict = {"mesh": mesh}
    if param_dtype is not None:  # computed in ``param_dtype``, gradients reduced in float32
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    with mode:  # type: ignore[attr-defined]
        for name in units:
            fully_shard(modules[name], **kwargs)
        fully_shard(model, **kwargs)


def unsharded_in_flight_bytes(model: nn.Module, units: Sequence[str], param_dtype: torch.dtype | None) -> int:
    """Bytes of unsharded parameters alive together at most: the root's and the two largest units'.

    >>> net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    >>> unsharded_in_flight_bytes(net, ["0", "1", "2"], None)  # the two largest units, 20 floats each
    160
    """
    modules = dict(model.named_modules())

    def nbytes(params: Sequence[torch.Tensor]) -> int:
        return sum(p.numel() * (torch.finfo(param_dtype).bits // 8 if param_dtype is not None and p.is_floating_point()
                                else p.element_size()) for p in params)

    in_units: set[int] = set()
    sizes = []
    for name in units:
        params = list(modules[name].parameters())
        in_units.update(id(p) for p in params)
        sizes.append(nbytes(params))
    root = nbytes([p for p in model.parameters() if id(p) not in in_units])
    return root + sum(sorted(sizes, reverse=True)[:2])


def uneven_parameters(model: nn.Module, world_size: int) -> list[str]:
    """Names of parameters whose first dimension ``world_size`` does not divide (FSDP2 pads them).

    >>> uneven_parameters(nn.Linear(4, 3), 2)
    ['weight', 'bias']
    """
    return [name for name, p in model.named_parameters() if p.dim() > 0 and p.shape[0] % world_size]


@contextlib.contextmanager
def sharded_twin(model: nn.Module, optimizer: Any, world_size: int, candidates: object, mode: Any,
                 param_dtype: torch.dtype | None) -> Iterator[tuple[nn.Module, Any]]:
    """With ``world_size`` > 1, a sharded copy of the fake ``model`` and ``optimizer`` (one, several or None) over
    its sharded parameters, without state (the sharded state is counted ahead); else ``model`` and ``optimizer``."""
    if world_size <= 1:
        yield model, optimizer
        return
    from ..profiling.candidates import find_stages

    # fully_shard changes classes, parameters and hooks: a twin of its own leaves the model given as it was.
    twin = _shallow_module_copy(model)

    units = find_stages(twin, candidates)
    with fake_process_group(world_size) as mesh:
        shard_model(twin, units, mesh, mode, param_dtype)
        sharded = dict(twin.named_parameters())
        params = {id(p): sharded[name] for name, p in model.named_parameters()}
        yield twin, map_optimizers(optimizer, lambda o: clone_optimizer(o, params, mode, state=False))


def sharding_info(model: nn.Module, world_size: int, candidates: object, param_dtype: torch.dtype | None) -> dict:
    """What a profile records of the sharding of ``model`` over ``world_size`` GPUs.

    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
    >>> info = sharding_info(net, 8, None, None)
    >>> info["world_size"], info["units"], info["padded_parameters"]
    (8, 4, 6)
    """
    from ..profiling.candidates import find_stages

    units = find_stages(model, candidates)
    stored = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {
        "world_size": world_size, "units": len(units) + 1,
        "unsharded_parameter_bytes": unsharded_in_flight_bytes(model, units, param_dtype),
        "sharded_dtype": str(stored).replace("torch.", ""),
        "param_dtype": str(param_dtype or stored).replace("torch.", ""),
        "padded_parameters": len(uneven_parameters(model, world_size)),
    }


def sharding_note(info: dict) -> str:
    """The profile's note on what was modelled."""
    mixed = info["param_dtype"] != info["sharded_dtype"]
    precision = (f"MixedPrecisionPolicy(param_dtype={info['param_dtype']}, reduce_dtype=float32): {info['sharded_dtype']} "
                 "sharded parameters (master weights), gradients and optimizer state, all-gathered and computed in "
                 f"{info['param_dtype']}" if mixed else f"parameters, gradients and optimizer state in {info['sharded_dtype']}")
    padded = (f"; {info['padded_parameters']} parameter(s) have a first dimension the world size does not divide, "
              "which FSDP2 pads (the padding is counted)" if info["padded_parameters"] else "")
    return (f"sharded: FSDP2 fully_shard over {info['world_size']} GPUs ({info['units']} units: each candidate block "
            f"and the root, reshard_after_forward=True), figures per GPU for a batch per GPU as the step makes it; "
            f"{precision}{padded}")
