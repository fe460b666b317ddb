"""``RematTrainerCallback``: the Hugging Face ``Trainer`` through the Accelerate session (docs/accelerate.md)."""

from __future__ import annotations

import logging
import sys
import warnings
from dataclasses import fields
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, ExportableState

from ...core.plan import Plan, saved_plans
from ...runtime.installing.fingerprint import made_for_other
from ..accelerate.accelerator import prepare_remat, remat_session
from ..accelerate.plugin import ENV_BUDGET, LoopFacts, RematPlugin
from ..accelerate.session import RematSession

logger = logging.getLogger(__name__)


class RematTrainerCallback(TrainerCallback, ExportableState):
    """Keep every training step of a Hugging Face ``Trainer`` within a memory budget. The arguments are
    ``RematPlugin``'s; ``plan`` and ``metrics`` (also in the Trainer's logs); the plans go into its checkpoints
    (docs/accelerate.md, "The Hugging Face Trainer").

    >>> callback = RematTrainerCallback(budget="2GB")   # trainer = Trainer(..., callbacks=[callback])
    >>> callback.remat_plugin.budget, callback.state()["attributes"]   # a checkpoint keeps the plans: none yet
    ('2GB', {'remat_plans': {'plan': None, 'plans': []}})
    """

    def __init__(self, budget: str | int | None = None, profile_steps: int | None = None, candidates: Any = None,
                 cost: str | None = None, offload: Any = None, policies: Any = None, chunk_loss: Any = None) -> None:
        self.remat_plugin = RematPlugin(budget=budget, profile_steps=profile_steps, candidates=candidates, cost=cost,
                                        offload=offload, policies=policies, chunk_loss=chunk_loss)
        self.session: RematSession | None = None
        self.metrics: dict[str, float] = {}
        self._pending: dict[str, float] = {}  # figures not yet in a Trainer log: merged into the next one
        self._run_state: Any = None  # the TrainerState of the train() call begun (its first step)

    @property
    def plan(self) -> Any:
        """The applied ``Plan`` (None before it is made)."""
        return self.session.plan if self.session is not None else None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if not self.remat_plugin.enabled:
            warnings.warn(f"RematTrainerCallback: no budget given and {ENV_BUDGET} is not set; recomputing nothing.",
                          UserWarning, stacklevel=2)
            return
        if model is None:
            return
        from accelerate.state import AcceleratorState
        from tqdm.auto import tqdm

        # The Trainer switches its checkpointing on in train(), before this hook: prepare_remat turns it off.
        prepare_remat(model, self.remat_plugin, loop=LoopFacts(
            optimizers=lambda: [optimizer] if optimizer is not None else [], state=AcceleratorState(), show=tqdm.write,
            accumulation=lambda: max(1, int(args.gradient_accumulation_steps)), who=type(self).__name__))
        self.session = remat_session(model)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is not None and self._run_state is not state:  # the first step of a train() call
            self._run_state = state
            LogFigures.place(LogFigures.handler_calling(), self._pending)
            plans = checkpoint_plans(state, type(self).__name__, self.session.model)
            if plans:
                self.session.resume(plans)
        # Every optimizer step runs under the plan as planned: checked, never assumed.
        if self.session is not None:
            self.session.check_plan(f"(RematTrainerCallback, step {state.global_step})")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._log_new_figures(state) and str(getattr(args.logging_strategy, "value", args.logging_strategy)) != "no":
            control.should_log = True  # the Trainer logs this step, and its reporters get them (``LogFigures``)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._log_new_figures(state)

    def state(self) -> dict:
        """What the Trainer's checkpoint keeps (``ExportableState``): the settings, and the plans in ``AutoRemat``'s
        format (the latest, and one per batch shape)."""
        plans = self.session.run.state_dict() if self.session is not None else {"plan": None, "plans": []}
        return {"args": plugin_args(self.remat_plugin), "attributes": {"remat_plans": plans}}

    def _log_new_figures(self, state: Any) -> bool:
        """Append the session's new figures to the log history and the next log; whether any."""
        figures = self.session.metrics if self.session is not None else {}
        new = {k: v for k, v in figures.items() if self.metrics.get(k) != v}
        if not new:
            return False
        self.metrics.update(new)
        self._pending.update(new)
        state.log_history.append({**new, "step": state.global_step})
        if state.is_world_process_zero:
            logger.info("RematTrainerCallback: %s", ", ".join(f"{k}={v:g}" for k, v in new.items()))
        return True


class LogFigures(TrainerCallback):
    """First among the Trainer's callbacks, so its ``on_log`` adds ``figures`` before the reporters read the logs.

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
        """The ``CallbackHandler`` calling the hook that calls this: the Trainer gives a callback no handle on it."""
        frame = sys._getframe(2)
        handler = frame.f_locals.get("self") if frame is not None else None
        return handler if isinstance(handler, CallbackHandler) else None

    @classmethod
    def place(cls, handler: Any, figures: dict[str, float]) -> bool:
        """Put a ``LogFigures`` first among ``handler``'s callbacks (once); whether it is there."""
        if handler is None:
            warnings.warn("RematTrainerCallback: not called by the Trainer's CallbackHandler; its remat/* figures "
                          "reach trainer.state.log_history only, not the report_to trackers", UserWarning, stacklevel=2)
            return False
        if not any(isinstance(cb, cls) and cb.figures is figures for cb in handler.callbacks):
            # A new list: the event being called iterates the old one to its end.
            handler.callbacks = [cls(figures), *handler.callbacks]
        return True


def plugin_args(plugin: RematPlugin) -> dict[str, Any]:
    """JSON-safe arguments for ``RematTrainerCallback(**args)`` (how the Trainer remakes it): the plugin's checked
    fields are text, numbers and flags, but a module class among ``candidates`` goes by its name.

    >>> from torch import nn
    >>> plugin_args(RematPlugin(budget="1GB", candidates=[nn.Linear, "h.*"]))["candidates"]
    ['Linear', 'h.*']
    """
    args = {f.name: getattr(plugin, f.name) for f in fields(plugin)}
    if plugin.candidates is not None:
        args["candidates"] = [c.__name__ if isinstance(c, type) else c for c in plugin.candidates]
    return args


def checkpoint_plans(state: Any, name: str, model: Any) -> dict[Any, Plan]:
    """The plans per shape the Trainer's state keeps for callback ``name``; empty if none or another model's.

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
                      UserWarning, stacklevel=2)
        return {}
    return dict(plans)
