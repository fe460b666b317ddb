"""Accelerate: ``RematPlugin``, ``RematSession``, ``RematAccelerator`` and ``prepare_remat``."""

from .accelerator import RematAccelerator, prepare_remat, remat_session
from .plugin import (ENV_BUDGET, ENV_CANDIDATES, ENV_COST, ENV_OFFLOAD, ENV_POLICIES, ENV_PROFILE_STEPS, METRIC_NAMES,
                     RematPlugin)
from .session import RematSession

__all__ = ["ENV_BUDGET", "ENV_CANDIDATES", "ENV_COST", "ENV_OFFLOAD", "ENV_POLICIES", "ENV_PROFILE_STEPS", "METRIC_NAMES",
           "RematAccelerator", "RematPlugin", "RematSession", "prepare_remat", "remat_session"]
