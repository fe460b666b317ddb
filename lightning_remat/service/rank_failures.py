"""One rank that fails inside a lockstep section: its error on every rank, within seconds.

In a lockstep section (``Channel.on_every_rank`` / ``outcomes``) every rank runs work whose passes
may run collectives: a model sharded with FSDP2 all-gathers its parameters in every forward. A rank
that fails in there (the user's step raises, a trial runs out of memory) stops joining them; the
others wait inside one, and when the failed rank then enters the gather of outcomes it meets a
collective of another size: gloo aborts both processes (SIGABRT, no Python error), nccl hangs until
the group's timeout. So a rank whose work ended early posts that on the process group's store (a
key-value store beside the collectives, which no blocked collective holds up) and waits a few
seconds (``PEER_WAIT_S``) for every other rank's word on the same section:

- every rank posted (each finished its work, or ended early at the same point, as an out-of-memory
  error does on every rank alike): nobody is inside a collective; the gather goes on, and every rank
  raises the first rank's error or takes the outcomes (an out-of-memory trial counts as not fitting);
- some rank did not: it waits inside a collective for this one. This rank posts its error as the
  section's verdict and aborts the process group, which ends the others' collectives at once
  (gloo: "Connection closed by peer"); each of them, failing so, finds the verdict, aborts its own
  end of the group and raises the verdict. The group is gone on every rank (the ranks no longer
  agree on which collective comes next, so it could not be used again anyway); the error says so.

Ranks that finish post that too and go straight on to the gather. Sections are numbered in the
order every rank enters them (lockstep), so a section's keys are the same on every rank.

Example:
    >>> from torch.distributed import HashStore
    >>> board = RankBoard(HashStore(), rank=1, world_size=2, section=7)
    >>> board.post()                       # rank 1's work is over
    >>> board.everyone_posted(wait_s=0.0)  # rank 0 has not said anything yet
    False
"""

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
    """One lockstep section's statuses on ``store`` (a ``torch.distributed.Store``): who finished,
    who ended early and with what error, and the verdict of a rank that aborted the group."""

    def __init__(self, store: Any, rank: int, world_size: int, section: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix = f"{_PREFIX}/{section}"

    def post(self) -> None:
        """This rank's word: its work in this section is over (finished, or ended early)."""
        self.store.set(f"{self.prefix}/{self.rank}", b"")

    def everyone_posted(self, wait_s: float = PEER_WAIT_S) -> bool:
        """Whether every rank posted within ``wait_s`` seconds."""
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
    """The next lockstep section's board for ``channel``: on the store of the initialised
    ``torch.distributed`` group its ranks share; None where there is none (one process, a
    channel standing in for other ranks, a group without a store).

    Example:
        >>> from lightning_remat.service.channel import Channel
        >>> section_board(Channel()) is None
        True
    """
    dist = torch.distributed
    if not (channel.distributed and dist.is_available() and dist.is_initialized()):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    return RankBoard(store, channel.rank, channel.world_size, next(_sections))


def settle(board: RankBoard | None, early: BaseException | None) -> None:
    """This rank's word on ``board``; ``early`` is why its work ended early (None: it finished).
    When it ended early and some rank stays silent (it waits in a collective for this one), the
    process group is aborted and ``early`` raised as the verdict (see the module). A rank whose work
    failed because another rank aborted the group raises that rank's verdict."""
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
    """A collective that failed after the section: the verdict of the rank that aborted the group,
    if one did (this rank's end aborted too), else ``error``."""
    verdict = board.verdict() if board is not None else None
    if verdict is None:
        return error
    abort_process_group()
    return verdict


def abort_process_group() -> None:
    """Abort this process's end of the default group (all its groups): any collective waiting on it
    ends at once, here and on the other ranks. Nothing when it is gone already."""
    dist = torch.distributed
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        abort() if abort is not None else dist.destroy_process_group()
    except (RuntimeError, ValueError):  # already aborted from another path
        pass


def _aborted(error: BaseException, rank: int) -> BaseException:
    """The section's verdict: ``error`` as it travels (``channel.travelling``), with what happened to
    the group added to its message; one error every rank raises."""
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
