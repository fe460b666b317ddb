"""The channel between ranks (``service.channel.Channel``) over a Lightning trainer's strategy.

The strategy has no all-gather of objects: ``gather`` is one broadcast from each rank in turn.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from ...service.channel import Channel

T = TypeVar("T")


class LightningChannel(Channel):
    """The ranks of ``trainer``, talking through ``trainer.strategy``."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    @property
    def rank(self) -> int:
        return int(self.trainer.global_rank)

    @property
    def world_size(self) -> int:
        return int(self.trainer.world_size)

    def broadcast(self, value: T) -> T:
        return self.trainer.strategy.broadcast(value, src=0)

    def gather(self, value: Any) -> list:
        return [self.trainer.strategy.broadcast(value if rank == self.rank else None, src=rank)
                for rank in range(self.world_size)]

    def max(self, value: float) -> float:
        strategy = self.trainer.strategy
        local = torch.tensor(float(value), dtype=torch.float64, device=strategy.root_device)
        return float(strategy.reduce(local, reduce_op="max").item())

    def any(self, flag: bool) -> bool:
        return bool(self.trainer.strategy.reduce_boolean_decision(bool(flag), all=False))


def lightning_channel(trainer: Any) -> Channel:
    """``trainer``'s channel: over its strategy with several processes, else the single-process one."""
    return LightningChannel(trainer) if trainer.world_size > 1 else Channel()
