"""Helpers for the tests that run 2 CPU processes with gloo: a small GPT-2 and its FSDP2 sharding,
and ``spawn``, which runs a function on every rank and returns what each rank returned.

``spawn``'s function is pickled into fresh processes (``mp.spawn``): it must be a module-level
function of a test module (importable from ``tests/``), and return something ``json`` can write.
"""

import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SMALL = dict(layers=3, hidden=64, seq_len=32, batch_size=2, vocab=128)


def small_gpt2(**overrides):
    """A 3-layer GPT-2 case (``models.build``) without dropout: ranks would draw other masks than one process."""
    from lightning_remat.models import build

    torch.manual_seed(0)
    case = build("gpt2", **{**SMALL, **overrides})
    for m in case.model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return case


def shard_gpt2(model):
    """FSDP2: each block its own unit, then the whole model."""
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)


def count_profile_calls() -> list:
    """From now on in this process, one item more in the returned list per ``profile_step`` call
    (every rank of a sharded plan profiles, in lockstep)."""
    import lightning_remat.runtime.profiling.profile as profiling

    calls, real = [], profiling.profile_step
    profiling.profile_step = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    return calls


def _entry(rank: int, fn, world: int, init: str, out: str, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        result = fn(rank, *args)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        if dist.is_initialized():  # a rank that failed in lockstep may have aborted the group already
            dist.destroy_process_group()


def spawn(fn, out, *args, world: int = 2) -> list:
    """Run ``fn(rank, *args)`` in ``world`` processes of one gloo group; every rank's return value, in rank order."""
    mp.spawn(_entry, args=(fn, world, f"file://{out / 'rendezvous'}", str(out), args), nprocs=world, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
