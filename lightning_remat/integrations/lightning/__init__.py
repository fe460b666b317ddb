"""Lightning: the ``AutoRemat`` callback and ``RematBatchSizeFinder``."""

from .batch_size_finder import RematBatchSizeFinder
from .callback import AutoRemat

__all__ = ["AutoRemat", "RematBatchSizeFinder"]
