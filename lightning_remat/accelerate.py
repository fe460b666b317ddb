"""The public name of the Accelerate integration; it lives in ``lightning_remat.integrations.accelerate``."""

from .integrations.accelerate import *  # noqa: F401,F403
from .integrations.accelerate import __all__  # noqa: F401
