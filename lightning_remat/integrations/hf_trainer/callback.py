"""``RematTrainerCallback``: the Hugging Face ``Trainer`` keeps each training step under a memory budget. The
Trainer's own ``Accelerator`` is never given to a callback: it hands the model, with what it knows of the loop
(``LoopFacts``), to the Accelerate session at ``on_train_begin``."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..accelerate.accelerator import prepare_remat, remat_session
from ..accelerate.plugin import ENV_BUDGET, LoopFacts, RematPlugin
from ..accelerate.session import RematSession
from .reporting import LogFigures, checkpoint_plans, console, plugin_args, saved_state

logger = logging.getLogger(__name__)


class RematTrainerCallback(TrainerCallback, ExportableState):
    """Recompute the cheapest set of modules so that every training step of a Hugging Face ``Trainer`` stays
    within a memory budget. The arguments are ``RematPlugin``'s (from ``ACCELERATE_REMAT_*`` when not given;
    with no budget it warns and does nothing). ``callback.plan``, ``callback.metrics``: the plan and the
    ``remat/...`` figures, also sent with the Trainer's logs; the plans go into its checkpoints. What it
    does, refuses and takes over: docs/accelerate.md, "The Hugging Face Trainer".

    Example:
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

        # The Trainer's Accelerator is never given: its process state (a singleton), accumulation and optimizer are.
        # It switches its checkpointing on in train(), before this hook: prepare_remat turns it off, said once.
        prepare_remat(model, self.remat_plugin, loop=LoopFacts(
            optimizers=lambda: [optimizer] if optimizer is not None else [], state=AcceleratorState(),
            accumulation=lambda: max(1, int(args.gradient_accumulation_steps)), show=console, who=type(self).__name__))
        self.session = remat_session(model)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is not None and self._run_state is not state:
            self._begin_run(state, LogFigures.handler_calling())
        # Every optimizer step runs under the plan as planned: checked, never assumed.
        if self.session is not None:
            self.session.check_plan(f"(RematTrainerCallback, step {state.global_step})")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._log_new_figures(state) and str(getattr(args.logging_strategy, "value", args.logging_strategy)) != "no":
            control.should_log = True  # the Trainer logs this step, and its reporters get them (``LogFigures``)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._log_new_figures(state)

    def state(self) -> dict:
        """What the Trainer's checkpoint keeps of the callback (``ExportableState``): its settings and its plans."""
        return {"args": plugin_args(self.remat_plugin), "attributes": {"remat_plans": saved_state(self.session)}}

    def _begin_run(self, state: Any, handler: Any) -> None:
        """The first step of a ``train()`` call: place ``LogFigures``; take a resumed checkpoint's plans."""
        self._run_state = state
        LogFigures.place(handler, self._pending)
        plans = checkpoint_plans(state, type(self).__name__, self.session.model)
        if plans:
            self.session.resume(plans)

    def _log_new_figures(self, state: Any) -> bool:
        """Append the session's new figures to the log history and keep them for the next log; whether any."""
        if self.session is None:
            return False
        new = {k: v for k, v in self.session.metrics.items() if self.metrics.get(k) != v}
        if not new:
            return False
        self.metrics.update(new)
        self._pending.update(new)
        state.log_history.append({**new, "step": state.global_step})
        if state.is_world_process_zero:
            logger.info("RematTrainerCallback: %s", ", ".join(f"{k}={v:g}" for k, v in new.items()))
        return True
