"""The Hugging Face ``Trainer``: ``RematTrainerCallback``, over the Accelerate session."""

from .callback import RematTrainerCallback

__all__ = ["RematTrainerCallback"]
