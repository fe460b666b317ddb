"""Helpers for the tests that run 2 CPU processes with gloo: a small GPT-2 and its FSDP2 sharding,
and ``spawn``, which runs a function on every rank and returns what each rank returned.

``spawn``'s function is pickled into the rank processes: it must be a module-level function of a
test module (importable from ``tests/``), and return something ``json`` can write.

The rank processes live as long as the test process that started them: each would otherwise import
torch, Lightning and transformers cold (about 6 CPU-s on a busy 2-core machine), and a run had 12
two-rank cases. Every case gets a process group of its own, the torch seed a fresh process starts
from, the environment as the process started, and ``after_case``'s undo callbacks for anything it
patched; a case that raises or kills a rank ends the processes (the next case starts new ones).
"""

import atexit
import json
import os
import queue
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_FRESH_SEED = 67280421310721  # torch's default seed: what a fresh process draws from

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
    after_case(lambda: setattr(profiling, "profile_step", real))
    return calls


_UNDO: list = []


def after_case(undo) -> None:
    """Call ``undo()`` when this case ends on this rank (the next case runs in the same process)."""
    _UNDO.append(undo)


def _entry(rank: int, fn, world: int, init: str, out: str, args: tuple) -> bool:
    """Run one case; whether the process group was still there at its end (a rank that failed in
    lockstep may have aborted it: then the others' collectives end only when this process exits)."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        result = fn(rank, *args)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        kept = dist.is_initialized()
        if kept:
            dist.destroy_process_group()
    return kept


def _serve(rank: int, world: int, cases, done) -> None:
    """A rank process: run each case sent to it, as a fresh process would, until told to stop."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    parent, environment = os.getppid(), dict(os.environ)
    while True:
        try:
            case = cases.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the test process is gone
                return
            continue
        if case is None:
            return
        fn, init, out, args = case
        torch.manual_seed(_FRESH_SEED)
        kept = False
        try:
            kept = _entry(rank, fn, world, init, out, args)
            done.put((rank, None, kept))
        except BaseException:  # noqa: BLE001 - reported to the test process, which raises it
            done.put((rank, traceback.format_exc(), False))
        finally:
            if not kept:  # an aborted group (or a failure): end as a one-case process would
                return
            end_case(environment)


def end_case(environment: dict) -> None:
    """Undo what a case changed in its rank process (patches, ``environment``, Accelerate's state) for the next."""
    while _UNDO:
        _UNDO.pop()()
    os.environ.clear()
    os.environ.update(environment)
    _reset_accelerate()


def _reset_accelerate() -> None:
    """Accelerate keeps its state in class-level singletons: a case's Accelerator is not the next one's."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()


class _Ranks:
    """``world`` rank processes waiting for cases."""

    def __init__(self, world: int):
        context = mp.get_context("spawn")
        self.world = world
        self.cases = [context.Queue() for _ in range(world)]
        self.done = context.Queue()
        self.processes = [context.Process(target=_serve, args=(rank, world, self.cases[rank], self.done))
                          for rank in range(world)]
        for process in self.processes:
            process.start()

    def run(self, fn, init: str, out: str, args: tuple) -> bool:
        """Run one case on every rank; whether every rank process is still there for the next."""
        for cases in self.cases:
            cases.put((fn, init, out, args))
        kept: dict = {}
        while len(kept) < self.world:
            try:
                rank, error, still = self.done.get(timeout=1)
            except queue.Empty:
                if all(p.is_alive() for r, p in enumerate(self.processes) if r not in kept):
                    continue
                try:  # a rank that ended may have reported just before
                    rank, error, still = self.done.get(timeout=5)
                except queue.Empty:
                    raise RuntimeError("a rank process died: exit codes "
                                       f"{[p.exitcode for p in self.processes]}") from None
            if error is not None:
                raise RuntimeError(f"rank {rank} raised:\n{error}")
            kept[rank] = still
        return all(kept.values())

    def stop(self, wait: float = 10) -> None:
        for cases, process in zip(self.cases, self.processes):
            if process.is_alive():
                cases.put(None)
        deadline = time.monotonic() + wait
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()


_RANKS: dict = {}


def spawn(fn, out, *args, world: int = 2) -> list:
    """Run ``fn(rank, *args)`` in ``world`` processes of one gloo group; every rank's return value, in rank order."""
    ranks = _RANKS.get(world)
    if ranks is None:
        ranks = _RANKS[world] = _Ranks(world)
    try:
        alive = ranks.run(fn, f"file://{out / 'rendezvous'}", str(out), args)
    except BaseException:
        del _RANKS[world]
        ranks.stop(wait=0)  # a rank may be waiting in a collective its peer never joins
        raise
    if not alive:
        del _RANKS[world]
        ranks.stop()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@atexit.register  # before multiprocessing's own exit handler, which would wait for them
def stop_ranks() -> None:
    """End the rank processes (the test session's end)."""
    while _RANKS:
        _RANKS.popitem()[1].stop()
