"""A LightningModule's ``training_step`` as the ``step(model) -> loss`` closure the engine profiles.

The callbacks and the command line all profile or try a LightningModule through its own
``training_step``; this is the one place that turns it into a loss closure.

Example:
    >>> import torch, lightning.pytorch as L
    >>> class Lit(L.LightningModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.net = torch.nn.Linear(4, 1)
    ...     def training_step(self, batch, batch_idx):
    ...         self.log("loss", 1.0)           # muted while profiling
    ...         return {"loss": self.net(batch).sum()}
    >>> step = training_step_closure(Lit(), torch.ones(2, 4))
    >>> step(Lit()).shape
    torch.Size([])
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn


def loss_of(output: Any) -> torch.Tensor:
    """The loss in what ``training_step`` returned: the tensor itself, or the dict's ``"loss"``.

    Example:
        >>> loss_of({"loss": torch.tensor(1.0)}).item()
        1.0
    """
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if isinstance(output, torch.Tensor):
        return output
    detail = f"a dict with keys {sorted(output)}" if isinstance(output, dict) else type(output).__name__
    raise TypeError("lightning-remat profiles training_step, which must return the loss tensor or a dict with a "
                    f"'loss' tensor; it returned {detail}")


@contextlib.contextmanager
def logging_muted(module: nn.Module) -> Iterator[None]:
    """Make ``self.log``/``self.log_dict`` no-ops while ``training_step`` runs outside the fit loop.

    Profiling and trial steps call ``training_step`` several times on one batch; those calls must
    not reach the logger (the same loss, several times, under the wrong hook).
    """
    saved = {name: module.__dict__[name] for name in ("log", "log_dict") if name in module.__dict__}
    module.__dict__["log"] = lambda *args, **kwargs: None
    module.__dict__["log_dict"] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            module.__dict__.pop(name, None)
        module.__dict__.update(saved)


def training_step_closure(pl_module: nn.Module, batch: Any, batch_idx: int = 0,
                          trainer: Any = None) -> Callable[[nn.Module], torch.Tensor]:
    """``step(module)`` running ``module.training_step(batch, batch_idx)`` and returning its loss.

    ``module`` is the LightningModule itself or its fake-tensor twin. With a ``trainer``, the step
    runs in its precision plugin's training context (autocast), as a real training step does.
    """
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    pass_index = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)
    context = trainer.strategy.precision_plugin.train_step_context if trainer is not None else contextlib.nullcontext

    def step(module: nn.Module) -> torch.Tensor:
        with context(), logging_muted(module):
            output = module.training_step(batch, batch_idx) if pass_index else module.training_step(batch)
        return loss_of(output)

    return step


def training_step_shape_plans(pl_module: nn.Module, trainer: Any, batch_idx: Callable[[], int], *, config: Any,
                              adjust: Any = None, install: Any = None, hint: str = "",
                              saved: dict | None = None) -> Any:
    """A ``ShapePlans`` (``service.shape_plans``) whose loss is ``pl_module.training_step`` on a batch,
    over ``trainer``'s ranks (None: one process, no optimizer), with ``saved`` plans (shape -> plan)
    taken as they are. ``batch_idx()`` is the index the step is called with (the current batch's).

    Example:
        >>> import torch, lightning.pytorch as L
        >>> from lightning_remat import RematConfig
        >>> class Lit(L.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
        ...                                                              torch.nn.Linear(32, 8)) for _ in range(3)])
        ...     def training_step(self, batch, batch_idx):
        ...         return self.net(batch).square().mean()
        >>> plans = training_step_shape_plans(Lit(), None, lambda: 0, config=RematConfig("min", cost="flops"))
        >>> plan = plans.use(torch.randn(64, 8))
        >>> plans.counts.real_profiles, plan.predicted_peak_bytes <= plan.baseline_peak_bytes
        (1, True)
    """
    from ...service.shape_plans import ShapePlans
    from .channel import lightning_channel

    def loss(module: nn.Module, batch: Any) -> torch.Tensor:
        return training_step_closure(pl_module, batch, batch_idx(), trainer)(module)

    optimizer = trainer.optimizers[0] if trainer is not None and trainer.optimizers else None
    plans = ShapePlans(pl_module, loss, config=config, optimizer=optimizer, adjust=adjust, install=install,
                       channel=lightning_channel(trainer) if trainer is not None else None, hint=hint)
    for shape, plan in (saved or {}).items():
        plans.seed(shape, plan)
    return plans
