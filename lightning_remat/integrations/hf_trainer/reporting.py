"""What ``RematTrainerCallback`` reports through the ``Trainer``: figures in its logs (so to every ``report_to``
tracker), console lines, plans in the checkpoint. The reporting callbacks run before the user's, so
``LogFigures`` is placed first: it adds the figures before any of them reads the logs."""

from __future__ import annotations

import enum
import sys
import warnings
from dataclasses import fields
from typing import Any

from transformers.trainer_callback import CallbackHandler, TrainerCallback

from ...core.plan import Plan, saved_plans, saved_state_plans
from ...runtime.installing.fingerprint import made_for_other
from ..accelerate.plugin import RematPlugin


class LogFigures(TrainerCallback):
    """First among the Trainer's callbacks: its ``on_log`` adds ``figures`` (then empties it) to the logs.

    >>> from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback
    >>> handler, pending = CallbackHandler([DefaultFlowCallback()], None, None, None, None), {"remat/budget_bytes": 1e6}
    >>> LogFigures.place(handler, pending), [type(cb).__name__ for cb in handler.callbacks]
    (True, ['LogFigures', 'DefaultFlowCallback'])
    >>> logs = {"loss": 2.5}; handler.callbacks[0].on_log(None, None, None, logs=logs); logs, pending
    ({'loss': 2.5, 'remat/budget_bytes': 1000000.0}, {})
    """

    def __init__(self, figures: dict[str, float]):
        self.figures = figures

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs is not None and self.figures:
            logs.update(self.figures)
            self.figures.clear()

    @staticmethod
    def handler_calling() -> Any:
        """The ``CallbackHandler`` whose ``call_event`` called the hook calling this (None if not one): the
        Trainer gives a callback no handle on itself or its handler."""
        frame = sys._getframe(2)
        handler = frame.f_locals.get("self") if frame is not None else None
        return handler if isinstance(handler, CallbackHandler) else None

    @classmethod
    def place(cls, handler: Any, figures: dict[str, float]) -> bool:
        """Put a ``LogFigures`` of ``figures`` first among ``handler``'s callbacks (once); whether it is there."""
        if handler is None:
            warnings.warn("RematTrainerCallback: not called by the Trainer's CallbackHandler; its remat/* figures "
                          "reach trainer.state.log_history only, not the report_to trackers", UserWarning, stacklevel=3)
            return False
        if not any(isinstance(cb, cls) and cb.figures is figures for cb in handler.callbacks):
            # A new list: the event being called iterates the old one to its end.
            handler.callbacks = [cls(figures), *handler.callbacks]
        return True


def console(message: str) -> None:
    """A line on the console, above the Trainer's progress bar when it shows one (``tqdm.write``)."""
    from tqdm.auto import tqdm

    tqdm.write(message)


def _json_safe(value: Any) -> Any:
    # Settings as the callback takes them again: a module class by its name (``candidates`` takes names).
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, type):
        return value.__name__
    return value.value if isinstance(value, enum.Enum) else value


def plugin_args(plugin: RematPlugin) -> dict[str, Any]:
    """The arguments for ``RematTrainerCallback(**args)`` (how the Trainer remakes it), JSON-safe.

    >>> from torch import nn
    >>> plugin_args(RematPlugin(budget="1GB", candidates=[nn.Linear, "h.*"]))["candidates"]
    ['Linear', 'h.*']
    """
    return {f.name: _json_safe(getattr(plugin, f.name)) for f in fields(plugin)}


def saved_state(session: Any) -> dict[str, Any]:
    """The plans a checkpoint keeps: the latest, and one per batch shape (``AutoRemat``'s format)."""
    shape_plans = session.shape_plans if session is not None else None
    plan = session.plan if session is not None else None
    return {"plan": plan.to_dict() if plan is not None else None,
            "plans": saved_state_plans(shape_plans.plans if shape_plans is not None else {})}


def checkpoint_plans(state: Any, name: str, model: Any) -> dict[Any, Plan]:
    """The plans per shape the Trainer's state keeps for callback ``name``, checked; empty when there are none
    or they were made for another model (said).

    >>> from types import SimpleNamespace
    >>> state = SimpleNamespace(stateful_callbacks={"RematTrainerCallback": {"args": {}, "attributes": {}}})
    >>> checkpoint_plans(state, "RematTrainerCallback", None)   # a fresh run's: nothing saved
    {}
    """
    kept = getattr(state, "stateful_callbacks", None) or {}
    entry = kept.get(name) if isinstance(kept, dict) else None
    entry = entry[0] if isinstance(entry, list) and entry else entry
    data = entry.get("attributes", {}).get("remat_plans") if isinstance(entry, dict) else None
    if not data:
        return {}
    plan, plans = saved_plans(data, f"{name}'s checkpoint state")
    found = made_for_other(model, [plan, *(p for _, p in plans)], bytes_too=True)
    if found is not None:
        warnings.warn(f"{name}: the checkpoint's plans were made for another model ({found}); planning again.",
                      UserWarning, stacklevel=3)
        return {}
    return dict(plans)
