"""lightning-remat: keep a training step under a memory budget with the least recomputation.

The engine (profile, solve, apply) is importable without Lightning or Accelerate; the
integrations are imported on first use.

Example:
    >>> import lightning_remat
    >>> lightning_remat.parse_budget("512MB")
    512000000
"""

from __future__ import annotations

import importlib
from typing import Any

from .budget import format_bytes, parse_budget
from .memory_model import Profile, Segment, StageOption, StageProfile
from .plan import Plan, StageChoice
from .solve import BudgetTooSmallError, solve

__version__ = "0.1.0"

# Names that need torch (or an integration) are imported lazily, so `import lightning_remat`
# stays cheap and the solver stays usable on its own.
_LAZY = {
    "profile_step": "lightning_remat.profile",
    "plan_remat": "lightning_remat.api",
    "apply_plan": "lightning_remat.apply",
    "remove_remat": "lightning_remat.apply",
    "AlreadyCheckpointedError": "lightning_remat.apply",
    "find_stages": "lightning_remat.candidates",
    "NoCandidateError": "lightning_remat.candidates",
    "measure_step": "lightning_remat.measure",
    "AutoRemat": "lightning_remat.callback",
    "find_remat_batch_size": "lightning_remat.batch_size",
    "BatchSizeResult": "lightning_remat.batch_size",
    "BatchSizeTooSmallBudgetError": "lightning_remat.batch_size",
    "RematBatchSizeFinder": "lightning_remat.batch_size_finder",
    "memory_breakdown": "lightning_remat.report",
    "FakeProfileError": "lightning_remat.fake",
    "RematAccelerator": "lightning_remat.accelerate",
    "RematPlugin": "lightning_remat.accelerate",
    "prepare_remat": "lightning_remat.accelerate",
}

__all__ = [
    "BudgetTooSmallError",
    "Plan",
    "Profile",
    "Segment",
    "StageChoice",
    "StageOption",
    "StageProfile",
    "format_bytes",
    "parse_budget",
    "solve",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_remat' has no attribute {name!r}")
