"""Accelerate integration: recompute the optimal set of modules in an unchanged training loop.

Accelerate does not let third parties add keys to its config file or to ``kwargs_handlers``, but
``accelerate launch`` passes the environment through. So the switch is an environment variable,
read by ``RematPlugin`` in the style of Accelerate's own plugins::

    ACCELERATE_REMAT_BUDGET=200MB accelerate launch train.py

and the script uses ``RematAccelerator`` instead of ``Accelerator`` (or keeps the stock
``Accelerator`` and calls ``prepare_remat(model, accelerator=accelerator)``). Nothing else in the
loop changes.

How it works, per model (``RematSession``):

1. The first ``profile_steps`` training steps run as written. Hooks on the model record the inputs
   of each training forward and, during the user's backward, the gradient that reached each output.
2. At the end of step ``profile_steps`` (the matching optimizer's ``step``, or else the next training
   forward) ``profile_step`` profiles the recorded call, ``solve`` picks the least-cost plan within
   the budget, and ``apply_plan`` wraps the chosen modules in place. With several processes the
   main process decides and broadcasts the plan, so every rank wraps the same modules.
3. The next step is measured (``MemTracker`` on a CPU, ``max_memory_allocated`` on CUDA) and the
   figures go to ``accelerator.log`` under ``remat/...`` and to ``accelerator.remat_metrics``.

The loss. The loss is usually computed outside the model (``criterion(model(x), y)``), where no
hook can see it. The profile therefore re-runs the recorded call and builds its loss from what the
user's backward did:

- if the model returned a scalar loss (a scalar tensor, or Hugging Face outputs with ``.loss``)
  and the user's backward went through it, that loss is used;
- otherwise the loss is the surrogate ``sum((output * grad_output).sum())`` over the outputs that
  received a gradient, with ``grad_output`` the gradient the user's real loss sent into each output.
  Its gradient with respect to every output equals the real one, so the model's backward (what
  recomputation changes) is the same as in training; only the user's loss function itself, outside
  the model, is stood in for by one product of the outputs' size.

Supported: one process, and DDP (multi-GPU, multi-CPU). Not supported: FSDP, DeepSpeed, Megatron-LM,
XLA and ``torch.compile`` through Accelerate (a plan needs the whole unsharded model on one device
to profile); ``RematAccelerator`` and ``prepare_remat`` raise at start for those.
"""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from accelerate import Accelerator
from torch import nn

from .apply import AlreadyCheckpointedError, apply_plan, existing_checkpointing
from .budget import MIN_BUDGET, format_bytes, parse_budget
from .candidates import find_stages
from .measure import PeakWindow, is_out_of_memory, model_device
from .memory_model import COST_KINDS, Profile, Segment, predict_peak
from .plan import Plan

logger = logging.getLogger(__name__)

ENV_BUDGET = "ACCELERATE_REMAT_BUDGET"
ENV_PROFILE_STEPS = "ACCELERATE_REMAT_PROFILE_STEPS"
ENV_CANDIDATES = "ACCELERATE_REMAT_CANDIDATES"
ENV_COST = "ACCELERATE_REMAT_COST"

METRIC_NAMES = (
    "remat/budget_bytes",
    "remat/baseline_peak_bytes",
    "remat/predicted_peak_bytes",
    "remat/measured_peak_bytes",
    "remat/predicted_overhead",
    "remat/num_checkpointed",
)

_UNSUPPORTED = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")


@dataclass
class RematPlugin:
    """Settings of automatic recomputation under Accelerate, read from the environment when not given.

    Every field left ``None`` is read from an environment variable, which ``accelerate launch``
    passes through to every process; an explicit value wins over the environment.

    Args:
        budget: peak memory of a training step on the model's device, as ``parse_budget`` accepts:
            ``"10GB"``, ``"10 GiB"``, an int of bytes, ``"80%"`` of the device's total memory (on a CPU,
            of the host's memory), or ``"min"``. Env: ``ACCELERATE_REMAT_BUDGET``. Recomputation is
            enabled if and only if a budget is set.
        profile_steps: training steps run as written, and observed, before the plan is made and
            applied (at least 1: the recorded call needs one real backward). Env:
            ``ACCELERATE_REMAT_PROFILE_STEPS``. Default 1.
        candidates: which modules may be recomputed: None for automatic (repeated blocks), or module
            classes, class names or ``fnmatch`` patterns over module names; a string is split at
            commas. Env: ``ACCELERATE_REMAT_CANDIDATES`` (comma-separated, e.g. ``"GPT2Block"`` or
            ``"transformer.h.*"``).
        cost: what the plan minimises: ``"time"`` (measured seconds) or ``"flops"`` (counted FLOPs,
            deterministic). Env: ``ACCELERATE_REMAT_COST``. Default ``"time"``.

    Raises:
        ValueError: a malformed value; the message names the environment variable (or the field)
            it came from, and what is accepted.

    Example:
        >>> plugin = RematPlugin(budget="10GB", candidates="GPT2Block, transformer.h.*")
        >>> plugin.enabled, plugin.profile_steps, plugin.candidates, plugin.cost
        (True, 1, ['GPT2Block', 'transformer.h.*'], 'time')
    """

    budget: str | int | None = field(
        default=None, metadata={"help": f"Peak memory of a training step, e.g. '10GB' or 'min'. Env: {ENV_BUDGET}."})
    profile_steps: int | None = field(
        default=None, metadata={"help": f"Steps observed before the plan is applied (>= 1). Env: {ENV_PROFILE_STEPS}."})
    candidates: Any = field(
        default=None, metadata={"help": f"Module classes or name patterns to choose among. Env: {ENV_CANDIDATES}."})
    cost: str | None = field(
        default=None, metadata={"help": f"'time' or 'flops': what the plan minimises. Env: {ENV_COST}."})

    def __post_init__(self):
        sources: dict[str, str] = {}

        def from_env(name: str, variable: str) -> None:
            if getattr(self, name) is None:
                value = os.environ.get(variable, "").strip()
                if value:
                    setattr(self, name, value)
                    sources[name] = variable

        from_env("budget", ENV_BUDGET)
        from_env("profile_steps", ENV_PROFILE_STEPS)
        from_env("candidates", ENV_CANDIDATES)
        from_env("cost", ENV_COST)

        def origin(name: str) -> str:
            value = getattr(self, name)
            if name in sources:
                return f"{sources[name]}={value!r}"
            return f"RematPlugin({name}={value!r})"

        if self.budget is not None:
            if isinstance(self.budget, str):
                self.budget = self.budget.strip()
            try:
                parse_budget(self.budget)
            except ValueError as err:
                raise ValueError(f"lightning-remat: invalid {origin('budget')}: {err}") from None

        if self.profile_steps is None:
            self.profile_steps = 1
        else:
            try:
                steps = int(str(self.profile_steps).strip()) if not isinstance(self.profile_steps, bool) else None
            except ValueError:
                steps = None
            if steps is None or steps < 1 or str(steps) != str(self.profile_steps).strip():
                raise ValueError(f"lightning-remat: invalid {origin('profile_steps')}: expected a whole number of "
                                 "training steps, at least 1")
            self.profile_steps = steps

        if isinstance(self.candidates, str):
            names = [part.strip() for part in self.candidates.split(",") if part.strip()]
            if not names:
                raise ValueError(f"lightning-remat: invalid {origin('candidates')}: expected comma-separated module "
                                 "class names or name patterns, such as 'GPT2Block' or 'transformer.h.*'")
            self.candidates = names
        elif isinstance(self.candidates, type):
            self.candidates = [self.candidates]
        elif self.candidates is not None:
            self.candidates = list(self.candidates)
            bad = [c for c in self.candidates if not isinstance(c, (str, type))]
            if bad or not self.candidates:
                raise ValueError(f"lightning-remat: invalid {origin('candidates')}: expected module classes, class "
                                 "names or name patterns")

        if self.cost is None:
            self.cost = "time"
        else:
            cost = str(self.cost).strip().lower()
            if cost not in COST_KINDS:
                raise ValueError(f"lightning-remat: invalid {origin('cost')}: expected one of {list(COST_KINDS)}")
            self.cost = cost

    @property
    def enabled(self) -> bool:
        """Whether recomputation is on: a budget is set."""
        return self.budget is not None

    def budget_bytes(self, device: Any = None) -> int | str:
        """The budget in bytes on ``device`` (a percentage refers to its total memory), or ``"min"``."""
        return parse_budget(self.budget, device=device)


# --------------------------------------------------------------------------------------------
# Observing the user's loop


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    """Tensors in an output (tensor, tuple/list, dict, Hugging Face ``ModelOutput``), in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensor_leaves(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensor_leaves(v)]
    return []


def _scalar_loss(output: Any) -> torch.Tensor | None:
    """The loss a model returned itself: a scalar tensor, or the ``loss`` of Hugging Face outputs."""
    candidate = output
    if not isinstance(output, torch.Tensor):
        candidate = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(candidate, torch.Tensor) and candidate.dim() == 0 and candidate.is_floating_point():
        return candidate
    return None


@dataclass
class _RecordedCall:
    """One training forward: its inputs and what the user's backward did with its outputs."""

    args: tuple
    kwargs: dict
    loss_index: int | None = None  # position of the model's own loss among the output tensors
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # output position -> gradient it received
    backward_ran: bool = False
    used_model_loss: bool = False

    def on_grad(self, index: int, grad: torch.Tensor) -> None:
        self.backward_ran = True
        if index == self.loss_index:
            # The loss is the root of the backward: its gradient arrives first. The outputs it was
            # computed from (logits) are then covered by re-running the model's own loss.
            self.used_model_loss = True
            self.grads.clear()
        elif not self.used_model_loss:
            self.grads[index] = grad.detach()

    def loss(self, model: nn.Module) -> torch.Tensor:
        """Re-run the call on ``model`` and return the loss the profile backpropagates."""
        output = model(*self.args, **self.kwargs)
        if self.used_model_loss:
            loss = _scalar_loss(output)
            if loss is None:
                raise RuntimeError("the model returned a loss when it was observed, and none when re-run")
            return loss
        leaves = _tensor_leaves(output)
        terms = [(leaves[i] * grad.to(leaves[i].dtype)).sum().float() for i, grad in self.grads.items()]
        return terms[0] if len(terms) == 1 else torch.stack(terms).sum()


class _WindowTracker(PeakWindow):
    """A ``PeakWindow`` that also remembers the optimizer's state at its start and the peak before
    the optimizer stepped (both feed the calibration of an observed step)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        super().__init__(model, optimizer)
        # A first step creates the optimizer's state only at its end: its forward and backward ran
        # without the state that every later step holds.
        self.optimizer_had_state = optimizer is not None and bool(optimizer.state)
        self.peak_before_optimizer: int | None = None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def _is_main_process() -> bool:
    return not _distributed() or torch.distributed.get_rank() == 0


def _calibrate(profile: Profile, observed_peak: int, optimizer_had_state: bool = True) -> Profile:
    """Account for what the profile cannot re-run: the user's code around the model (its loss).

    The profile re-runs the model with a stand-in loss; the observed step ran the real one.
    ``observed_peak`` is the peak of the observed step's forward and backward (before the optimizer
    step); on a first step the optimizer state did not exist yet, and is added. When that is
    higher than the profile predicts for forward and backward, the excess is charged to the point
    where the user's loss runs: the end of forward / start of backward, with every stage's stored
    bytes alive. The baseline then predicts the observed step, and a plan that frees stored bytes
    is credited for it only where that really lowers the peak.
    """
    if not profile.stages:
        return profile
    if not optimizer_had_state:
        observed_peak += profile.optimizer_state_bytes
    # The profile's own forward/backward prediction: without the optimizer-step segment.
    model_only = replace(profile, segments=tuple(s for s in profile.segments if s.name != "optimizer step"))
    predicted = predict_peak(model_only, [0] * len(profile.stages))
    if observed_peak <= predicted:
        return profile
    stored = sum(stage.options[0].stored_bytes for stage in profile.stages)
    outside = Segment("outside the model (the loss)", len(profile.stages), observed_peak - stored)
    note = (f"the observed training step peaked {format_bytes(observed_peak - predicted)} above the profile of the "
            "model alone (code outside the model, such as the loss); counted at the end of forward")
    notes = (*profile.notes, note) if observed_peak - predicted > predicted // 200 else profile.notes
    calibrated = replace(profile, segments=(*profile.segments, outside), notes=notes)
    calibrated.baseline_peak_bytes = predict_peak(calibrated, [0] * len(profile.stages))
    return calibrated


class RematSession:
    """Observe a model in the user's loop, then plan, apply and measure recomputation once.

    Made by ``prepare_remat`` (and so by ``RematAccelerator``); get it back with
    ``remat_session(model)``. Phases: ``"observe"`` (the first ``profile_steps`` steps), ``"measure"``
    (the first step with the plan), ``"done"``.

    Attributes:
        plan: the applied ``Plan`` (None until it is made).
        metrics: ``remat/...`` figures, as logged (``remat/measured_peak_bytes`` once measured).
        observed_steps: training steps (forward and backward) seen so far.

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)) for _ in range(4)])
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> session = remat_session(prepare_remat(net, RematPlugin(budget="min", cost="flops")))
        >>> for _ in range(3):
        ...     net(torch.randn(64, 32)).pow(2).mean().backward()
        ...     opt.step()
        ...     opt.zero_grad()
        >>> session.phase, session.plan.checkpointed
        ('done', ['0', '1', '2', '3'])
        >>> session.metrics["remat/measured_peak_bytes"] == session.metrics["remat/predicted_peak_bytes"]
        True
    """

    def __init__(self, model: nn.Module, plugin: RematPlugin, accelerator: Accelerator | None = None):
        self.model = model
        self.plugin = plugin
        self.accelerator = accelerator
        self.plan: Plan | None = None
        self.metrics: dict[str, float] = {}
        self.phase = "observe"
        self.observed_steps = 0
        self._parameter_ids = {id(p) for p in model.parameters()}
        self._optimizer: torch.optim.Optimizer | None = None
        self._current: _RecordedCall | None = None  # the latest training forward
        self._completed: _RecordedCall | None = None  # the latest one whose backward ran
        self._window: _WindowTracker | None = None
        self._window_backward_ran = False
        self._observed: tuple[int, bool] | None = None  # last observed step: (forward/backward peak, had state)
        self._busy = False
        self._hooked_optimizers: set[int] = set()
        self._handles = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
            # Finds the optimizer when it first steps, if no accelerator told us about it.
            register_optimizer_step_post_hook(self._discover_optimizer),
        ]

    # -- hooks -----------------------------------------------------------------------------
    # torch iterates an optimizer's own step hooks, then the global ones, and forbids changing
    # either set while it iterates it. Profiling (MemTracker) adds and removes global hooks, so
    # the step boundary work runs in a per-optimizer hook, and hooks are removed only from a
    # forward pre-hook (or by ``remove()`` outside a step).

    def _training_call(self, module: nn.Module) -> bool:
        return not self._busy and module.training and torch.is_grad_enabled()

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.phase == "done":
            self.remove()
            return
        if not self._training_call(module):
            return
        self._hook_optimizer(self._known_optimizer())
        self._step_boundary(optimizer_stepped=False)
        if self.phase == "observe":
            self._current = _RecordedCall(args=args, kwargs=dict(kwargs))
        if self.phase in ("observe", "measure"):
            self._open_window()

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._training_call(module):
            return
        leaves = _tensor_leaves(output)
        if self.phase == "observe" and self._current is not None:
            call = self._current
            loss = _scalar_loss(output)
            call.loss_index = next((i for i, t in enumerate(leaves) if t is loss), None)
            for i, tensor in enumerate(leaves):
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad, i=i, call=call: call.on_grad(i, grad))
        elif self.phase == "measure":
            for tensor in leaves:
                if tensor.requires_grad:
                    tensor.register_hook(self._window_backward)
                    break

    def _window_backward(self, grad: torch.Tensor) -> None:
        self._window_backward_ran = True

    def _discover_optimizer(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.phase != "done" and not self._busy and self._holds_model_parameters(optimizer):
            self._hook_optimizer(optimizer)

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is None or id(optimizer) in self._hooked_optimizers:
            return
        self._optimizer = optimizer
        self._hooked_optimizers.add(id(optimizer))
        self._handles.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
        self._handles.append(optimizer.register_step_post_hook(self._after_optimizer_step))

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._busy and self.phase == "observe" and self._window is not None:
            self._window.peak_before_optimizer = self._window.peak()

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._busy or self.phase == "done":
            return
        self._step_boundary(optimizer_stepped=True)

    # -- the state machine -------------------------------------------------------------------

    def _holds_model_parameters(self, optimizer: Any) -> bool:
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            return False  # a wrapper (Accelerate's AcceleratedOptimizer): its inner optimizer reports the step
        return any(id(p) in self._parameter_ids for group in optimizer.param_groups for p in group["params"])

    def _known_optimizer(self) -> torch.optim.Optimizer | None:
        if self._optimizer is not None:
            return self._optimizer
        for optimizer in getattr(self.accelerator, "_optimizers", []) or []:
            inner = getattr(optimizer, "optimizer", optimizer)
            if isinstance(inner, torch.optim.Optimizer) and self._holds_model_parameters(inner):
                return inner
        return None

    def _step_boundary(self, optimizer_stepped: bool) -> None:
        """Between two steps: count the step that ended, and plan or finish measuring when due."""
        if self.phase == "observe":
            if self._current is not None and self._current.backward_ran:
                self._completed, self._current = self._current, None
                self.observed_steps += 1
                if self._window is not None:
                    window, self._window = self._window, None
                    peak = window.close()
                    # Without an optimizer pre-step hook in this step, the whole step's peak stands in
                    # for that of forward and backward (an over-estimate: the plan errs on the safe side).
                    before = window.peak_before_optimizer
                    self._observed = (peak if before is None else before, window.optimizer_had_state)
            if self.observed_steps >= self.plugin.profile_steps and self._completed is not None:
                self._make_plan()
                self.phase = "measure"
                self._window_backward_ran = False
        elif self.phase == "measure" and self._window_backward_ran:
            # The measured step ends with the optimizer step; without a known optimizer, at the
            # next forward.
            if optimizer_stepped or self._known_optimizer() is None:
                self.observed_steps += 1
                self._finish_measurement()

    def _open_window(self) -> None:
        """Measure the step that starts now: the observed ones calibrate the plan, the next checks it."""
        if self._window is None and _is_main_process():
            self._window = _WindowTracker(self.model, self._known_optimizer())

    def _make_plan(self) -> None:
        call, self._completed = self._completed, None
        optimizer = self._known_optimizer()
        plan = None
        error = None
        if _is_main_process():
            self._busy = True
            try:
                plan = self._solve(call, optimizer)
            except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks are told
                if is_out_of_memory(err):
                    plan = self._fallback_plan(err)
                else:
                    error = err
            finally:
                self._busy = False
        if _distributed():
            from accelerate.utils import broadcast_object_list

            payload = [plan.to_dict() if plan is not None else None,
                       f"{type(error).__name__}: {error}" if error is not None else None]
            broadcast_object_list(payload, from_process=0)
            if error is None and payload[1] is not None:
                raise RuntimeError(f"lightning-remat: planning failed on the main process: {payload[1]}")
            if plan is None and payload[0] is not None:
                plan = Plan.from_dict(payload[0])
        if error is not None:
            raise error
        apply_plan(self.model, plan)
        self.plan = plan
        self.metrics.update({
            "remat/budget_bytes": plan.budget_bytes,
            "remat/baseline_peak_bytes": plan.baseline_peak_bytes,
            "remat/predicted_peak_bytes": plan.predicted_peak_bytes,
            "remat/predicted_overhead": plan.predicted_overhead,
            "remat/num_checkpointed": len(plan.checkpointed),
        })
        if self.accelerator is not None:
            self.accelerator.remat_plan = plan
        if _is_main_process():
            logger.info("lightning-remat applied after %d step(s):\n%s", self.observed_steps, plan.summary())
        self._log(dict(self.metrics))

    def _solve(self, call: _RecordedCall, optimizer: torch.optim.Optimizer | None) -> Plan:
        from .profile import profile_step
        from .solve import solve

        budget = self.plugin.budget_bytes(model_device(self.model))
        # The observed steps were the warm-up: lazy initialisation has happened.
        profile = profile_step(self.model, call.loss, optimizer=optimizer, warmup=0, candidates=self.plugin.candidates)
        if self._observed is not None:
            profile = _calibrate(profile, *self._observed)
        plan = solve(profile, budget, cost=self.plugin.cost)
        plan.requested_budget = str(self.plugin.budget)
        return plan

    def _fallback_plan(self, err: BaseException) -> Plan:
        """Profiling ran out of memory: recompute every stage, the plan most likely to fit."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        stages = find_stages(self.model, self.plugin.candidates)
        budget = self.plugin.budget_bytes(model_device(self.model))
        note = f"profiling ran out of memory ({type(err).__name__}); every stage is recomputed"
        warnings.warn(f"lightning-remat: {note}", RuntimeWarning, stacklevel=2)
        return Plan(checkpointed=stages, budget_bytes=budget if budget != MIN_BUDGET else 0, baseline_peak_bytes=0,
                    predicted_peak_bytes=0, predicted_overhead=float("nan"), cost_kind=self.plugin.cost,
                    requested_budget=str(self.plugin.budget), notes=[note])

    def _finish_measurement(self) -> None:
        window, self._window = self._window, None
        if window is None:  # not the main process: it only follows the main process's plan
            self.phase = "done"
            return
        self.metrics["remat/measured_peak_bytes"] = window.close()
        self.phase = "done"  # the hooks are removed at the next forward (not from inside a step hook)
        if _is_main_process():
            logger.info("lightning-remat: measured peak of the first step with the plan: %d bytes",
                        self.metrics["remat/measured_peak_bytes"])
        self._log({"remat/measured_peak_bytes": self.metrics["remat/measured_peak_bytes"]})

    def _log(self, values: dict[str, float]) -> None:
        if self.accelerator is not None and getattr(self.accelerator, "trackers", None):
            self.accelerator.log(values, step=self.observed_steps)

    def remove(self) -> None:
        """Stop observing (the plan, if applied, stays: ``remove_remat(model)`` undoes it).

        Call it between steps, not from inside an optimizer step hook.
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._window is not None:
            self._window.abandon()
            self._window = None


_SESSIONS: "weakref.WeakKeyDictionary[nn.Module, RematSession]" = weakref.WeakKeyDictionary()


def _check_supported(accelerator: Accelerator) -> None:
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)).upper()
    if kind in _UNSUPPORTED:
        raise NotImplementedError(
            f"lightning-remat does not support Accelerate's {kind} mode: a plan is made by profiling the whole "
            "unsharded model on one device. Use one process or DDP, or make a plan with lightning_remat.plan_remat "
            f"on one device, apply it with apply_plan before accelerator.prepare, and unset {ENV_BUDGET}."
        )
    dynamo = getattr(getattr(accelerator.state, "dynamo_plugin", None), "backend", None)
    if dynamo is not None and str(getattr(dynamo, "value", dynamo)).upper() != "NO":
        raise NotImplementedError("lightning-remat does not support torch.compile through Accelerate (dynamo_backend); "
                                  f"unset {ENV_BUDGET} or the dynamo backend")


def _inner_model(model: nn.Module) -> nn.Module:
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_fp32_wrapper=True)


def prepare_remat(model: nn.Module, plugin: RematPlugin | None = None,
                  accelerator: Accelerator | None = None) -> nn.Module:
    """Make ``model`` recompute the optimal set of modules within the budget, from its next steps on.

    Use it with the stock ``Accelerator`` (``RematAccelerator`` calls it for you in ``prepare``).
    Call it before or after ``accelerator.prepare``; the training loop stays as it is. The first
    ``plugin.profile_steps`` training steps are observed, the plan is made and applied in place at
    the end of the last of them, and the next step is measured (see the module docstring).

    Args:
        model: the model (already wrapped by DDP is fine: the inner module is watched).
        plugin: the settings; None reads them from the environment (``ACCELERATE_REMAT_BUDGET``, ...).
            Without a budget nothing happens.
        accelerator: to find the prepared optimizer (its state counts in the budget), to log
            ``remat/...`` metrics to its trackers, and to receive ``accelerator.remat_metrics`` and
            ``accelerator.remat_plan``. Without it the optimizer is found when it first steps.

    Returns:
        ``model`` itself; ``remat_session(model)`` gives the plan and metrics.

    Raises:
        ValueError: a malformed environment variable (named in the message).
        AlreadyCheckpointedError: the model uses Hugging Face or torch checkpointing already.
        NoCandidateError: the model has no module to recompute (set ``candidates``).
        NotImplementedError: FSDP, DeepSpeed, Megatron-LM, XLA or torch.compile through Accelerate.

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])
        >>> prepare_remat(net, RematPlugin(budget="1GB")) is net
        True
        >>> remat_session(net).phase
        'observe'
        >>> remat_session(net).remove()
    """
    plugin = RematPlugin() if plugin is None else plugin
    if accelerator is not None:
        if not hasattr(accelerator, "remat_metrics"):
            accelerator.remat_metrics = {}
            accelerator.remat_plan = None
    if not plugin.enabled:
        return model
    if accelerator is not None:
        _check_supported(accelerator)
    inner = _inner_model(model)
    if inner in _SESSIONS:
        return model
    existing = existing_checkpointing(inner)
    if existing:
        raise AlreadyCheckpointedError(f"lightning-remat ({ENV_BUDGET} / RematPlugin.budget is set): "
                                       + "; ".join(existing))
    find_stages(inner, plugin.candidates)  # fail at start, not after the first step
    session = RematSession(inner, plugin, accelerator)
    if accelerator is not None:
        # The same dict: it fills in as the plan is made and measured.
        accelerator.remat_metrics = session.metrics
    _SESSIONS[inner] = session
    return model


def remat_session(model: nn.Module) -> RematSession | None:
    """The ``RematSession`` that ``prepare_remat`` attached to ``model`` (or its DDP wrapper), if any.

    Example:
        >>> remat_session(nn.Linear(2, 2)) is None
        True
    """
    return _SESSIONS.get(_inner_model(model))


class RematAccelerator(Accelerator):
    """``Accelerator`` that keeps each training step within a memory budget by recomputation.

    Takes every argument of ``Accelerator``, and ``remat_plugin``. Without a plugin the settings
    come from the environment, so an unchanged script is switched on at launch::

        ACCELERATE_REMAT_BUDGET=200MB accelerate launch train.py

    Each model given to ``prepare`` (for training) gets ``prepare_remat``: its first
    ``profile_steps`` steps are observed, then the plan is applied in place (parameter names and
    ``state_dict`` keys do not change, so ``save_state``/``load_state`` work with or without it).

    Args:
        remat_plugin: the settings; None reads ``RematPlugin`` from the environment. A malformed
            value fails here, at start, naming the variable.
        *args, **kwargs: passed to ``Accelerator``.

    Attributes:
        remat_plugin: the settings in use.
        remat_plan: the applied ``Plan`` (None before it is made, or when disabled).
        remat_metrics: ``remat/budget_bytes``, ``remat/baseline_peak_bytes``,
            ``remat/predicted_peak_bytes``, ``remat/predicted_overhead``, ``remat/num_checkpointed``
            once planned, and ``remat/measured_peak_bytes`` after the next step; the same figures
            go to ``accelerator.log`` when trackers are initialised.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)])
        >>> optimizer = torch.optim.Adam(model.parameters())
        >>> accelerator = RematAccelerator(cpu=True, remat_plugin=RematPlugin(budget="min", cost="flops"))
        >>> model, optimizer = accelerator.prepare(model, optimizer)
        >>> x = torch.randn(64, 32)
        >>> for _ in range(3):  # the user's loop, unchanged: step 1 is observed, then planned, step 2 measured
        ...     optimizer.zero_grad(set_to_none=True)
        ...     accelerator.backward(model(x).square().mean())
        ...     optimizer.step()
        >>> metrics = accelerator.remat_metrics
        >>> metrics["remat/num_checkpointed"] > 0, metrics["remat/measured_peak_bytes"] <= metrics["remat/budget_bytes"]
        (True, True)
        >>> from accelerate.state import AcceleratorState
        >>> AcceleratorState._reset_state(True)
    """

    def __init__(self, *args: Any, remat_plugin: RematPlugin | None = None, **kwargs: Any):
        # Read the environment before anything else, so a bad value fails before any set-up.
        plugin = RematPlugin() if remat_plugin is None else remat_plugin
        super().__init__(*args, **kwargs)
        self.remat_plugin = plugin
        self.remat_plan: Plan | None = None
        self.remat_metrics: dict[str, float] = {}
        if plugin.enabled:
            _check_supported(self)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        """Prepare as ``Accelerator.prepare_model`` does, and watch the model for recomputation."""
        if self.remat_plugin.enabled and not evaluation_mode:
            prepare_remat(model, self.remat_plugin, accelerator=self)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)


__all__: Sequence[str] = ("RematPlugin", "RematAccelerator", "RematSession", "prepare_remat", "remat_session",
                          "ENV_BUDGET", "ENV_PROFILE_STEPS", "ENV_CANDIDATES", "ENV_COST", "METRIC_NAMES")
