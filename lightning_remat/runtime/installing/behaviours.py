"""The built-in behaviours, registered in the order they compose (outermost first).

Example:
    >>> [b.name for b in BEHAVIOURS][:7]
    ['chunked_loss', 'offload', 'recompute', 'policy', 'input_offload', 'segment', 'tile']
"""

from __future__ import annotations

from .chunked_loss import ChunkedLoss
from .input_offload import INPUT_OFFLOAD
from .offload import OFFLOAD
from .recompute import RECOMPUTE
from .records import BEHAVIOURS, register
from .sac import OpPolicy
from .segments import SEGMENT
from .tiled_mlp import TILED_MLP

__all__ = ["BEHAVIOURS"]

for _behaviour in (ChunkedLoss(), OFFLOAD, RECOMPUTE, OpPolicy(), INPUT_OFFLOAD, SEGMENT, TILED_MLP):
    register(_behaviour)
