"""One training run through each hand-written loop, with the package (a byte budget) or without it
(None); ``trainers`` runs Lightning's and the Hugging Face Trainer's loops, ``runners`` names them all.

Every run trains a fresh model from ``seed`` (dropout drawn from ``seed + 1``) on the same batches
with Adam (AdamW in the Hugging Face Trainer, its own), and records every step (``Recorder``). Where
a step's window opens and closes, so that the package's own work inside the step counts:

- ``shape_plans`` / ``fabric`` / ``accelerate``: the loop is the harness's: the window opens before
  ``ShapePlans.use(batch)`` (or the forward, whose pre-hooks are the Accelerate session's) and closes
  after ``optimizer.step()`` and ``zero_grad(set_to_none=True)``; what the session does at the
  optimizer step (planning after the observed step) is inside.
- Lightning and the Hugging Face Trainer: ``trainers``.

A split of one profile of the whole run by ``record_function`` markers would see the same events;
hooks keep each window's memory alive at its start exact (``TorchPeak`` reads it when it opens).
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable

import torch
from torch import nn

from .recorder import Recorder, RunRecord
from .zoo import ModelSpec

LR = 1e-2


def quiet(runner: Callable[..., RunRecord]) -> Callable[..., RunRecord]:
    """``runner`` without the frameworks' chatter, which comes back after it: the levels it sets are
    process-wide, and left at ERROR they hid ``AutoRemat``'s ``rank_zero_info`` from a later test's
    ``caplog`` (tests/test_faults.py's fallback test failed after the Lightning cases)."""
    names = ("lightning.pytorch", "lightning.fabric", "lightning", "transformers", "accelerate")

    @functools.wraps(runner)
    def quietly(*args: Any, **kwargs: Any) -> RunRecord:
        levels = {name: logging.getLogger(name).level for name in names}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=".*(GPU available|TPU available|LOCAL_RANK|`max_epochs`).*")
            for name in names:
                logging.getLogger(name).setLevel(logging.ERROR)
            try:
                return runner(*args, **kwargs)
            finally:
                for name, level in levels.items():
                    logging.getLogger(name).setLevel(level)

    return quietly


def hand_loop(rec: Recorder, model: nn.Module, optimizer: Any, batches: list, loss_of: Callable[[Any], Any],
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
    used: list[Any] = [None]  # the plan ``use`` returned for the step: the plan in effect
    rec = Recorder(model, model, None if plans is None else (lambda: used[0]))
    torch.manual_seed(seed + 1)
    error = hand_loop(rec, model, optimizer, batches, lambda batch: spec.loss(model, batch),
                      lambda loss: loss.backward(), None if plans is None else using_plans(plans, used))
    return rec.finish(error)


def using_plans(plans: Any, used: list[Any]) -> Callable[[Any], None]:
    """``plans.use(batch)`` before a step, keeping the plan it returns in ``used[0]``."""
    def before(batch: Any) -> None:
        used[0] = plans.use(batch)
    return before


@quiet
def run_fabric(spec: ModelSpec, batches: list, budget: int | None, seed: int, variant: str = "") -> RunRecord:
    """Fabric with ``ShapePlans`` made on the ``_FabricModule`` and ``_FabricOptimizer`` (docs/shapes.md);
    ``variant="recipe"``: docs/fabric.md's recipe, ``plan_remat`` on the first batch and ``apply_plan``
    (in the first step's window: its profiling pass is part of the run's memory too)."""
    import lightning as L

    from lightning_remat import ShapePlans, apply_plan, plan_remat

    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = spec.build(seed)
    wrapped, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
    made: list[Any] = []  # the plan in effect
    before = None
    if budget is not None and variant == "recipe":
        def before(batch: Any) -> None:
            if not made:
                made.append(plan_remat(wrapped, lambda m: spec.loss(m, batch), budget, optimizer=optimizer,
                                       candidates=spec.candidates_under(""), cost="flops", verbose=False))
                apply_plan(wrapped, made[0])
    elif budget is not None:
        plans = ShapePlans(wrapped, spec.loss, budget, optimizer=optimizer, cost="flops",
                           candidates=spec.candidates_under(""), verbose=False)
        made.append(None)
        before = using_plans(plans, made)
    plan_of = lambda: made[0] if made else None  # noqa: E731
    rec = Recorder(model, model, None if budget is None else plan_of)
    torch.manual_seed(seed + 1)
    error = hand_loop(rec, wrapped, optimizer, batches, lambda batch: spec.loss(wrapped, batch), fabric.backward,
                      before)
    return rec.finish(error)


@quiet
def run_accelerate(spec: ModelSpec, batches: list, budget: int | None, seed: int,
                   variant: str = "accelerator") -> RunRecord:
    """``RematAccelerator`` (``variant="accelerator"``), or the stock ``Accelerator`` with
    ``prepare_remat`` before or after ``accelerator.prepare``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from lightning_remat.accelerate import RematAccelerator, RematPlugin, prepare_remat, remat_session

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
    error = hand_loop(rec, prepared, optimizer, batches, lambda batch: spec.loss(prepared, batch),
                       accelerator.backward)
    session = remat_session(prepared)
    if session is not None and error is None:  # after an error the session is left as the error left it
        session.remove()
    AcceleratorState._reset_state(True)
    return rec.finish(error)


HAND_WRITTEN: dict[str, Callable[..., RunRecord]] = {
    "shape_plans": run_shape_plans, "fabric": run_fabric, "accelerate": run_accelerate}
