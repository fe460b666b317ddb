"""A LightningModule's ``training_step`` as the ``step(model) -> loss`` closure the engine profiles."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ...core.errors import SkippedStepError


def loss_of(output: Any) -> torch.Tensor:
    """The loss in what ``training_step`` returned: the tensor itself, or the dict's ``"loss"``.

    >>> loss_of(None)
    Traceback (most recent call last):
    ...
    lightning_remat.core.errors.SkippedStepError: training_step returned None (it skips this batch): lightning-remat profiles the first batch whose training_step returns a loss
    """
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if isinstance(output, torch.Tensor):
        return output
    if output is None:
        # Lightning's way to skip a batch: no loss here to profile (``AutoRemat`` plans on the next batch).
        raise SkippedStepError("training_step returned None (it skips this batch): lightning-remat profiles the "
                               "first batch whose training_step returns a loss")
    detail = f"a dict with keys {sorted(output)}" if isinstance(output, dict) else type(output).__name__
    raise TypeError("lightning-remat profiles training_step, which must return the loss tensor or a dict with a "
                    f"'loss' tensor; it returned {detail}")


def _muted(module: nn.Module) -> list[tuple[Any, str, Any]]:
    """``self.log``/``self.log_dict`` as no-ops: profiling calls ``training_step`` several times on one batch."""
    return [(module, name, lambda *args, **kwargs: None) for name in ("log", "log_dict")]


def _training_step(pl_module: nn.Module, batch: Any, batch_idx: int, trainer: Any) -> tuple[Callable, Any]:
    """``call(module)`` running ``training_step`` as Lightning calls it, and the trainer's precision context."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    pass_index = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)
    context = trainer.strategy.precision_plugin.train_step_context if trainer is not None else contextlib.nullcontext
    args = (batch, batch_idx) if pass_index else (batch,)
    return (lambda module: module.training_step(*args)), context


def training_step_closure(pl_module: nn.Module, batch: Any, batch_idx: int = 0,
                          trainer: Any = None) -> Callable[[nn.Module], torch.Tensor]:
    """``step(module)`` returning ``module.training_step(batch, batch_idx)``'s loss (``module``: or its twin).

    >>> import lightning.pytorch as L
    >>> class Lit(L.LightningModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.net = torch.nn.Linear(4, 1)
    ...     def training_step(self, batch, batch_idx):
    ...         self.log("loss", 1.0)           # muted while profiling
    ...         return {"loss": self.net(batch).sum()}
    >>> training_step_closure(Lit(), torch.ones(2, 4))(Lit()).shape
    torch.Size([])
    """
    call, context = _training_step(pl_module, batch, batch_idx, trainer)

    def step(module: nn.Module) -> torch.Tensor:
        with context(), _attributes_replaced([*_muted(module), *_own_steps(module)]):
            output = call(module)
        return loss_of(output)

    return step


def _own_steps(module: nn.Module) -> list[tuple[Any, str, Any]]:
    """A compiled module's instance-dict ``forward``/``training_step`` as its class's (else a twin runs the real one)."""
    if not getattr(module, "_compiler_ctx", None):
        return []
    return [(module, name, getattr(type(module), name).__get__(module))
            for name in ("forward", "training_step") if name in module.__dict__]


def _no_step(closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
    # An optimizer given a closure (LBFGS, or ``opt.step(closure=...)``) runs the forward in it.
    return closure() if callable(closure) else None


@contextlib.contextmanager
def _attributes_replaced(replacements: list[tuple[Any, str, Any]]) -> Iterator[None]:
    saved = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _ in replacements]
    for obj, name, value in replacements:
        obj.__dict__[name] = value
    try:
        yield
    finally:
        for obj, name, before in saved:
            if before is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = before


_MISSING = object()


def _zero_grad_in_passes(optimizer: Any) -> Callable[..., None]:
    """``optimizer.zero_grad`` run only with gradients enabled (a prediction's forward must not drop the training's)."""
    original = optimizer.zero_grad

    def zero_grad(*args: Any, **kwargs: Any) -> None:
        if torch.is_grad_enabled():
            original(*args, **kwargs)
    return zero_grad


def _held_still(trainer: Any) -> list[tuple[Any, str, Any]]:
    """The optimizers' and schedulers' ``step`` made a no-op, and their ``zero_grad`` outside passes with gradients."""
    if trainer is None:
        return []
    optimizers = [*trainer.optimizers, *getattr(trainer.strategy, "_lightning_optimizers", [])]
    schedulers = [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", [])]
    return ([(o, "step", _no_step) for o in optimizers + schedulers]
            + [(o, "zero_grad", _zero_grad_in_passes(o)) for o in optimizers])


class _BackwardDone(torch.autograd.Function):
    """A manual step's loss once ``training_step`` ran every backward: the losses' sum, whose backward does nothing."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:  # type: ignore[override]
        return None, None


def manual_step_closure(pl_module: nn.Module, batch: Any, batch_idx: int = 0,
                        trainer: Any = None) -> Callable[[nn.Module], torch.Tensor]:
    """``step(module)`` under manual optimization: ``manual_backward`` runs where called, optimizer and scheduler
    steps do nothing (the profile counts them itself), and the loss returned has an empty backward."""
    call, context = _training_step(pl_module, batch, batch_idx, trainer)

    def step(module: nn.Module) -> torch.Tensor:
        losses: list[torch.Tensor] = []

        def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            losses.append(loss.detach())
            if loss.requires_grad:  # not under torch.no_grad() (a prediction's forward)
                loss.backward(*args, **kwargs)

        replaced = [(module, "manual_backward", backward), *_held_still(trainer), *_muted(module),
                    *_own_steps(module)]
        with context(), _attributes_replaced(replaced):
            call(module)
        if not losses:
            raise SkippedStepError("training_step made no self.manual_backward(loss) call (it skips this batch): "
                                   "lightning-remat profiles the first batch whose training_step runs one")
        return _BackwardDone.apply(losses[-1].new_empty(0).requires_grad_(), sum(losses))

    return step
