"""A rank failing in a lockstep section would meet the others in a mismatched collective (gloo aborts, nccl
hangs): it posts on the group's store and waits ``PEER_WAIT_S`` for every rank's word; if one is silent, it posts
its error as the verdict and aborts the group, and every rank raises it."""

from __future__ import annotations

import itertools
import pickle
import time
from typing import Any

import torch

from ..core.errors import PlanningFailedError, RematError

PEER_WAIT_S = 5.0  # how long a rank whose work ended early waits for the others' word
_PREFIX = "lightning_remat/lockstep"
_sections = itertools.count()  # this process's lockstep sections, in the order every rank enters them


class RankBoard:
    """One lockstep section's statuses on a ``torch.distributed.Store``: who posted, and any verdict."""

    def __init__(self, store: Any, rank: int, world_size: int, section: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix = f"{_PREFIX}/{section}"

    def post(self) -> None:
        """This rank's word: its work in this section is over (finished, or ended early)."""
        self.store.set(f"{self.prefix}/{self.rank}", b"")

    def everyone_posted(self, wait_s: float = PEER_WAIT_S) -> bool:
        keys = [f"{self.prefix}/{rank}" for rank in range(self.world_size)]
        deadline = time.monotonic() + wait_s
        while not self.store.check(keys):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def verdict(self) -> BaseException | None:
        """The error of the rank that aborted the group in this section, if one did."""
        key = f"{self.prefix}/verdict"
        return pickle.loads(self.store.get(key)) if self.store.check([key]) else None

    def abort(self, error: BaseException) -> BaseException:
        """Post ``error`` as the verdict, abort the process group, and return the error to raise."""
        self.store.set(f"{self.prefix}/verdict", _picklable(error))
        abort_process_group()
        return error


def section_board(channel: Any) -> RankBoard | None:
    """The next lockstep section's board on the group's store; None without one (one process, no store)."""
    dist = torch.distributed
    if not (channel.distributed and dist.is_available() and dist.is_initialized()):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    return RankBoard(store, channel.rank, channel.world_size, next(_sections))


def settle(board: RankBoard | None, early: BaseException | None) -> None:
    """Post this rank's word; ``early`` (why its work ended early) with a rank silent aborts the group, raised as the verdict."""
    if board is None:
        return
    if early is not None:
        verdict = board.verdict()
        if verdict is not None:  # this rank's collective ended because another rank aborted the group
            abort_process_group()
            raise verdict
    board.post()
    if early is not None and not board.everyone_posted():
        raise board.abort(_aborted(early, board.rank))


def verdict_or(board: RankBoard | None, error: BaseException) -> BaseException:
    """For a collective that failed after the section: the aborting rank's verdict if any, else ``error``."""
    verdict = board.verdict() if board is not None else None
    if verdict is None:
        return error
    abort_process_group()
    return verdict


def abort_process_group() -> None:
    """Abort this process's end of the default group, ending any collective waiting on it on every rank."""
    dist = torch.distributed
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        abort() if abort is not None else dist.destroy_process_group()
    except (RuntimeError, ValueError):  # already aborted from another path
        pass


def _aborted(error: BaseException, rank: int) -> BaseException:
    """The section's verdict: ``error`` as it travels, with what happened to the group added."""
    what = (f"(rank {rank} stopped in a lockstep section while another rank waited in a collective for it, so "
            f"the process group was aborted on every rank after {PEER_WAIT_S:g} s: initialise torch.distributed "
            "again to go on)")
    if isinstance(error, RematError):
        error.add_hint(what)
        return error
    return PlanningFailedError(f"{type(error).__name__}: {error} {what}")


def _picklable(error: BaseException) -> bytes:
    try:
        return pickle.dumps(error)
    except Exception:  # noqa: BLE001 - an error that does not pickle travels by its text
        return pickle.dumps(PlanningFailedError(f"{type(error).__name__}: {error}"))
