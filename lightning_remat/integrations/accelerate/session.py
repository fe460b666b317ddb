"""``RematSession``: observe a model in the user's Accelerate loop, then plan, apply and measure; then
give every step the plan for its batch's shape.

How it works, per model:

1. The first ``profile_steps`` training steps run as written. Hooks on the model record the inputs
   of each training forward and, during the user's backward, the gradient that reached each output
   (``recorded_call``).
2. At the end of step ``profile_steps`` (the matching optimizer's ``step``, or else the next training
   forward) the planning service profiles the recorded call, solves, and every rank applies the
   main process's plan in place. The call is profiled on fake tensors (with ``cost="time"``, for
   real: it needs timings): the observed step ran for real already, and its measured peak
   calibrates the profile, so planning runs no real step without recomputation, and allocates
   nothing while the step's gradients are still alive.
3. From then on every training forward's batch shape is read (under DDP, the largest of the
   ranks'): a new shape bucket is planned on fake-tensor profiles of the recorded call stretched to
   it (``service.shape_plans``), and its plan installed before the forward runs. Not under FSDP2,
   which keeps the first plan.
4. The first steady step of each new plan is measured by the peak meter (``max_memory_allocated`` on
   CUDA, with ``max_memory_reserved`` beside it; ``MemTracker`` on a CPU), compared with the budget
   (a warning when above), and the figures go to ``accelerator.log`` under ``remat/...`` and to
   ``accelerator.remat_metrics``.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...runtime.installing.apply import apply_plan
from ...runtime.installing.verify import check_installed
from ...runtime.measuring.measure import model_device
from ...core.plan import Plan
from ...service.channel import Channel, torch_distributed_channel
from ...service.planning import Planner, over_budget, plan_metrics
from ...service.plan_figures import installation_cause, shape_cause
from ...service.shape_plans import ShapePlans
from ...service.sharded import fsdp2_sharded
from .plugin import ENV_BUDGET, RematPlugin
from ...runtime.profiling.batch_shape import batch_shape, batch_tensors
from .recorded_call import (CallTemplate, RecordedCall, WindowTracker, calibrate, scalar_loss, tensor_leaves,
                            with_loop_references)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Observed:
    """The observed call itself, as ``ShapePlans`` sees a batch: profiled for real as it ran (its
    gradients and inputs real), stretched to other shapes through its template."""

    call: RecordedCall
    shape: Any

    def loss(self, model: nn.Module) -> torch.Tensor:
        return self.call.loss(model)

    def at(self, shape: Any) -> Any:
        return CallTemplate.of(self.call).at(shape)


class RematSession:
    """Observe a model in the user's loop, then plan, apply and measure recomputation once.

    Made by ``prepare_remat`` (and so by ``RematAccelerator``); get it back with
    ``remat_session(model)``. Phases: ``"observe"`` (the first ``profile_steps`` steps), ``"measure"``
    (the first step with the plan), ``"done"``.

    Attributes:
        plan: the applied ``Plan`` (None until it is made): the plan of the latest batch's shape.
        plans: every plan the run made, in order (one per batch shape met).
        metrics: ``remat/...`` figures, as logged: those of the run's plan of the largest predicted peak,
            ``remat/num_plans``, and the largest measured peak (``remat/measured_peak_bytes``, once measured).
        observed_steps: training steps (forward and backward) seen so far.

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)) for _ in range(4)])
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> from lightning_remat.accelerate import prepare_remat, remat_session
        >>> session = remat_session(prepare_remat(net, RematPlugin(budget="min", cost="flops")))
        >>> for _ in range(3):
        ...     net(torch.randn(64, 32)).pow(2).mean().backward()
        ...     opt.step()
        ...     opt.zero_grad()
        >>> session.phase, session.plan.checkpointed, session.plan.segments
        ('done', ['0', '3'], [['1', '2']])
        >>> session.metrics["remat/measured_peak_bytes"] <= session.metrics["remat/predicted_peak_bytes"]
        True
    """

    def __init__(self, model: nn.Module, plugin: RematPlugin, accelerator: Any = None):
        self.model = model
        self.plugin = plugin
        self.accelerator = accelerator
        self.plan: Plan | None = None
        self.plans: list[Plan] = []
        self.metrics: dict[str, float] = {}
        self.phase = "observe"
        self.observed_steps = 0
        self._optimizer: torch.optim.Optimizer | None = None
        self._current: RecordedCall | None = None  # the latest training forward
        self._completed: RecordedCall | None = None  # the latest one whose backward ran
        self._window: WindowTracker | None = None
        self._window_backward_ran = False
        self._observed: tuple[int, bool] | None = None  # last observed step: (forward/backward peak, had state)
        self._carried = 0  # bytes the loop carried from the last observed micro-batch into the next
        self._busy = False
        self._stepped_since_plan = False
        self._hooked_optimizers: set[int] = set()
        # After the first plan: the plan of each batch's shape (not under FSDP2), from the observed call.
        self.shape_plans: ShapePlans | None = None
        self._template: CallTemplate | None = None
        self._metered: list[tuple[Plan | None, Any]] = []  # the measured window's forwards: (their plan, their shape)
        self._handles = [
            # First among the model's pre-hooks: planning may run in it (at a step boundary found at
            # the next forward), before FSDP2's own pre-forward unshards the parameters for that forward.
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
            # Finds the optimizer as it first steps, if no accelerator told us about it: before its step, so
            # that this step's own hooks (run after the global ones) see it: the observed step's peak before
            # the optimizer, and the step boundary after it (issue 29: prepare_remat before the Trainer,
            # which makes its optimizer later, counted Adam's new state as memory the loop carries).
            register_optimizer_step_pre_hook(self._discover_optimizer),
        ]

    # -- hooks -----------------------------------------------------------------------------
    # torch iterates an optimizer's own step hooks, then the global ones, and forbids changing
    # either set while it iterates it. Profiling (MemTracker) adds and removes global hooks, so
    # the step boundary work runs in a per-optimizer hook, and hooks are removed only from a
    # forward pre-hook (or by ``remove()`` outside a step).

    def _training_call(self, module: nn.Module) -> bool:
        return not self._busy and module.training and torch.is_grad_enabled()

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.phase == "done" and self.shape_plans is None:
            self.remove()
            return
        if not self._training_call(module):
            return
        self._hook_optimizer(self._known_optimizer())
        self._step_boundary(optimizer_stepped=False, next_inputs=batch_tensors((args, kwargs)))
        if self.shape_plans is not None:
            self._follow_shape(args, kwargs)
        elif self.plan is not None:  # a plan kept (FSDP2: no shapes followed) is checked, not assumed
            self.check_plan()
        if self.phase == "observe":
            self._current = RecordedCall(args=args, kwargs=dict(kwargs))
        if self.phase == "observe" or (self.phase == "measure" and self._steady()):
            self._open_window()
        if self.phase == "measure" and self._window is not None:
            self._metered.append((self.plan, batch_shape((args, kwargs))))

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._training_call(module):
            return
        leaves = tensor_leaves(output)
        if self.phase == "observe" and self._current is not None:
            call = self._current
            loss = scalar_loss(output)
            call.loss_index = next((i for i, t in enumerate(leaves) if t is loss), None)
            call.watch_outputs(leaves)
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
            if self._window is not None and self._window.optimizer is None:
                self._window.optimizer_had_state = bool(optimizer.state)  # as its forward and backward ran
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
            self._stepped_since_plan = self._stepped_since_plan or self.plan is not None
            return
        self._step_boundary(optimizer_stepped=True)
        if self.phase == "measure" and self._window is None:
            self._stepped_since_plan = True

    # -- the state machine -------------------------------------------------------------------

    def _holds_model_parameters(self, optimizer: Any) -> bool:
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            return False  # a wrapper (Accelerate's AcceleratedOptimizer): its inner optimizer reports the step
        # Read now, not when the session began: FSDP2 (accelerator.prepare) replaces the parameters.
        parameter_ids = {id(p) for p in self.model.parameters()}
        return any(id(p) in parameter_ids for group in optimizer.param_groups for p in group["params"])

    def _known_optimizer(self) -> torch.optim.Optimizer | None:
        if self._optimizer is not None:
            return self._optimizer
        for optimizer in getattr(self.accelerator, "_optimizers", []) or []:
            inner = getattr(optimizer, "optimizer", optimizer)
            if isinstance(inner, torch.optim.Optimizer) and self._holds_model_parameters(inner):
                return inner
        return None

    def _step_boundary(self, optimizer_stepped: bool, next_inputs: list[torch.Tensor] = ()) -> None:
        """Between two steps: count the step that ended, and plan or finish measuring when due
        (``next_inputs``: the tensors of the forward about to run, if one is)."""
        if self.phase == "observe":
            if self._current is not None and not self._current.backward_ran and self._window is not None:
                # A forward the loop did not train on (it skipped the batch): not an observed step.
                self._window.abandon()
                self._window = None
            if self._current is not None and self._current.backward_ran:
                self._completed, self._current = self._current, None
                self.observed_steps += 1
                if self._window is not None:
                    window, self._window = self._window, None
                    # Between two micro-batches (no optimizer step): what the loop carries into the next.
                    # Not on an FSDP2-sharded model: between its steps the tracker reads sharded state
                    # (unsharded parameters, reduce-scatter buffers) the lockstep profile counts already.
                    self._carried = 0 if optimizer_stepped or fsdp2_sharded(self.model) else window.carried_bytes(
                        [*next_inputs, *self._completed.grads.values()])
                    peak = window.close()
                    # Without an optimizer pre-step hook in this step, the whole step's peak stands in
                    # for that of forward and backward (an over-estimate: the plan errs on the safe side).
                    before = window.peak_before_optimizer
                    self._observed = (peak if before is None else before, window.optimizer_had_state)
            if self.observed_steps >= self.plugin.profile_steps and self._completed is not None:
                self._make_plan()
                self.phase = "measure"
                self._window_backward_ran = False
        elif self.phase == "measure" and self._window is not None and self._window_backward_ran:
            # The measured step ends with the optimizer step; without a known optimizer, at the
            # next forward.
            if optimizer_stepped or self._known_optimizer() is None:
                self.observed_steps += 1
                self._finish_measurement()

    def _steady(self) -> bool:
        """Whether a steady optimizer step starts now: right after an optimizer step with the plan
        applied, so the optimizer holds its state and a whole accumulation window follows."""
        return self._known_optimizer() is None or self._stepped_since_plan

    def _open_window(self) -> None:
        """Measure the step that starts now: the observed ones calibrate the plan (on the main
        process, which plans), the first steady one checks it (on every rank)."""
        if self._window is None and (self.phase == "measure" or self._channel().is_main or fsdp2_sharded(self.model)):
            self._window, self._metered = WindowTracker(self.model, self._known_optimizer()), []

    def _make_plan(self) -> None:
        call, self._completed = self._completed, None
        channel = self._channel()
        # Planned at a step boundary, after the backward (and the optimizer step, or before the next
        # forward binds them again): the outputs still alive are the ones the loop holds.
        observed, held, carried = self._observed, call.held_bytes(), self._carried

        def adjust(profile: Any) -> Any:
            profile = with_loop_references(profile, held, carried)
            return calibrate(profile, *observed) if observed is not None else profile

        hint = f"({ENV_BUDGET} / RematPlugin.budget={self.plugin.budget!r})"
        self._busy = True
        try:
            if fsdp2_sharded(self.model):
                # Sharded with FSDP2: every pass runs collectives, so every rank profiles (and calibrates),
                # once: a sharded model has no fake twin to follow shapes with.
                plan = Planner(self._config()).shared_plan(self.model, call.loss, self._known_optimizer(),
                                                           channel=channel, hint=hint, warmup=0, adjust=adjust)
                apply_plan(self.model, plan)
            else:
                # The observed steps were the warm-up: lazy initialisation has happened. The observed step
                # ran for real and calibrates the profile: with FLOP costs a fake one is enough.
                config = self._config()
                if config.cost != "time":
                    config = replace(config, profile=replace(config.profile, fake=True))
                self.shape_plans = ShapePlans(
                    self.model, lambda model, template: template.loss(model), config=config,
                    optimizer=self._known_optimizer(), shape_of=lambda template: template.shape,
                    resize=lambda template, shape: template.at(shape), adjust=adjust, channel=channel, hint=hint,
                    warmup=0)
                self._template = CallTemplate.of(call)
                plan = self.shape_plans.use(_Observed(call, self._template.shape))
        finally:
            self._busy = False
        self._new_plan(plan, channel, f"lightning-remat applied after {self.observed_steps} step(s)")

    def _follow_shape(self, args: tuple, kwargs: dict) -> None:
        """Before a training forward: install the plan for its batch's shape (a new shape is planned
        on fake-tensor profiles of the observed call stretched to it); a new plan's first steady step
        is measured."""
        shape = batch_shape((args, kwargs))
        if shape is None:
            return
        known = len(self.shape_plans.plans)
        self._busy = True
        try:
            plan = self.shape_plans.use(self._template.following(args, kwargs, shape))
        finally:
            self._busy = False
        if len(self.shape_plans.plans) > known:
            self._new_plan(plan, self._channel(), f"lightning-remat: a plan for batch shape {shape}")
            if self._window is None:
                self.phase, self._window_backward_ran = "measure", False
        self.plan = plan

    def _new_plan(self, plan: Plan, channel: Channel, title: str) -> None:
        self.plan = plan
        self.plans.append(plan)
        # The run's figures are its plan of the largest predicted peak, not the latest shape's (a later,
        # shorter batch's plan hid a longer one's), beside the number of plans (docs/accelerate.md).
        largest = max(self.plans, key=lambda p: p.predicted_peak_bytes or 0)
        for key in [k for k in self.metrics if not k.startswith("remat/measured_")]:
            del self.metrics[key]  # in place: accelerator.remat_metrics is this dict
        self.metrics.update({**plan_metrics(largest), "remat/num_plans": len(self.plans)})
        if self.accelerator is not None:
            self.accelerator.remat_plan = plan
        if channel.is_main:
            logger.info("%s:\n%s", title, plan.summary())
        self._log(dict(self.metrics))

    def _config(self) -> Any:
        """The plugin's settings, with what the loop adds to a step's memory: gradient accumulation
        and, with several processes, DDP's gradient buckets."""
        config = self.plugin.config()
        steps = int(getattr(self.accelerator, "gradient_accumulation_steps", 1) or 1)
        buckets = self.accelerator is not None and getattr(self.accelerator, "num_processes", 1) > 1 \
            and not fsdp2_sharded(self.model)  # FSDP2 reduce-scatters each block's gradients: no DDP buckets
        return replace(config, profile=replace(config.profile, accumulation_steps=max(1, steps),
                                               gradient_buckets=buckets))

    def _finish_measurement(self) -> None:
        window, self._window = self._window, None
        channel = self._channel()
        # The largest peak of any rank: the budget holds on every one or it does not hold.
        peak = channel.max(window.close())
        # Over the run: the largest of the measured steps (each new plan's first).
        measured = {"remat/measured_peak_bytes": max(peak, self.metrics.get("remat/measured_peak_bytes", 0))}
        if window.reserved_bytes is not None:
            # On CUDA: what the caching allocator held beside it (fragmentation included).
            measured["remat/measured_reserved_bytes"] = max(channel.max(window.reserved_bytes),
                                                            self.metrics.get("remat/measured_reserved_bytes", 0))
        self.metrics.update(measured)
        self.phase = "done"  # without shapes to follow, the hooks are removed at the next forward
        peak = int(peak)
        if channel.is_main:
            logger.info("lightning-remat: measured peak of the first step with the plan: %d bytes", peak)
            # What the package can see of a step over the budget: the plan not installed, a batch not planned.
            causes = [installation_cause(self.model, self.plan), *(shape_cause(p, shape) for p, shape in self._metered
                                                                    if p is not None)]
            warning = over_budget(peak, self.plan, f"training step {self.observed_steps} (with its plan)", causes)
            if warning is not None:
                warnings.warn(warning, UserWarning, stacklevel=2)
        self._log(measured)

    def check_plan(self, where: str = "") -> None:
        """Raise ``InstallationMismatchError`` unless the plan (once there is one) is what is installed
        on the model (``runtime.installing.verify``): at every training forward, and from the Trainer's
        callback at every step."""
        if self.plan is not None:
            check_installed(self.model, self.plan, where or f"(lightning-remat, Accelerate step {self.observed_steps})")

    def _channel(self) -> Channel:
        """The ranks of the ``torch.distributed`` group (the model's device carries reductions)."""
        return torch_distributed_channel(model_device(self.model))

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
