"""lightning-remat: keep a training step under a memory budget with the least recomputation (layers:
docs/architecture.md). Names that need torch are imported on first use, so the import stays cheap.

>>> import lightning_remat
>>> lightning_remat.parse_budget("512MB")
512000000
"""

from __future__ import annotations

import importlib
from typing import Any

from .core.budget import Budget, format_bytes, parse_budget
from .core.config import ProfileOptions, RematConfig
from .core.errors import (AlreadyCheckpointedError, BatchSizeTooSmallBudgetError, BudgetTooSmallError,
                          ConflictingArgumentsError, FakeProfileError, InstallationMismatchError, InvalidPlanError,
                          NoCandidateError,
                          PlanFormatError, PlanMismatchError, PlanningFailedError, RematError, SkippedStepError,
                          StepError, UnsupportedSetupError,
                          UnsupportedShardingError)
from .core.memory_model import Costs, Profile, Segment, StageOption, StageProfile
from .core.plan import Plan, StageAction, StageChoice
from .core.solve import solve

__version__ = "0.1.0"

_LAZY = {
    "profile_step": "lightning_remat.runtime.profiling.profile",
    "apply_plan": "lightning_remat.runtime.installing.apply",
    "remove_remat": "lightning_remat.runtime.installing.apply",
    "recomputing": "lightning_remat.runtime.installing.recompute",
    "head_loss": "lightning_remat.runtime.installing.chunked_loss",
    "CausalLMLoss": "lightning_remat.runtime.installing.chunked_loss",
    "find_stages": "lightning_remat.runtime.profiling.candidates",
    "measure_step": "lightning_remat.runtime.measuring.measure",
    "plan_remat": "lightning_remat.service.planning",
    "find_remat_batch_size": "lightning_remat.service.batch_size",
    "BatchSizeResult": "lightning_remat.service.batch_size",
    "find_remat_seq_len": "lightning_remat.service.seq_len",
    "SeqLenResult": "lightning_remat.service.seq_len",
    "memory_breakdown": "lightning_remat.report.breakdown",
    "AutoRemat": "lightning_remat.integrations.lightning.callback",
    "RematBatchSizeFinder": "lightning_remat.integrations.lightning.batch_size_finder",
    "RematAccelerator": "lightning_remat.integrations.accelerate",
    "RematPlugin": "lightning_remat.integrations.accelerate",
    "prepare_remat": "lightning_remat.integrations.accelerate",
    "ShapePlans": "lightning_remat.service.shape_plans",
    "RematTrainerCallback": "lightning_remat.integrations.hf_trainer",
}

__all__ = [
    "AlreadyCheckpointedError",
    "BatchSizeTooSmallBudgetError",
    "Budget",
    "BudgetTooSmallError",
    "ConflictingArgumentsError",
    "Costs",
    "FakeProfileError",
    "InstallationMismatchError",
    "InvalidPlanError",
    "NoCandidateError",
    "Plan",
    "PlanFormatError",
    "PlanMismatchError",
    "PlanningFailedError",
    "Profile",
    "ProfileOptions",
    "RematConfig",
    "RematError",
    "Segment",
    "SkippedStepError",
    "StageAction",
    "StageChoice",
    "StageOption",
    "StageProfile",
    "StepError",
    "UnsupportedSetupError",
    "UnsupportedShardingError",
    "format_bytes",
    "parse_budget",
    "solve",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_remat' has no attribute {name!r}")
