"""The one channel between ranks; errors travel so every rank enters the same collectives whatever failed.

A rank failing in a lockstep section would meet the others in a mismatched collective (gloo aborts, nccl hangs): it
posts on the group's store and waits ``PEER_WAIT_S`` for every rank's word; if one is silent, it posts its error as
the verdict and aborts the group, and every rank raises it.
"""

from __future__ import annotations

import itertools
import pickle
import time
from typing import Any, Callable, TypeVar

import torch

from ..core.errors import PlanningFailedError, RematError, where_it_failed
from ..runtime.measuring.measure import is_out_of_memory

T = TypeVar("T")


def travelling(error: BaseException, rank: int, action: str = "planning") -> BaseException:
    """``error`` as it can travel to other ranks: ours as itself, any other as a ``PlanningFailedError``."""
    if isinstance(error, RematError):
        return error
    if is_out_of_memory(error):
        travelled = PlanningFailedError(f"out of memory on rank {rank}: {error}")
        travelled.out_of_memory = True  # type: ignore[attr-defined]
        return travelled
    where = where_it_failed(error)  # the other ranks see the message only, so it carries the user's line
    return PlanningFailedError(f"{action} failed on rank {rank}: {type(error).__name__}: {error}"
                               + (f" (at {where})" if where else ""))


class Channel:
    """How ranks talk; this one is a single process (rank 0 of 1), where nothing travels."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (which plans, prints and logs)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether there are other ranks to talk to."""
        return self.world_size > 1

    def broadcast(self, value: T) -> T:
        """Rank 0's ``value``, on every rank."""
        return value

    def gather(self, value: Any) -> list:
        """Every rank's ``value``, in rank order, on every rank."""
        return [value]

    def max(self, value: float) -> float:
        return float(max(self.gather(float(value))))

    def any(self, flag: bool) -> bool:
        return self.max(1.0 if flag else 0.0) > 0

    def from_main(self, compute: Callable[[], T], *, action: str = "planning", hint: str = "") -> T:
        """``compute()`` on rank 0; its value, or its error (with ``hint`` added), on every rank."""
        if not self.distributed:
            return _hinted(compute, hint)
        attempt = _Attempt()
        if self.is_main:
            attempt.run(lambda: _hinted(compute, hint), self.rank, action)
        value, error = self.broadcast((attempt.value, attempt.error))
        if self.is_main:
            attempt.raise_if_failed()
        elif error is not None:
            raise error
        return value  # type: ignore[return-value]

    def on_every_rank(self, compute: Callable[[], T], *, action: str = "profiling",
                      ended_early: Callable[[T], bool] | None = None) -> list[T]:
        """``compute()`` on every rank; the values in rank order, or the first rank's error raised on every rank."""
        if not self.distributed:
            return [compute()]
        attempt, results = self.outcomes(compute, action=action, ended_early=ended_early)
        failed = next((rank for rank, (_, error) in enumerate(results) if error is not None), None)
        if failed == self.rank:
            attempt.raise_if_failed()  # this rank's own error, from its original
        elif failed is not None:
            raise results[failed][1]  # type: ignore[misc]
        return [value for value, _ in results]  # type: ignore[misc]

    def outcomes(self, compute: Callable[[], Any], *, action: str = "profiling",
                 ended_early: Callable[[Any], bool] | None = None) -> tuple["_Attempt", list]:
        """``compute()`` on every rank: this rank's attempt, and every rank's ``(value, error)``."""
        attempt = _Attempt()
        attempt.run(compute, self.rank, action)
        # A rank that stopped early must not enter the gather while another waits in a collective (gloo aborts).
        board = section_board(self)
        try:
            settle(board, attempt.early(ended_early, self.rank, action))
        except Exception as verdict:
            if attempt.original is None or verdict is attempt.original:
                raise
            raise verdict from attempt.original
        try:
            return attempt, self.gather((attempt.value, attempt.error))
        except Exception as error:  # noqa: BLE001 - the verdict of a rank that aborted the group, if any
            if board is not None:
                board.raise_verdict(error)
            raise


class _Attempt:
    """One rank's try at ``compute``: its value, or its error as it travels and the original."""

    value: Any = None
    error: BaseException | None = None
    original: BaseException | None = None

    def run(self, compute: Callable[[], Any], rank: int, action: str) -> None:
        try:
            self.value = compute()
        except Exception as caught:  # noqa: BLE001 - every rank raises it, once all have heard of it
            self.original, self.error = caught, travelling(caught, rank, action)

    def early(self, ended_early: Callable[[Any], bool] | None, rank: int, action: str) -> BaseException | None:
        """Why this rank's work ended before the others finished: its error, or an out-of-memory for a flagged value."""
        if self.error is not None or ended_early is None or not ended_early(self.value):
            return self.error
        stopped = PlanningFailedError(f"out of memory on rank {rank} while {action}")
        stopped.out_of_memory = True  # type: ignore[attr-defined]
        return stopped

    def raise_if_failed(self) -> None:
        if self.error is None:
            return
        if self.original is self.error:
            raise self.error
        raise self.error from self.original


def _hinted(compute: Callable[[], T], hint: str) -> T:
    try:
        return compute()
    except RematError as error:
        if hint:
            error.add_hint(hint)
        raise


class TorchDistributedChannel(Channel):
    """An initialised ``torch.distributed`` group of several processes; ``max`` reduces on ``device``."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else None

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank()

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size()

    def broadcast(self, value: T) -> T:
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list:
        values: list = [None] * self.world_size
        torch.distributed.all_gather_object(values, value)
        return values

    def max(self, value: float) -> float:
        device = self.device
        if device is None:
            nccl = torch.distributed.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        reduced = torch.tensor(float(value), dtype=torch.float64, device=device)
        torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
        return float(reduced.item())


def torch_distributed_channel(device: torch.device | str | None = None) -> Channel:
    """The channel of the initialised ``torch.distributed`` group if it has several processes, else a single one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDistributedChannel(device)
    return Channel()


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

    def raise_verdict(self, cause: BaseException | None = None) -> None:
        """Where a rank aborted the group in this section: abort this end too, and raise that rank's error."""
        key = f"{self.prefix}/verdict"
        if self.store.check([key]):
            verdict = pickle.loads(self.store.get(key))
            abort_process_group()
            raise verdict from cause

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
    if early is not None:  # this rank's collective may have ended because another rank aborted the group
        board.raise_verdict()
    board.post()
    if early is not None and not board.everyone_posted():
        raise board.abort(_aborted(early, board.rank))


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
