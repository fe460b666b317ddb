"""``AutoRemat``: a Lightning callback that keeps each training step under a memory budget (``docs/lightning.md``)."""
from __future__ import annotations

from typing import Any, Sequence

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from ...core.config import DEFAULT_COST, MAX_STEPS, ProfileOptions, RematConfig, check_int
from ...core.vocabulary import CostKind
from ...core.errors import SkippedStepError
from ...core.plan import Plan
from ...core.shapes import Shape
from ...report.render import print_plan
from ...runtime.installing.apply import apply_plan, remove_remat
from ...runtime.installing.installer import check_installed, installation_mismatch
from ...runtime.profiling.batch_shape import batch_shape
from ...runtime.profiling.candidates import find_stages
from ...runtime.installing.fingerprint import made_for_other, outgrows
from ...runtime.installing.takeover import take_over_checkpointing
from ...service.channel import Channel, torch_distributed_channel
from ...service.planning import resolve_cost
from ...service.run import RunHost, RunLifecycle
from .figures import log_plan_figures
from ...service.planning import fsdp2_sharded
from .loop_peaks import LoopPeaks
from .step import manual_step_closure, training_step_closure
from .strategies import loop_allowance, unsupported


class AutoRemat(Callback):
    """Keep every training step under a memory budget by recomputing the cheapest set of modules.

    The first batch's step is profiled on fake tensors, then planned and installed; steps under the plan are
    measured and calibrate the plans. Plans follow the batch's shape and are saved in the ``state_dict``
    (``docs/lightning.md``).

    Args:
        budget: peak memory of a whole training step: ``"10GB"``, bytes, ``"80%"`` of the device, or ``"min"``.
        profile_steps: training steps before the plan's steady peak is measured (default: batch 1).
        candidates: None for the repeated blocks, or class names / ``fnmatch`` patterns over module names.
        cost: ``"flops"``, ``"time"`` or ``"roofline"``; None: the target's (``RematConfig.cost``).
        fake: None/True: profile the first batch on fake tensors only; False: also for real where it fits.
        offload, policies, chunk_loss: as ``plan_remat``'s.

    >>> AutoRemat(budget="2GB").config.budget.resolve()
    2000000000
    >>> trainer = Trainer(callbacks=[AutoRemat(budget="10GB")])  # doctest: +SKIP
    """

    def __init__(self, budget: str | int, profile_steps: int = 1, candidates: list[str] | None = None,
                 cost: str | None = DEFAULT_COST, verbose: bool = True, fake: bool | None = None, offload: bool = False,
                 policies: Sequence[str] | None = (), chunk_loss: bool = False) -> None:
        check_int("profile_steps", profile_steps, 1, MAX_STEPS, " (training steps before the plan's peak is measured)")
        # Not the config's ``fake`` (ShapePlans fakes the first batch): it would refuse cost="time".
        self.config = RematConfig(budget, cost=cost, profile=ProfileOptions(
            candidates=candidates, offload=offload, policies=policies, chunk_loss=chunk_loss))
        self.budget = budget
        self.profile_steps = profile_steps
        self.candidates = list(self.config.profile.candidates) if self.config.profile.candidates is not None else None
        self.cost, self.fake, self.verbose = cost, fake, verbose
        self.measured_peak_bytes: int | None = None
        self._disabled_reason: str | None = None
        self.run = RunLifecycle(RunHost(
            None, lambda batch: self._step_for(batch, self._batch_idx), name="AutoRemat", warn=rank_zero_warn,
            channel=self._channel, optimizers=lambda: list(self._trainer.optimizers),
            accumulation=lambda: max(1, self._trainer.accumulate_grad_batches), log=self._log_metrics,
            info=lambda message: rank_zero_info(message) if self.verbose else None, table=self._print_plan,
            hint=f"(AutoRemat, budget={budget!r})"))
        self._batch_idx = 0
        self._skipped: list[str] = []  # why each batch was skipped while nothing was planned
        self.loop_peaks = LoopPeaks(self._step_for, rank_zero_warn)
        self._trainer: Trainer | None = None

    @property
    def plan(self) -> Plan | None:
        """The latest batch shape's plan (or the checkpoint's, until the first batch)."""
        return self.run.plan

    @property
    def shape_plans(self) -> Any:
        return self.run.shape_plans

    @property
    def state_key(self) -> str:
        # A plan belongs to a budget: a run resumed with another budget plans again. Not to the cost as given
        # (unset is the target's): the saved plans' own cost is compared with the resolved one (``_keeps_plans``).
        return self._generate_state_key(budget=str(self.budget), candidates=self.candidates)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer, self.run.host.model = trainer, pl_module
        if stage != "fit":
            return
        self._disabled_reason = unsupported(trainer)
        if self._disabled_reason:
            rank_zero_warn(f"AutoRemat is not recomputing anything: {self._disabled_reason}.")
            return
        take_over_checkpointing(pl_module, "AutoRemat", trainer.is_global_zero)
        self.run.shape_plans = None
        # Fail before training on a budget or candidate that cannot work with this model.
        self.config.budget_bytes(pl_module.device)
        find_stages(pl_module, self.config.profile.candidates)
        # Shapes only: bytes and dtypes may still change here (a precision plugin converts the model later).
        if self.plan is not None and self._keeps_plans(pl_module, bytes_too=False):
            apply_plan(pl_module, self.plan)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._disabled_reason:
            take_over_checkpointing(pl_module, "AutoRemat", trainer.is_global_zero)  # again: configure_model ran since
        if self._disabled_reason or not self._keeps_plans(pl_module, bytes_too=True) or self.plan is None:
            return
        # A plan restored from a checkpoint (load_state_dict runs after setup) is applied here.
        if installation_mismatch(pl_module, self.plan) is not None:
            apply_plan(pl_module, self.plan)
            rank_zero_info(f"AutoRemat: applied the saved plan ({len(self.plan.checkpointed)} module(s) recomputed) "
                           "without profiling again.")
        if self.measured_peak_bytes is None and self.run.measure_in is None:
            self.run.measure_after(0)
            self.run.announce(self.plan)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._disabled_reason:
            return
        window = max(1, trainer.accumulate_grad_batches)
        first = self.plan is None
        try:
            planned = (self._sharded_plan if fsdp2_sharded(pl_module) else self._shape_plan)(trainer, pl_module,
                                                                                             batch, batch_idx)
        except SkippedStepError as skipped:
            self._skipped.append(str(skipped).partition(":")[0])
            return  # training_step skips this batch (Lightning allows it): plan on the first that returns a loss
        if self.plan is None:
            return
        if planned:
            shape = self.plan.fingerprint.get("shape")
            self.run.announce(self.plan, "AutoRemat plan" if first else
                              f"a plan for batch shape {Shape.from_list(shape) if shape else '?'}", full=first)
            self.run.measure_after(self.profile_steps if first else 0)
        if batch_idx % window == 0 and pl_module.automatic_optimization:
            # Lightning's zero_grad runs after forward: drop the previous gradients now (manual: training_step's).
            pl_module.zero_grad(set_to_none=True)
        # The first step under the plan, measured: a peak above its prediction calibrates the plans.
        self.run.before_batch(batch_idx, batch_shape(batch), calibrate=planned and first and self.shape_plans is not None)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        measured = self.run.after_batch(f"a steady training step (batch {batch_idx})")
        if measured is None:
            return
        self.measured_peak_bytes = measured
        if trainer.is_global_zero:  # the plan's picture, with its measured point, to loggers that take images
            log_plan_figures(trainer.loggers, self.shape_plans, self.plan, measured, trainer.global_step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.plan is None and self._skipped:  # a fit that planned nothing says so, and why
            rank_zero_warn(f"AutoRemat planned nothing: every one of the {len(self._skipped)} training batch(es) was "
                           f"skipped ({self._skipped[-1]}), and a plan is made on a batch that returns a loss.")

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self._check_loop("validation", trainer, pl_module, batch)

    def on_test_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:
        self._check_loop("test", trainer, pl_module, batch)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.run.abandon()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.run.abandon()

    def state_dict(self) -> dict[str, Any]:
        # Every shape's plan, so that a resumed run profiles none of them again.
        return {**self.run.state_dict(), "measured_peak_bytes": self.measured_peak_bytes}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.run.plan = self.run.load_state_dict(state_dict, "AutoRemat's checkpoint state")
        self.run.shape_plans = None
        # A resumed run measures its own first step again.
        self.measured_peak_bytes = None
        self.run.measure_in = None

    def _keeps_plans(self, pl_module: LightningModule, bytes_too: bool) -> bool:
        """Whether the saved plans (per shape too) were made for this model; if not, they are forgotten."""
        plans = [self.plan, *self.run.saved.values()]
        found = made_for_other(pl_module, plans, bytes_too)
        for_what = "another model"
        if found is None and bytes_too:  # on the model's device: the cost this run resolves to (unset: the target's)
            found = other_cost(plans, resolve_cost(self.config, pl_module)[0].cost)
            for_what = "another cost"
        if found is None:
            return True
        rank_zero_warn(f"AutoRemat: the saved plan was made for {for_what} ({found}); planning again on the "
                       "first batch.")
        self.run.plan, self.run.saved = None, {}
        remove_remat(pl_module)
        return False

    def _step_for(self, batch: Any, batch_idx: int = 0) -> Any:
        trainer = self._trainer
        pl_module = trainer.lightning_module
        closure = training_step_closure if pl_module.automatic_optimization else manual_step_closure
        return closure(pl_module, batch, batch_idx, trainer)

    def _check_loop(self, loop: str, trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
        """Predict an evaluation batch's peak before it runs, and warn when it is over the budget."""
        if self._disabled_reason or self._trainer is None or fsdp2_sharded(pl_module):
            return  # sharded: the measured forwards would run collectives on one rank's batch alone
        budget = self.config.budget_bytes(pl_module.device)
        if not isinstance(budget, int):  # "min": the plan's least peak, once there is a plan
            budget = self.plan.budget_bytes if self.plan is not None else None
        if budget is not None:
            self.loop_peaks.check(loop, pl_module, batch, list(trainer.optimizers), budget)

    def _sharded_plan(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> bool:
        """FSDP2 (no fake twin): the first batch, and one larger than the plan's, profiled on every rank."""
        channel = self._channel()
        if self.plan is not None:
            if "batch_elements" not in self.plan.fingerprint or not channel.any(outgrows(self.plan.fingerprint, batch)):
                check_installed(pl_module, self.plan, f"(AutoRemat, batch {batch_idx})")  # kept: checked, not assumed
                return False
            rank_zero_info(f"AutoRemat: a batch larger than the one the plan was made for "
                           f"({self.plan.fingerprint.get('batch_shapes')}); planning again on it.")
        self.run.plan_shared(self._config(trainer), self._step_for(batch, batch_idx), batch,
                                         self.verbose, adjust=loop_allowance)
        return True

    def _shape_plan(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> bool:
        if self.shape_plans is None:
            saved = self.run.saved
            if not saved and self.plan is not None and not outgrows(self.plan.fingerprint, batch):
                saved = {batch_shape(batch): self.plan}
            self.run.shapes(self._config(trainer), saved, fake=self.fake, adjust=loop_allowance, verbose=self.verbose)
        self._batch_idx = batch_idx
        return self.run.follow(batch)  # a new bucket's plan, or one solved again after a calibration

    def _config(self, trainer: Trainer) -> RematConfig:
        """The config with DDP's gradient buckets where the trainer runs DDP over several processes."""
        from lightning.pytorch.strategies import DDPStrategy

        return self.run.config(self.config, isinstance(trainer.strategy, DDPStrategy) and trainer.world_size > 1)

    def _channel(self) -> Any:
        return torch_distributed_channel(self._trainer.strategy.root_device) if self._trainer.world_size > 1 else Channel()

    def _log_metrics(self, metrics: dict[str, float]) -> None:
        for logger in self._trainer.loggers:
            logger.log_metrics(metrics, step=self._trainer.global_step)

    @rank_zero_only
    def _print_plan(self, plan: Plan, title: str) -> None:
        if self.verbose:
            print_plan(plan, title=title)


def other_cost(plans: list, cost: Any) -> str | None:
    """How a saved plan (not a fallback) was priced in another cost than ``cost``, or None.

    >>> other_cost([Plan(cost_kind="flops", predicted_peak_bytes=1)], "roofline")
    'priced in flops, this run in roofline'
    """
    kinds = {CostKind.check(p.cost_kind) for p in plans if p is not None and not p.fallback}
    cost = CostKind.check(cost)
    return next((f"priced in {kind.value}, this run in {cost.value}" for kind in kinds if kind != cost), None)
