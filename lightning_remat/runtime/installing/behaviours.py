"""The built-in behaviours, registered in the order they compose (outermost first).

>>> [b.name for b in BEHAVIOURS][:9]
['chunked_loss', 'fused_loss', 'offload', 'recompute', 'policy', 'input_offload', 'segment', 'residual_parts', 'tile']
"""

from __future__ import annotations

from .chunked_loss import ChunkedLoss
from .fused_loss import FusedLoss
from .input_offload import INPUT_OFFLOAD
from .offload import OFFLOAD
from .recompute import RECOMPUTE
from .records import BEHAVIOURS, register
from .residual_parts import RESIDUAL_PARTS
from .sac import OpPolicy
from .segments import SEGMENT
from .tiled_mlp import TILED_MLP

__all__ = ["BEHAVIOURS"]

for _behaviour in (ChunkedLoss(), FusedLoss(), OFFLOAD, RECOMPUTE, OpPolicy(), INPUT_OFFLOAD, SEGMENT, RESIDUAL_PARTS,
                   TILED_MLP):
    register(_behaviour)
