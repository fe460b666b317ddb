"""One training run through each integration, with the package (a byte budget) or without it (None).

Every run trains a fresh model from ``seed`` (dropout drawn from ``seed + 1``) on the same batches
with Adam (AdamW in the Hugging Face Trainer, its own), and records every step (``Recorder``). Where
a step's window opens and closes, so that the package's own work inside the step counts:

- ``shape_plans`` / ``fabric`` / ``accelerate``: the loop is the harness's: the window opens before
  ``ShapePlans.use(batch)`` (or the forward, whose pre-hooks are the Accelerate session's) and closes
  after ``optimizer.step()`` and ``zero_grad(set_to_none=True)``; what the session does at the
  optimizer step (planning after the observed step) is inside.
- ``lightning``: a callback first among the Trainer's callbacks, so its ``on_train_batch_start``
  runs before ``AutoRemat``'s (where planning runs) and its ``on_train_batch_end`` after the
  optimizer step; it then drops the gradients (``zero_grad(set_to_none=True)``, in both runs: the
  profiler cannot see the frees of what was allocated before a window opens).
- ``hf_trainer``: a ``TrainerCallback`` first among the callbacks: ``on_step_begin`` to
  ``on_step_end`` (the Trainer zeroes the gradients before ``on_step_end``).

A split of one profile of the whole run by ``record_function`` markers would see the same events;
hooks keep each window's memory alive at its start exact (``TorchPeak`` reads it when it opens).
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from typing import Any, Callable

import torch
from torch import nn

from .recorder import Recorder, RunRecord
from .zoo import ModelSpec

LR = 1e-2
VARIANTS = {"shape_plans": ("",), "fabric": ("",), "lightning": ("",), "hf_trainer": ("",),
            "accelerate": ("accelerator", "prepare_before", "prepare_after")}


def _quiet() -> None:
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*(GPU available|TPU available|LOCAL_RANK|`max_epochs`).*")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning", "transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _hand_loop(rec: Recorder, model: nn.Module, optimizer: Any, batches: list, loss_of: Callable[[Any], Any],
               backward: Callable[[Any], None], before: Callable[[Any], Any] | None = None) -> BaseException | None:
    """The loop of ``shape_plans``, ``fabric`` and ``accelerate``: per batch, the window around
    ``before(batch)``, forward, backward, the optimizer step and ``zero_grad``."""
    try:
        for batch in batches:
            rec.begin(model, optimizer)
            if before is not None:
                before(batch)
            loss = loss_of(batch)
            with rec.backward():
                backward(loss)
            rec.check("after backward", behaviour=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            rec.check("after the step")
            rec.end(loss)
            del loss
    except Exception as error:  # noqa: BLE001 - recorded: the harness judges it
        return error
    return None


def run_shape_plans(spec: ModelSpec, batches: list, budget: int | None, seed: int, variant: str = "") -> RunRecord:
    from lightning_remat import ShapePlans

    model = spec.build(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    plans = None if budget is None else ShapePlans(model, spec.loss, budget, optimizer=optimizer, cost="flops",
                                                   candidates=spec.candidates_under(""), verbose=False)
    rec = Recorder(model, model, None if plans is None else (lambda: plans.installed))
    torch.manual_seed(seed + 1)
    error = _hand_loop(rec, model, optimizer, batches, lambda batch: spec.loss(model, batch),
                       lambda loss: loss.backward(), None if plans is None else plans.use)
    return rec.finish(error)


def run_fabric(spec: ModelSpec, batches: list, budget: int | None, seed: int, variant: str = "") -> RunRecord:
    """Fabric with ``ShapePlans`` made on the ``_FabricModule`` and ``_FabricOptimizer`` (docs/shapes.md)."""
    import lightning as L

    from lightning_remat import ShapePlans

    _quiet()
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = spec.build(seed)
    wrapped, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
    plans = None if budget is None else ShapePlans(wrapped, spec.loss, budget, optimizer=optimizer, cost="flops",
                                                   candidates=spec.candidates_under(""), verbose=False)
    rec = Recorder(model, model, None if plans is None else (lambda: plans.installed))
    torch.manual_seed(seed + 1)
    error = _hand_loop(rec, wrapped, optimizer, batches, lambda batch: spec.loss(wrapped, batch), fabric.backward,
                       None if plans is None else plans.use)
    return rec.finish(error)


def run_accelerate(spec: ModelSpec, batches: list, budget: int | None, seed: int,
                   variant: str = "accelerator") -> RunRecord:
    """``RematAccelerator`` (``variant="accelerator"``), or the stock ``Accelerator`` with
    ``prepare_remat`` before or after ``accelerator.prepare``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from lightning_remat.accelerate import RematAccelerator, RematPlugin, prepare_remat, remat_session

    _quiet()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    model = spec.build(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    plugin = RematPlugin(budget=budget, cost="flops", candidates=spec.candidates_under("")) if budget else None
    if plugin is not None and variant == "accelerator":
        accelerator = RematAccelerator(cpu=True, remat_plugin=plugin)
    else:
        accelerator = Accelerator(cpu=True)
    if plugin is not None and variant == "prepare_before":
        prepare_remat(model, plugin, accelerator=accelerator)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    if plugin is not None and variant == "prepare_after":
        prepare_remat(prepared, plugin, accelerator=accelerator)

    def plan() -> Any:
        session = remat_session(prepared)
        return None if session is None else session.plan

    rec = Recorder(model, model, None if plugin is None else plan)
    torch.manual_seed(seed + 1)
    error = _hand_loop(rec, prepared, optimizer, batches, lambda batch: spec.loss(prepared, batch),
                       accelerator.backward)
    session = remat_session(prepared)
    if session is not None:
        session.remove()
    AcceleratorState._reset_state(True)
    return rec.finish(error)


def run_lightning(spec: ModelSpec, batches: list, budget: int | None, seed: int, variant: str = "") -> RunRecord:
    """A ``LightningModule`` holding the model at ``model``, ``AutoRemat(budget, cost="flops")``."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from lightning_remat import AutoRemat

    _quiet()

    class Zoo(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = spec.build(seed)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return spec.loss(self.model, batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=LR)

    callback = None if budget is None else AutoRemat(budget=budget, cost="flops", verbose=False,
                                                     candidates=spec.candidates_under("model."))
    module = Zoo()
    rec = Recorder(module, module.model, None if callback is None else (lambda: callback.plan))

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            rec.begin(pl_module, trainer.optimizers)

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            rec._in_backward = True

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            rec._in_backward = False
            rec.check("after backward", behaviour=True)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            rec.check("after the step")
            rec.end(outputs["loss"])
            pl_module.zero_grad(set_to_none=True)

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=len(batches), max_epochs=1, logger=False,
                        callbacks=[Probe(), *([callback] if callback else [])], enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    torch.manual_seed(seed + 1)
    try:
        trainer.fit(module, DataLoader(batches, batch_size=None))
    except Exception as error:  # noqa: BLE001 - recorded
        return rec.finish(error)
    return rec.finish()


def run_hf_trainer(spec: ModelSpec, batches: list, budget: int | None, seed: int, variant: str = "") -> RunRecord:
    """The Hugging Face ``Trainer`` (its own AdamW, seed, gradient clipping) with ``RematTrainerCallback``;
    a collator that hands out the drawn batches in order (one index per step)."""
    import transformers

    from lightning_remat import RematTrainerCallback

    _quiet()
    transformers.logging.set_verbosity_error()
    model = spec.build(seed)
    callback = None if budget is None else RematTrainerCallback(budget=budget, cost="flops")
    rec = Recorder(model, model, None if callback is None else (lambda: callback.plan))
    losses: list[float] = []

    class Recording(transformers.Trainer):
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            losses.append(float(loss))
            return loss

    class Probe(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                          **kwargs: Any) -> None:
            rec.begin(model, optimizer)

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rec.check("after backward", behaviour=True)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rec.check("after the step")
            rec.end(losses[-1])

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=1, max_steps=len(batches), report_to=[], use_cpu=True,
            logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=seed,
            learning_rate=LR, remove_unused_columns=False, train_sampling_strategy="sequential")
        trainer = Recording(model=model, args=args, train_dataset=list(range(len(batches))),
                            data_collator=lambda features: batches[features[0]],
                            callbacks=[Probe(), *([callback] if callback else [])])
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # the log dicts on stdout
        backward = trainer.accelerator.backward

        def recorded_backward(loss: Any, **kwargs: Any) -> Any:
            with rec.backward():
                return backward(loss, **kwargs)

        trainer.accelerator.backward = recorded_backward
        try:
            trainer.train()
        except Exception as error:  # noqa: BLE001 - recorded
            return rec.finish(error)
    return rec.finish()


RUNNERS: dict[str, Callable[..., RunRecord]] = {
    "shape_plans": run_shape_plans, "fabric": run_fabric, "lightning": run_lightning,
    "accelerate": run_accelerate, "hf_trainer": run_hf_trainer,
}
