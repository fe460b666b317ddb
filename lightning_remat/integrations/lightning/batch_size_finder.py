"""``RematBatchSizeFinder``: Lightning's ``BatchSizeFinder`` with optimal recomputation in the loop."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.tuner.batch_size_scaling import _reset_dataloaders
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ...core.batch_fit import DEFAULT_MAX_BATCH_SIZE, SEARCH_MODES, validate_search
from ...core.config import DEFAULT_COST, ProfileOptions, RematConfig
from ...core.errors import UnsupportedShardingError
from ...core.plan import Plan, saved_plan
from ...core.plan_checks import check_saved_state
from ...report.render import batch_size_table, print_renderables
from ...runtime.installing.apply import apply_plan
from ...runtime.installing.fingerprint import mismatch
from ...service.batch_size import BatchSizeResult, find_remat_batch_size
from .step import training_step_closure


def _check_distributed(trainer: "pl.Trainer") -> None:
    """Only ModelParallelStrategy (FSDP2 in ``configure_model``) is searched across processes."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if not isinstance(trainer.strategy, ModelParallelStrategy):
        raise UnsupportedShardingError(
            f"RematBatchSizeFinder under {type(trainer.strategy).__name__}: across processes the batch-size search "
            "runs only under ModelParallelStrategy with fully_shard in configure_model (FSDP2), where every rank "
            "searches in lockstep. Otherwise find the batch size in one process (devices=1) and train with it, or "
            "call find_remat_batch_size on every rank of a model sharded with fully_shard.")


class RematBatchSizeFinder(BatchSizeFinder):
    """Before fit, find the largest batch size within a budget and apply its plan (docs/batch_size.md).

    >>> RematBatchSizeFinder(budget="2GB", margin=0.05).batch_size is None
    True
    >>> trainer = L.Trainer(callbacks=[RematBatchSizeFinder(budget="10GB")])  # doctest: +SKIP
    """

    SUPPORTED_MODES = SEARCH_MODES

    def __init__(
        self,
        budget: Union[int, str],
        mode: str = "binsearch",
        steps_per_trial: int = 1,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.0,
        max_overhead: float = 0.35,
        max_val: int = DEFAULT_MAX_BATCH_SIZE,
        cost: str | None = DEFAULT_COST,
        verbose: bool = True,
        offload: bool = False,
        candidates: Optional[list[str]] = None,
        policies: Optional[Sequence[str]] = (),
    ) -> None:
        validate_search(max_overhead, margin, steps_per_trial, init_val, max_val, mode.lower(), max_trials)
        self.config = RematConfig(budget, cost=cost, profile=ProfileOptions(candidates=candidates, policies=policies,
                                                                            offload=offload))
        self.config.require_size("a batch-size search")
        super().__init__(mode=mode, steps_per_trial=steps_per_trial, init_val=init_val, max_trials=max_trials,
                         batch_arg_name=batch_arg_name, margin=margin, max_val=max_val)
        self.budget = budget
        self._verbose = verbose
        # find_remat_batch_size's own arguments, checked above.
        self._search = dict(max_overhead=max_overhead, cost=cost, offload=bool(offload),
                            candidates=self.config.profile.candidates, policies=self.config.profile.policies,
                            verbose=verbose)
        self.optimal_batch_size = None
        self.plan: Optional[Plan] = None
        self.result: Optional[BatchSizeResult] = None
        self._restored = False

    @property
    def batch_size(self) -> Optional[int]:
        """The batch size found (``optimal_batch_size``, as on ``BatchSizeFinder``)."""
        return self.optimal_batch_size

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: Optional[str] = None) -> None:
        if stage != "fit":
            return
        # Said before BatchSizeFinder's own checks, which name fewer places.
        if not lightning_hasattr(pl_module, self._batch_arg_name):
            places = [f"the LightningModule ({type(pl_module).__name__})", "its hparams"]
            datamodule = getattr(trainer, "datamodule", None)
            if datamodule is not None:
                places += [f"the datamodule ({type(datamodule).__name__})", "the datamodule's hparams"]
            else:
                places.append("no datamodule (none was passed to the Trainer)")
            raise MisconfigurationException(
                f"RematBatchSizeFinder: the batch size attribute {self._batch_arg_name!r} does not exist. Looked in "
                f"{', '.join(places)}. Set `batch_arg_name` to the attribute your train_dataloader "
                f"reads, or define `{self._batch_arg_name}` there (e.g. with `self.save_hyperparameters()`).")
        if not pl_module.automatic_optimization:
            raise MisconfigurationException("RematBatchSizeFinder needs automatic optimization: trial steps run "
                                            "training_step and step the optimizer themselves.")
        if trainer._accelerator_connector.is_distributed:
            # BatchSizeFinder refuses distributed strategies; under ModelParallelStrategy every rank searches.
            _check_distributed(trainer)
            if not trainer.fit_loop._data_source.is_module():
                raise MisconfigurationException(
                    "RematBatchSizeFinder cannot be used with dataloaders passed directly to `.fit()`: define "
                    "train_dataloader in the LightningModule or a LightningDataModule.")
            return
        super().setup(trainer, pl_module, stage)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.fast_dev_run:
            rank_zero_warn("Skipping RematBatchSizeFinder since `fast_dev_run` is enabled.")
            return
        found = mismatch(pl_module, self.plan.fingerprint) if self._restored and self.plan is not None else None
        if found:
            rank_zero_warn(f"RematBatchSizeFinder: the saved plan was made for another model ({found}); "
                           "searching again.")
            self._restored = False
        if self._restored and self.optimal_batch_size is not None and self.plan is not None:
            # Resumed from a checkpoint: no new search, the same batch and plan.
            self._restored = False
            self._set_batch_size(trainer, pl_module, self.optimal_batch_size)
            apply_plan(pl_module, self.plan)
            return
        self.scale_batch_size(trainer, pl_module)

    def scale_batch_size(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> BatchSizeResult:
        """Run the search, set the batch size, rebuild the dataloaders, apply the plan and report."""
        optimizers = trainer.optimizers
        if len(optimizers) > 1:
            rank_zero_warn("RematBatchSizeFinder: several optimizers; only the first is stepped in trials.")
        original = lightning_getattr(pl_module, self._batch_arg_name)
        max_val = self._max_val
        try:  # at most the dataset's length
            max_val = min(max_val, max(1, len(trainer.fit_loop._data_source.dataloader().dataset)))
        except Exception:  # noqa: BLE001 - iterable datasets, combined loaders: no cap
            pass

        def make_step(batch_size: int):
            lightning_setattr(pl_module, self._batch_arg_name, batch_size)
            batch = next(iter(trainer.fit_loop._data_source.dataloader()))
            return training_step_closure(pl_module, pl_module._apply_batch_transfer_handler(batch), 0, trainer)

        try:
            result = find_remat_batch_size(
                pl_module, make_step, self.budget, optimizer=optimizers[0] if optimizers else None,
                init_val=min(self._init_val, max_val), max_val=max_val, steps_per_trial=self._steps_per_trial,
                margin=self._margin, mode=self._mode, max_trials=self._max_trials, apply=False, **self._search)
        except BaseException:
            lightning_setattr(pl_module, self._batch_arg_name, original)
            raise
        self._set_batch_size(trainer, pl_module, result.batch_size)
        apply_plan(pl_module, result.plan)
        self.result, self.plan, self.optimal_batch_size = result, result.plan, result.batch_size
        self._report(trainer, result)
        return result

    def _set_batch_size(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch_size: int) -> None:
        lightning_setattr(pl_module, self._batch_arg_name, batch_size)
        _reset_dataloaders(trainer)  # as BatchSizeFinder does after a new size

    def _report(self, trainer: "pl.Trainer", result: BatchSizeResult) -> None:
        metrics = result.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        rank_zero_info(
            f"RematBatchSizeFinder: batch size {result.batch_size} with {len(result.plan.checkpointed)} module(s) "
            f"recomputed (predicted overhead {result.predicted_overhead:.1%}); without recomputation "
            f"{result.batch_size_without_remat} fits ({result.ratio:.2f}x)")
        if self._verbose and trainer.is_global_zero:
            print_renderables([batch_size_table(result)])

    def state_dict(self) -> dict[str, Any]:
        return {"batch_size": self.optimal_batch_size, "plan": self.plan.to_dict() if self.plan is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        owner = "RematBatchSizeFinder's checkpoint state"
        check_saved_state(state_dict, owner)
        self.plan = saved_plan(state_dict.get("plan"), owner)
        self.optimal_batch_size = state_dict.get("batch_size")
        self._restored = self.optimal_batch_size is not None and self.plan is not None
