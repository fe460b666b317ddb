"""Lightning: the ``AutoRemat`` callback, ``RematBatchSizeFinder``, and a LightningModule's
``training_step`` as the engine's step closure."""

from .batch_size_finder import RematBatchSizeFinder
from .callback import AutoRemat

__all__ = ["AutoRemat", "RematBatchSizeFinder"]
