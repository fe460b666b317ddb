"""``RematSession``: observe, plan, apply and measure in the user's Accelerate loop (docs/accelerate.md)."""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from typing import Any, Iterator

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...runtime.installing.installer import check_installed
from ...runtime.measuring.measure import model_device
from ...core.errors import UnsupportedSetupError
from ...core.plan import Plan
from ...service.channel import Channel, torch_distributed_channel
from ...service.run import MeasuredWindow, RunHost, RunLifecycle
from ...service.shape_plans import ShapePlans
from ...service.planning import fsdp2_sharded
from .deepspeed import ZeroRank, deepspeed_stage, zero_rank
from .first_call import FirstCall, observed_adjust, redirected_call
from .plugin import ENV_BUDGET, LoopFacts, RematPlugin
from ...runtime.profiling.batch_shape import batch_shape, batch_tensors, padding
from .recorded_call import CallTemplate, RecordedCall, WindowTracker, scalar_loss

logger = logging.getLogger(__name__)

_GONE: list = []  # the global hooks of sessions collected without remove(): torch forbids removing them mid-step


def _discovering(session: "RematSession") -> Any:
    """The session's global optimizer pre-hook, holding it weakly: a global holds neither it nor its model."""
    for handle in _GONE:
        handle.remove()
    _GONE.clear()
    ref = weakref.ref(session, lambda _: _GONE.append(handle))

    def discover(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        live = ref()
        if live is not None:
            live._discover_optimizer(optimizer, args, kwargs)

    handle = register_optimizer_step_pre_hook(discover)
    return handle


class SessionHook:
    """A session's hook on its model, and the model's hold on its session (``remat_session``). A copied or pickled
    model (``copy.deepcopy``, ``torch.save``) gets it without the session: a copy is a new model, and a session holds
    an optimizer, an accelerator and closures that do not pickle.

    >>> import copy
    >>> hook = SessionHook(object(), "_before_forward")
    >>> copy.deepcopy(hook).session is None, copy.deepcopy(hook).name
    (True, '_before_forward')
    """

    __slots__ = ("session", "name")

    def __init__(self, session: "RematSession | None", name: str):
        self.session, self.name = session, name

    def __call__(self, *args: Any) -> None:
        if self.session is not None:
            getattr(self.session, self.name)(*args)

    def __reduce__(self) -> tuple:
        return SessionHook, (None, self.name)


class RematSession:
    """Made by ``prepare_remat``. ``phase``: ``"observe"``, ``"measure"`` (a plan's first steady step), ``"done"``;
    ``plan``: the latest batch shape's; ``plans``: one per shape; ``metrics``: the ``remat/...`` figures.

    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)) for _ in range(4)])
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> from lightning_remat.accelerate import prepare_remat, remat_session
    >>> session = remat_session(prepare_remat(net, RematPlugin(budget="min", cost="flops")))
    >>> for _ in range(3):
    ...     net(torch.randn(64, 32)).pow(2).mean().backward()
    ...     opt.step()
    ...     opt.zero_grad()
    >>> session.phase, session.plan.checkpointed, session.plan.segments
    ('done', ['2', '3'], [['0', '1']])
    >>> session.metrics["remat/measured_peak_bytes"] <= session.metrics["remat/predicted_peak_bytes"]
    True
    """

    def __init__(self, model: nn.Module, plugin: RematPlugin, accelerator: Any = None, loop: LoopFacts | None = None):
        self.model = model
        self.plugin = plugin
        self.accelerator = accelerator
        self.loop = loop or LoopFacts.of(accelerator)  # what the session reads of the loop around the model
        self.run = RunLifecycle(RunHost(
            model, lambda template: template.loss, channel=self._channel, accumulation=self._accumulation, summary=True,
            # The optimizer the profile counts: the loop's, or under ZeRO its class over the whole model.
            optimizers=lambda: self._zero.stand_in() if self._zero is not None else self._known_optimizer(),
            info=lambda message: (self.loop.show or logger.info)(message) if self._channel().is_main else None,
            log=lambda figures: self.loop.log(figures, self.observed_steps),
            hint=f"({ENV_BUDGET} / RematPlugin.budget={plugin.budget!r})",
            warn=lambda message: warnings.warn(message, UserWarning, stacklevel=3) if self._channel().is_main else None))
        self.plans: list[Plan] = self.run.plans
        self.metrics: dict[str, float] = self.run.metrics
        self.phase = "observe"
        self.observed_steps = 0
        self._optimizer: torch.optim.Optimizer | None = None
        self._current: RecordedCall | None = None  # the latest training forward
        self._completed: RecordedCall | None = None  # the latest one whose backward ran
        self._window: WindowTracker | None = None  # an observed step's
        self._measured: MeasuredWindow | None = None  # a plan's first steady step: its forwards, plans, shapes, time
        self._window_backward_ran = False
        self._observed: tuple[int, bool] | None = None  # last observed step: (forward/backward peak, had state)
        self._observed_actions: tuple = ()  # the actions of the plan the last observed step ran under
        self._carried = 0  # bytes the loop carried from the last observed micro-batch into the next
        self._busy = False
        self._stepped_since_plan = False
        self._hooked_optimizers: set[int] = set()
        self._template: CallTemplate | FirstCall | None = None
        self._replan: tuple = ()  # (adjust, config) of the plans per shape, to plan them again from a padded batch
        self._unpadded = False  # whether they were made from a batch whose attention masks hold no padding
        self._zero: ZeroRank | None = None  # DeepSpeed ZeRO-2/3's rank, once its engine exists
        self._handles = [
            # First among the pre-hooks: planning may run in it, before FSDP2's pre-forward unshards parameters.
            model.register_forward_pre_hook(SessionHook(self, "_before_forward"), with_kwargs=True, prepend=True),
            model.register_forward_hook(SessionHook(self, "_after_forward"), with_kwargs=True),
            # Finds an optimizer made later (the Trainer's) before its first step: else its new state counts as carried.
            _discovering(self),
        ]

    @property
    def plan(self) -> Plan | None:
        return self.run.plan

    @property
    def shape_plans(self) -> ShapePlans | None:
        """The plan of each batch's shape (not under FSDP2)."""
        return self.run.shape_plans

    # -- hooks: torch forbids changing step hooks while it iterates them, and profiling (MemTracker) adds
    # global ones: the step boundary runs in a per-optimizer hook; hooks go only in a forward pre-hook.

    def _training_call(self, module: nn.Module) -> bool:
        return not self._busy and module.training and torch.is_grad_enabled()

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.phase == "done" and self.shape_plans is None:
            self._let_go(keep=1)  # this hook stays: the model's hold on its session (``remat_session``)
            return
        if not self._training_call(module):
            return
        refusal = redirected_call(args)
        if refusal is not None:
            raise UnsupportedSetupError(refusal)
        self._hook_optimizer(self._known_optimizer())
        if self._zero is None and deepspeed_stage(self.loop.state) is not None:
            self._zero = zero_rank(self.loop.state, self.loop.optimizers(), self.model)
            if self._zero is None:
                raise UnsupportedSetupError(
                    "lightning-remat under DeepSpeed ZeRO-2/3 plans each rank from DeepSpeed's ZeRO optimizer, and "
                    "found none at this training forward: run training forwards after accelerator.prepare (or "
                    "trainer.train), with an optimizer given to it or in the DeepSpeed config")
        self._step_boundary(optimizer_stepped=False, next_inputs=batch_tensors((args, kwargs)))
        if self.phase == "observe" and self.shape_plans is None and not fsdp2_sharded(self.model):
            self._plan_first(args, kwargs)
        if self.shape_plans is not None:
            self._follow_shape(args, kwargs)
        elif self.plan is not None:  # a plan kept (FSDP2: no shapes followed) is checked, not assumed
            self.check_plan()
        if self.phase == "observe":
            self._current = RecordedCall(args=args, kwargs=dict(kwargs))
        self._open_window()
        if self._measured is not None:
            self._measured.ran(self.plan, batch_shape((args, kwargs)))

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._training_call(module):
            return
        leaves = batch_tensors(output)
        if self.phase == "observe" and self._current is not None:
            call = self._current
            loss = scalar_loss(output)
            call.loss_index = next((i for i, t in enumerate(leaves) if t is loss), None)
            call.watch_outputs(leaves)
            for i, tensor in enumerate(leaves):
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad, i=i, call=call: call.on_grad(i, grad))
        elif self.phase == "measure":
            # Every output needing a gradient: a loss may use only some (TRL's LM head reads the hidden states).
            for tensor in leaves:
                if tensor.requires_grad:
                    tensor.register_hook(self._window_backward)

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
            self._window.peak_before_optimizer = self._window.peak_bytes

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._busy or self.phase == "done":
            self._stepped_since_plan = self._stepped_since_plan or self.plan is not None
            return
        self._step_boundary(optimizer_stepped=True)
        if self.phase == "measure" and self._measured is None:
            self._stepped_since_plan = True

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
        for optimizer in self.loop.optimizers():
            inner = getattr(optimizer, "optimizer", optimizer)
            if isinstance(inner, torch.optim.Optimizer) and self._holds_model_parameters(inner):
                return inner
        return None

    def _step_boundary(self, optimizer_stepped: bool, next_inputs: list[torch.Tensor] = ()) -> None:
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
                    # What the loop carries into the next micro-batch (not FSDP2: sharded state the profile counts).
                    # (Nor DeepSpeed: it stepped inside backward, and its state is counted by ``ZeroRank.account``.)
                    stepped = optimizer_stepped or fsdp2_sharded(self.model) or self._zero is not None
                    self._carried = 0 if stepped else window.carried_bytes(list(next_inputs))
                    peak = window.close()
                    # Without an optimizer pre-step hook, the whole step's peak stands in (errs on the safe side).
                    before = window.peak_before_optimizer
                    # Not under DeepSpeed: its step ran inside this window, over buffers the account computes.
                    self._observed = None if self._zero is not None else (
                        peak if before is None else before, window.optimizer_had_state)
                    self._observed_actions = tuple(self.plan.actions) if self.plan is not None else ()
            if self.observed_steps >= self.plugin.profile_steps and self._completed is not None:
                self._make_plan()
                self.phase = "measure"
                self._window_backward_ran = False
        elif self.phase == "measure" and self._measured is not None and (self._window_backward_ran or optimizer_stepped):
            # The measured step ends with the optimizer step; without a known optimizer, at the next forward.
            if optimizer_stepped or self._known_optimizer() is None:
                self.observed_steps += 1
                measured, self._measured = self._measured, None
                self.phase = "done"  # without shapes to follow, the hooks are removed at the next forward
                self.run.finish(measured, f"training step {self.observed_steps} (with its plan)")

    def _steady(self) -> bool:
        """Whether a steady step starts now: after an optimizer step under the plan (state held, a whole window)."""
        if self._zero is not None:  # DeepSpeed steps its own optimizer, inside accelerator.backward
            return self._zero.steady
        return self._known_optimizer() is None or self._stepped_since_plan

    def _open_window(self) -> None:
        """Observed steps are measured on the main process (it plans), steady ones on every rank."""
        if self.phase == "observe" and self._window is None and (self._channel().is_main or fsdp2_sharded(self.model)):
            self._window = WindowTracker(self.model, self._known_optimizer())
        elif self.phase == "measure" and self._measured is None and self._steady():
            meter = self._zero.meter() if self._zero is not None else None  # ZeRO: DeepSpeed's tensors counted
            self._measured = self.run.window(batches=self._accumulation(), meter=meter)

    def _plan_first(self, args: tuple, kwargs: dict) -> None:
        """Plan the first training forward on fake tensors (no chunked loss: this call looked up forward already)."""
        first = FirstCall.of(args, kwargs)
        plan = self._plan_shapes(first, first, first.adjust, self._config(chunk_loss=False))
        if self.run.saved and self.run.profiles == 0:  # the checkpoint's plan for this shape: no step to observe
            self.phase, self._window_backward_ran = "measure", False
            self._new_plan(plan, "lightning-remat: the checkpoint's plan, applied without profiling")
        else:
            self._new_plan(plan, "lightning-remat: planned before the first step, on fake tensors")

    def resume(self, plans: dict) -> None:
        """Take a checkpoint's ``plans`` (shape -> ``Plan``) before the first training forward: not profiled."""
        if self.plan is None:
            self.run.saved = dict(plans)

    def _plan_shapes(self, template: Any, call: Any, adjust: Any, config: Any = None) -> Plan:
        self._template, self._replan = template, (adjust, config)
        self._unpadded = padding((template.args, template.kwargs)) is False  # its integer inputs: real tensors
        if self._zero is not None:  # the whole model's step, then what a ZeRO rank holds of it
            adjust = (lambda profile, first=adjust: self._zero.account(first(profile)))
        with self._planning():
            self.run.shapes(config or self._config(), shape_of=lambda template: template.shape,
                            warmup=0, resize=lambda template, shape: template.at(shape), adjust=adjust)
            self.run.follow(call)
        return self.run.plan

    def _make_plan(self) -> None:
        call, self._completed = self._completed, None
        # At a step boundary (before the next forward binds them again), the outputs alive are the loop's.
        adjust = observed_adjust(call.held_bytes(), self._carried, self._observed, self._observed_actions)
        if fsdp2_sharded(self.model):
            # FSDP2: every pass runs collectives, so every rank profiles, once (no fake twin to follow shapes).
            with self._planning():
                plan = self.run.plan_shared(self._config(), call.loss, warmup=0, adjust=adjust)
        else:  # the observed step calibrates a fake profile of the call it recorded (its loss's gradients)
            plan = self._plan_shapes(CallTemplate.of(call), call, adjust)
        self._new_plan(plan, f"lightning-remat applied after {self.observed_steps} step(s)")

    def _follow_shape(self, args: tuple, kwargs: dict) -> None:
        """Install the batch shape's plan; a new plan's first steady step is measured."""
        shape = batch_shape((args, kwargs))
        if shape is None:
            return
        title = f"lightning-remat: a plan for batch shape {shape}"
        if self._unpadded and padding((args, kwargs)):
            # Planned from a batch without padding (no attention mask built): a padded one needs more.
            self.run.saved, fresh, title = {}, True, f"{title} (the first with padding: every shape planned again)"
            template = self._template.with_inputs(args, kwargs, shape)
            self._plan_shapes(template, template, *self._replan)
        else:
            with self._planning():
                fresh = self.run.follow(self._template.following(args, kwargs, shape))
        if fresh:  # a new bucket's plan, or one solved again after a calibration
            self._new_plan(self.run.plan, title)
            if self._measured is None and self.phase != "observe":  # observed steps are measured anyway
                self.phase, self._window_backward_ran = "measure", False

    def _new_plan(self, plan: Plan, title: str) -> None:
        self.run.announce(plan, title)
        if self.accelerator is not None:
            self.accelerator.remat_plan = plan

    def _config(self, **profile: Any) -> Any:
        buckets = self.loop.processes() > 1 and not fsdp2_sharded(self.model) and self._zero is None
        return self.run.config(self.plugin.config(), buckets, **profile)

    def _accumulation(self) -> int:
        return max(1, int(self.loop.accumulation() or 1))

    @contextlib.contextmanager
    def _planning(self) -> Iterator[None]:
        """The session's own forwards (profiling, installing) are not the user's training calls."""
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    def check_plan(self, where: str = "") -> None:
        """Raise ``InstallationMismatchError`` unless the plan is what the model has installed."""
        if self.plan is not None:
            check_installed(self.model, self.plan, where or f"(lightning-remat, Accelerate step {self.observed_steps})")

    def _channel(self) -> Channel:
        """The ``torch.distributed`` ranks (the model's device carries reductions)."""
        return torch_distributed_channel(model_device(self.model))

    def remove(self) -> None:
        """Stop observing, between steps (the plan stays: ``remove_remat(model)`` undoes it)."""
        self._let_go()

    def _let_go(self, keep: int = 0) -> None:
        for handle in self._handles[keep:]:
            handle.remove()
        self._handles = self._handles[:keep]
        for window in (self._window, self._measured and self._measured.meter):
            if window is not None:
                window.abandon()
        self._window = self._measured = None
