"""The public name of the Accelerate integration (``lightning_remat.accelerate``); it lives in
``lightning_remat.integrations.accelerate``.

Example:
    >>> from lightning_remat.accelerate import RematPlugin
    >>> RematPlugin(budget="1GB").enabled
    True
"""

from .integrations.accelerate import *  # noqa: F401,F403
from .integrations.accelerate import __all__  # noqa: F401
