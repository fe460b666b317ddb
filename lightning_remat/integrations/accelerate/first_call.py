"""The first training step under Accelerate (and the Hugging Face Trainer), planned before it runs.

No real step runs without a plan where it might not fit, so the session plans at the first training
forward's pre-hook, from that forward's inputs alone: the loss is not known yet (the loop computes it
after the forward and runs backward on it). The rule (``FirstCall``):

- the model returns its own loss (a scalar tensor, or Hugging Face outputs with ``.loss``, as a
  Trainer's model given labels does): that loss is profiled, as the observed step will run it;
- else a surrogate loss: every floating-point output that requires a gradient receives one (the
  size of the output), so the backward runs through all of them, and the user's loss computed
  outside the model is allowed ``USER_LOSS_OUTPUT_COPIES`` copies of those outputs at the end of
  forward, where it runs (``with_user_loss_allowance``): a cross-entropy keeps its log-softmax and
  its backward makes a temporary of the logits' size.

The profile is on fake tensors (nothing is allocated), so planning fits wherever the step does.
After the first step, run under this plan, the recorded call (which outputs the real loss sent a
gradient to, and the step's measured peak) replaces the rule (``recorded_call.calibrate``).

Example:
    >>> import torch
    >>> from torch import nn
    >>> call = FirstCall.of((torch.randn(4, 8),), {})
    >>> loss = call.loss(nn.Linear(8, 3))          # no loss of its own: the surrogate
    >>> loss.shape, call.seen[call.shape]           # (it returned a loss, bytes of outputs needing a gradient)
    (torch.Size([]), (False, 48))
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ...core.allowances import USER_LOSS_OUTPUT_COPIES
from ...core.budget import format_bytes
from ...core.memory_model import Profile, Segment
from ...core.shapes import Shape
from .recorded_call import CallTemplate, RecordedCall, calibrate, scalar_loss, tensor_leaves, with_loop_references


@dataclass(frozen=True)
class FirstCall:
    """A training forward whose backward has not run: its inputs (kept as ``CallTemplate`` keeps
    them) and, once re-run, what its outputs were at each shape (``seen``: shape -> (the model
    returned its own loss, bytes of the floating-point outputs that require a gradient))."""

    template: CallTemplate
    seen: dict = field(default_factory=dict)

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "FirstCall":
        return cls(CallTemplate.of(RecordedCall(args=args, kwargs=dict(kwargs))))

    @property
    def shape(self) -> Shape:
        return self.template.shape

    def at(self, shape: Shape) -> "FirstCall":
        """The call stretched to ``shape`` (sharing ``seen``)."""
        return replace(self, template=self.template.at(shape))

    def following(self, args: tuple, kwargs: dict, shape: Shape | None = None) -> "FirstCall":
        """The call at the shape of another call (``CallTemplate.following``; sharing ``seen``)."""
        return replace(self, template=self.template.following(args, kwargs, shape))

    def loss(self, model: nn.Module) -> torch.Tensor:
        """Re-run the call on ``model``: its own loss, else the surrogate over every output that
        requires a gradient."""
        args, kwargs = self.template.inputs()
        output = model(*args, **kwargs)
        own = scalar_loss(output)
        floats = [t for t in tensor_leaves(output) if t is not own and t.is_floating_point()]
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
        """The profile at the first shape with what the loop keeps around the model: the loss
        scalars (``with_loop_references``) and, where the model returned no loss, the allowance for
        the user's (``with_user_loss_allowance``)."""
        profile = with_loop_references(profile, 0)
        own, output_bytes = self.seen.get(self.shape, (True, 0))
        return profile if own else with_user_loss_allowance(profile, USER_LOSS_OUTPUT_COPIES * output_bytes)


@dataclass(frozen=True)
class ObservedCall:
    """The observed call itself, as ``ShapePlans`` sees a batch once a step ran: profiled with its
    real inputs and the gradients its outputs received, stretched to other shapes through its
    template (``CallTemplate``)."""

    call: RecordedCall
    shape: Any

    def loss(self, model: nn.Module) -> torch.Tensor:
        return self.call.loss(model)

    def at(self, shape: Any) -> Any:
        return CallTemplate.of(self.call).at(shape)


def observed_adjust(held: int, carried: int, observed: tuple[int, bool] | None, actions: Any = ()) -> Any:
    """``adjust(profile)`` for the observed call's profile: what the loop keeps around the model
    (``with_loop_references``: outputs ``held``, bytes ``carried`` between micro-batches) and the
    observed step's peak (``observed``: before the optimizer, with or without its state) under the
    plan it ran with (``actions``), which calibrates it (``recorded_call.calibrate``)."""
    def adjust(profile: Profile) -> Profile:
        profile = with_loop_references(profile, held, carried)
        return calibrate(profile, *observed, actions=actions) if observed is not None else profile
    return adjust


def with_user_loss_allowance(profile: Profile, nbytes: int) -> Profile:
    """``nbytes`` for a loss computed outside the model, at the end of forward (every stage's stored
    bytes alive) on top of the model's own memory there (the highest segment at that point, else
    the last stage's peak).

    Example:
        >>> from lightning_remat.core.memory_model import StageOption, StageProfile
        >>> p = Profile((StageProfile("a", (StageOption("keep", (), 100, 150, 0.0, 0),)),), (Segment("head", 1, 50),))
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
    result = replace(profile, segments=(*profile.segments, loss), notes=(*profile.notes, note))
    result = result.with_baseline()
    return result
