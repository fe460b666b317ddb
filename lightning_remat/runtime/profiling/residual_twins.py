"""Which residual blocks may run as checkpointed parts: their twin gave their own output in one forward.

Example:
    >>> from lightning_remat.models import build
    >>> case = build("tv_resnet", batch_size=2, image_size=32, depths=(2, 1, 1, 1), width=8)
    >>> twin_stages(case.model, case.step, ["layer1.0", "layer1.1", "fc"])
    ['layer1.0', 'layer1.1']
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import nn

from ..installing.offloader import is_fake
from ..installing.residual_parts import gives_same_output, parts_of
from ..installing.segments import recorded_calls
from .hierarchy import _single_tensor_call

# The stage options a twin adds: kept with its parts checkpointed, and recomputed whole with them nested.
PARTS = "parts"
WHOLE_PARTS = "whole+parts"


def twin_stages(model: nn.Module, step: Callable[[nn.Module], Any], stages: Sequence[str],
                replay: Callable[[], None] = lambda: None) -> list[str]:
    """The ``stages`` in torchvision's residual layout whose twin, on the input one forward gave them, gave their output."""
    modules = dict(model.named_modules())
    eligible = [n for n in stages if parts_of(modules[n]) is not None]
    # Fake tensors have no values to compare: no twin is offered on them.
    if not eligible or any(is_fake(p) for p in model.parameters()):
        return []
    replay()
    calls = recorded_calls(model, step, eligible)
    found = []
    for name in eligible:
        call = _single_tensor_call(calls[name])  # None: a block at several places, or not run
        # The recorded tensors as the call saw them: changed in place since, they prove nothing.
        if call is not None and (call[0]._version, call[2]._version) == (call[1], call[3]) \
                and gives_same_output(modules[name], (call[0],), call[2]):
            found.append(name)
    return found
