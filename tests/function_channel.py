"""A channel over plain functions, standing in for other ranks in one process."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

from lightning_remat.core.errors import PlanningFailedError
from lightning_remat.service.channel import Channel

T = TypeVar("T")


class FunctionChannel(Channel):
    """A channel over plain functions: ``broadcast(value)`` from rank 0, ``gather(value)`` from every
    rank; the tests stand in for other ranks so.

    ``rank`` and ``world_size`` are torch.distributed's when it is initialised; else rank 0 (or 1
    when ``is_main`` is false) and the length of one ``gather`` (2 with only a broadcast).
    """

    def __init__(self, broadcast: Callable[[Any], Any] | None = None, gather: Callable[[Any], list] | None = None,
                 is_main: bool = True):
        self._broadcast, self._gather, self._is_main = broadcast, gather, is_main
        self._world_size: int | None = None

    @property
    def rank(self) -> int:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return 0 if self._is_main else 1

    @property
    def is_main(self) -> bool:
        return self._is_main

    @property
    def world_size(self) -> int:
        if self._world_size is None:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                self._world_size = torch.distributed.get_world_size()
            elif self._gather is not None:
                self._world_size = len(self._gather(None))
            else:
                self._world_size = 2 if self._broadcast is not None else 1
        return self._world_size

    def broadcast(self, value: T) -> T:
        return self._broadcast(value) if self._broadcast is not None else value

    def gather(self, value: Any) -> list:
        if self._gather is None:
            raise PlanningFailedError("this channel has no gather")
        return self._gather(value)
