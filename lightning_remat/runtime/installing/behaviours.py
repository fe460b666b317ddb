"""The behaviours a plan installs, registered in the order they compose (outermost first):

1. ``chunked_loss`` (``chunked_loss.py``): a causal LM hands its labels to its head, whose forward
   returns the loss over sequence chunks; it runs in place of the plain forward.
2. ``offload`` (``offload.py``): what the call saves goes to host memory (``saved_tensors_hooks``
   around everything inside, a recompute's checkpoint too).
3. ``recompute`` (``recompute.py``): the forward runs under a non-reentrant checkpoint, with the
   options the behaviours after it give (``Behaviour.checkpoint_options``):
4. ``policy`` (``sac.py``): the checkpoint's ``context_fn`` is the op-level policy's.
5. ``input_offload`` (``input_offload.py``): the checkpoint keeps a host copy of its input.
6. ``segment`` (``segments.py``): runs of items of an ``nn.Sequential`` recomputed as one checkpoint.

Another behaviour is one ``records.register``: innermost, or before the one it names.

Example:
    >>> [b.name for b in BEHAVIOURS][:6]
    ['chunked_loss', 'offload', 'recompute', 'policy', 'input_offload', 'segment']
"""

from __future__ import annotations

from .chunked_loss import ChunkedLoss
from .input_offload import INPUT_OFFLOAD
from .offload import OFFLOAD
from .recompute import RECOMPUTE
from .records import BEHAVIOURS, register
from .sac import OpPolicy
from .segments import SEGMENT

__all__ = ["BEHAVIOURS"]

for _behaviour in (ChunkedLoss(), OFFLOAD, RECOMPUTE, OpPolicy(), INPUT_OFFLOAD, SEGMENT):
    register(_behaviour)
