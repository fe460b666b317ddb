"""The first training step, planned on fake tensors at its forward's pre-hook (docs/accelerate.md, "The loss")."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ...core.allowances import USER_LOSS_OUTPUT_COPIES
from ...core.budget import format_bytes
from ...core.memory_model import Profile, Segment
from ...runtime.profiling.batch_shape import batch_tensors
from .recorded_call import CallTemplate, RecordedCall, calibrate, scalar_loss, with_loop_references


@dataclass(frozen=True)
class FirstCall(CallTemplate):
    """A training forward whose backward has not run; ``seen``: shape -> (own loss, bytes of outputs needing grad).

    >>> call = FirstCall.of((torch.randn(4, 8),), {})
    >>> call.loss(nn.Linear(8, 3)).shape, call.seen[call.shape]   # no loss of its own: the surrogate
    (torch.Size([]), (False, 48))
    """

    seen: dict = field(default_factory=dict)

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "FirstCall":  # type: ignore[override]
        return super().of(RecordedCall(args=args, kwargs=dict(kwargs)))

    def loss(self, model: nn.Module) -> torch.Tensor:
        """Re-run the call on ``model``: its own loss, else a surrogate over every output requiring a gradient."""
        args, kwargs = self.inputs()
        output = model(*args, **kwargs)
        own = scalar_loss(output)
        floats = [t for t in batch_tensors(output) if t is not own and t.is_floating_point()]
        outputs = [t for t in floats if t.requires_grad]
        if torch.is_grad_enabled():  # (the profile also runs forwards without gradients)
            self.seen[self.shape] = (own is not None, sum(t.numel() * t.element_size() for t in outputs))
        if own is not None:
            return own
        terms = [(t * torch.zeros_like(t)).sum().float() for t in outputs or floats]
        if not terms:
            raise ValueError("lightning-remat: the model's training forward returned no floating-point tensor: "
                             "there is no backward to plan")
        return terms[0] if len(terms) == 1 else torch.stack(terms).sum()

    def adjust(self, profile: Profile) -> Profile:
        """The profile at the first shape with the loss scalars and, without a loss of the model's, the user's."""
        profile = with_loop_references(profile, 0)
        own, output_bytes = self.seen.get(self.shape, (True, 0))
        return profile if own else with_user_loss_allowance(profile, USER_LOSS_OUTPUT_COPIES * output_bytes)


def observed_adjust(held: int, carried: int, observed: tuple[int, bool] | None, actions: Any = ()) -> Any:
    """``adjust(profile)`` for the observed call: ``with_loop_references`` then ``calibrate`` by ``observed``."""
    def adjust(profile: Profile) -> Profile:
        profile = with_loop_references(profile, held, carried)
        return calibrate(profile, *observed, actions=actions) if observed is not None else profile
    return adjust


def with_user_loss_allowance(profile: Profile, nbytes: int) -> Profile:
    """``nbytes`` for a loss computed outside the model, at the end of forward, on top of the model's memory there.

    >>> from lightning_remat.core.memory_model import StageAction, StageOption, StageProfile
    >>> p = Profile((StageProfile("a", (StageOption("keep", StageAction("a"), 100, 150),)),), (Segment("head", 1, 50),))
    >>> with_user_loss_allowance(p, 64).baseline_peak_bytes   # the head's 50 and the stored 100, and 64
    214
    """
    n = len(profile.stages)
    if not n or nbytes <= 0:
        return profile
    at_end = [s.peak_bytes for s in profile.segments if s.stages_alive == n]
    base = max(at_end) if at_end else profile.stages[-1].options[0].local_peak_bytes
    loss = Segment("outside the model: the user's loss (an allowance until a step is observed)", n, base + nbytes)
    note = (f"planned before the first step, whose loss is computed outside the model: it is allowed "
            f"{format_bytes(nbytes)} ({USER_LOSS_OUTPUT_COPIES} copies of the model's outputs) at the end of forward")
    return replace(profile, segments=(*profile.segments, loss), notes=(*profile.notes, note)).with_baseline()


def redirected_call(args: tuple) -> str | None:
    """Why a forward given a module or method as argument cannot be planned, or None: a forward redirection
    (TRL's ``_ForwardRedirection``) runs the trainer's loss as the model's forward, which cannot be replayed.

    >>> redirected_call((torch.ones(2, 3),)) is None, "forward redirection" in redirected_call((nn.Linear(2, 2),))
    (True, True)
    """
    found = [a for a in args if isinstance(a, nn.Module) or inspect.ismethod(a)]
    if not found:
        return None
    return (f"lightning-remat: the model's training forward was called with {type(found[0]).__name__} "
            f"{getattr(found[0], '__qualname__', '')} among its arguments: a forward redirection (TRL's "
            "_ForwardRedirection, used by DistillationTrainer, runs the trainer's loss function as the model's forward "
            "for one call), which the session cannot replay to plan it. Plan before building the trainer: "
            "plan = lightning_remat.plan_remat(model, step, budget, fake=True), then apply_plan(model, plan) "
            "(docs/accelerate.md, \"TRL\").").replace("  ", " ")
