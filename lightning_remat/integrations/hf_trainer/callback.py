"""``RematTrainerCallback``: the Hugging Face ``Trainer`` keeps each training step under a memory budget.

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[RematTrainerCallback(budget="10GB")])

The Trainer builds its own ``Accelerator``, which a callback is never given, so ``RematAccelerator``
and ``ACCELERATE_REMAT_BUDGET`` alone do not reach it. The callback hands the Trainer's model, with
what it knows of the loop (``LoopFacts``: the optimizer, the accumulation, the processes), to the
Accelerate session (``prepare_remat``) at ``on_train_begin``, before the first training forward;
the session then runs on the Trainer's loop as on any Accelerate loop (the class says what it does).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..accelerate.accelerator import _check_supported, prepare_remat, remat_session
from ..accelerate.plugin import ENV_BUDGET, LoopFacts, RematPlugin
from ..accelerate.session import RematSession
from ...runtime.installing.takeover import take_over_checkpointing
from .reporting import LogFigures, checkpoint_plans, console, plugin_args, saved_state

logger = logging.getLogger(__name__)


class RematTrainerCallback(TrainerCallback, ExportableState):
    """Recompute the cheapest set of modules so that every training step of a Hugging Face
    ``Trainer`` stays within a memory budget.

    Every argument is a ``RematPlugin`` field, read from its ``ACCELERATE_REMAT_*`` environment
    variable when not given (an explicit value wins). The first training forward is planned before
    it runs, on fake tensors, and the plan applied in place (parameter names and ``state_dict`` keys
    do not change, so checkpoints load with or without it); the first ``profile_steps`` optimizer
    steps run under it and are observed (their forward inputs and the loss the model returned), the
    plan is made again from them, and the next step is measured. The figures
    (``remat/budget_bytes``, ``remat/baseline_peak_bytes``, ``remat/predicted_peak_bytes``,
    ``remat/predicted_overhead``, ``remat/num_checkpointed``, ``remat/num_plans``, then
    ``remat/measured_peak_bytes``) are appended to ``trainer.state.log_history`` at the end of the step
    where they became known, kept in ``callback.metrics``, and sent with the Trainer's log of that step
    to whatever ``report_to`` names; the plan and the measured line are printed on the main process;
    ``callback.plan`` is the plan. The plans are saved in the Trainer's checkpoints
    (``trainer_state.json``): ``train(resume_from_checkpoint=...)`` installs them without profiling.

    Args:
        budget: peak memory of a whole training step (parameters, gradients, optimizer state,
            activations, temporaries): ``"10GB"``, ``"10 GiB"``, an int of bytes, ``"80%"`` of the
            device's memory, or ``"min"``. Env: ``ACCELERATE_REMAT_BUDGET``. With neither, the
            callback warns and does nothing.
        profile_steps: optimizer steps observed before the plan is applied (>= 1). Env:
            ``ACCELERATE_REMAT_PROFILE_STEPS``. Default 1.
        candidates: module classes or name patterns to choose among (``"GPT2Block"``); None for
            the repeated blocks. Env: ``ACCELERATE_REMAT_CANDIDATES``.
        cost: ``"flops"`` (default), ``"time"`` or ``"roofline"``. Env: ``ACCELERATE_REMAT_COST``.
        offload: also offload activations to host memory (a CUDA model). Env: ``ACCELERATE_REMAT_OFFLOAD``.
        policies: op-level selective-checkpointing policies to offer. Env: ``ACCELERATE_REMAT_POLICIES``.
        chunk_loss: let the plan compute a causal LM's head and loss over sequence chunks (the model
            then returns ``logits=None``; ``docs/long_context.md``). Env: ``ACCELERATE_REMAT_CHUNK_LOSS``.

    Behaviour worth knowing (``docs/accelerate.md``, "The Hugging Face Trainer", says each): a
    malformed setting fails here; a budget no plan meets fails at the first training forward;
    DeepSpeed, FSDP1 and ``torch_compile=True`` are refused at ``on_train_begin``, as is a second
    callback for the same model with other settings. ``gradient_checkpointing=True`` (TRL's default) is
    turned off there, with one warning that says so, and the plan recomputes instead.

    Example:
        >>> import os
        >>> os.environ["ACCELERATE_REMAT_BUDGET"] = "2GB"
        >>> callback = RematTrainerCallback()        # the budget from the environment
        >>> callback.remat_plugin.budget, callback.remat_plugin.profile_steps
        ('2GB', 1)
        >>> RematTrainerCallback(budget="min", cost="flops").remat_plugin.budget   # an explicit value wins
        'min'
        >>> del os.environ["ACCELERATE_REMAT_BUDGET"]
        >>> RematTrainerCallback(budget="ten")
        Traceback (most recent call last):
        ...
        ValueError: lightning-remat: invalid RematPlugin(budget='ten'): Invalid memory budget 'ten': ...
        >>> trainer = Trainer(model, args, train_dataset=data, callbacks=[RematTrainerCallback(budget="10GB")])  # doctest: +SKIP
        >>> RematTrainerCallback(budget="1GB").state()["attributes"]   # what a checkpoint keeps: the plans, none yet
        {'remat_plans': {'plan': None, 'plans': []}}
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

        # The Trainer's own Accelerator is never given to a callback: its process state (a singleton), its
        # accumulation and its optimizer (None when made later, under FSDP: found at its first step) are.
        state = AcceleratorState()
        _check_supported(state)
        # The Trainer switches its own checkpointing on in train(), before this hook (TRL's SFTConfig by default):
        # turned off here, said in one line on the main process, and the plan recomputes instead.
        took_over = take_over_checkpointing(model, "RematTrainerCallback")
        if took_over and state.is_main_process:
            warnings.warn(took_over, UserWarning, stacklevel=2)
        prepare_remat(model, self.remat_plugin, loop=LoopFacts(
            optimizers=lambda: [optimizer] if optimizer is not None else [], processes=lambda: state.num_processes,
            accumulation=lambda: max(1, int(args.gradient_accumulation_steps)), show=console))
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
        """What the Trainer keeps of the callback in a checkpoint (``ExportableState``, in
        ``trainer_state.json``): its settings, and the plans (one per batch shape) as ``AutoRemat`` keeps them."""
        return {"args": plugin_args(self.remat_plugin), "attributes": {"remat_plans": saved_state(self.session)}}

    def _begin_run(self, state: Any, handler: Any) -> None:
        """The first step of a ``train()`` call: the figures join the Trainer's logs before its reporters
        read them, and a checkpoint's plans (a resumed run) are taken, not profiled again."""
        self._run_state = state
        LogFigures.place(handler, self._pending)
        plans = checkpoint_plans(state, type(self).__name__, self.session.model)
        if plans:
            self.session.resume(plans)

    def _log_new_figures(self, state: Any) -> bool:
        """Append the figures the session found since the last call to the Trainer's log history, and
        keep them for the Trainer's next log; whether there were any."""
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
