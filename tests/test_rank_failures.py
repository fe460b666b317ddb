"""Ranks that fail together: rank 1 alone fails at each lockstep point of a model sharded with FSDP2
(2 processes, gloo, CPU), and both ranks raise the same error within seconds, instead of dying of a
mismatched collective (gloo's SIGABRT after ~19 s) or waiting until the group's timeout."""

import time

import pytest
import torch
from torch import nn

from lightning_remat.service.channel import PEER_WAIT_S

pytestmark = pytest.mark.xdist_group("fsdp-multiprocess")

# Each point: what fails on rank 1 only, and whether the process group is still usable after it.
POINTS = [
    ("make_step raises in the batch-size search", True),
    ("the step raises while every rank profiles for plan_remat", False),
    ("a trial runs out of memory in the batch-size search", False),
    ("the step raises in a trial of the batch-size search", False),
]


FAILED_AT: list = []  # when rank 1 failed (time.time(): one clock for both processes)


def _sharded_mlp():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def _make_step(rank: int, point: str):
    def make_step(batch_size: int):
        if point.startswith("make_step") and rank == 1:
            FAILED_AT.append(time.time())
            raise ValueError("no batch on rank 1")
        x = torch.randn(batch_size, 16, generator=torch.Generator().manual_seed(batch_size))

        def step(model):
            if rank == 1 and point.startswith("a trial") and torch.is_grad_enabled() and _in_trial():
                FAILED_AT.append(time.time())
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            if rank == 1 and point.startswith("the step raises in a trial") and _in_trial():
                FAILED_AT.append(time.time())
                raise KeyError("labels")
            return model(x).square().mean()
        return step
    return make_step


def _in_trial() -> bool:
    import inspect

    return any(frame.function == "run_trial" for frame in inspect.stack(0))


def _point(rank: int, point: str) -> None:
    from lightning_remat import find_remat_batch_size, plan_remat

    model = _sharded_mlp()
    if point.startswith("the step raises while"):
        def step(m):
            if rank == 1:
                FAILED_AT.append(time.time())
                raise ValueError("bad batch on rank 1")
            return m(torch.randn(8, 16)).square().mean()
        plan_remat(model, step, "min", cost="flops")
    else:
        find_remat_batch_size(model, _make_step(rank, point), "1MB", init_val=2, max_val=16, steps_per_trial=1)


def _ranks(rank: int, points: tuple) -> list:
    import torch.distributed as dist

    results = []
    for point, usable in [POINTS[i] for i in points]:
        FAILED_AT.clear()
        try:
            _point(rank, point)
            results.append([point, None, None, time.time(), dist.is_initialized(), FAILED_AT[:1]])
        except Exception as error:  # noqa: BLE001 - the test compares what every rank raised
            results.append([point, type(error).__name__, str(error), time.time(), dist.is_initialized(),
                            FAILED_AT[:1]])
    return results


# A point after which the group is aborted ends its spawn: with gloo, another rank's collective ends
# when the failed process exits (or frees the group), as a process that raised does.
@pytest.mark.distributed
@pytest.mark.parametrize("points", [(0, 1), (2,), (3,)], ids=["make_step+plan_remat", "trial_oom", "trial_raises"])
def test_one_ranks_failure_at_each_lockstep_point_is_every_ranks_error_within_seconds(tmp_path, points):
    from tests.gloo_ranks import spawn

    rank0, rank1 = spawn(_ranks, tmp_path, points)
    for (point, usable), r0, r1 in zip([POINTS[i] for i in points], rank0, rank1):
        assert r0[1] is not None and r1[1] is not None, (point, r0, r1)  # every rank raised
        assert r0[1:3] == r1[1:3], (point, r0, r1)  # the same error, message included
        assert "rank 1" in r0[2], (point, r0[2])
        failed_at = r1[5][0]  # seconds from rank 1's failure to each rank's error, not the group's timeout
        assert max(r0[3], r1[3]) - failed_at < PEER_WAIT_S + 10, (point, r0[3] - failed_at, r1[3] - failed_at)
        assert r0[4] == r1[4] == usable, (point, r0[4], r1[4])  # the group is aborted only when it had to be
        if "out of memory" in point:
            assert r0[2].startswith("out of memory on rank 1 while running a trial"), r0[2]
