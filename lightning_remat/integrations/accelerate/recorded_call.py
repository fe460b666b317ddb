"""A recorded training forward and its backward; a profile calibrated by the observed step (docs/accelerate.md)."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages

from ...core.allowances import ACCELERATE_LOOP_ALLOWANCE
from ...core.budget import format_bytes
from ...core.errors import StepError
from ...core.actions import StageAction
from ...core.memory_model import Profile, Segment, predict_peak
from ...core.predict import predict, schedule
from ...core.spans import peak_terms_spans
from ...runtime.measuring.measure import PeakWindow
from ...runtime.measuring.meter import model_state_bytes
from ...runtime.measuring.tracking import snapshot_by_category
from ...core.shapes import Shape
from ...runtime.profiling.batch_shape import batch_shape, batch_tensors, cycled, path_in, size_at
from ...runtime.profiling.profile_adjust import with_always_alive


def scalar_loss(output: Any) -> torch.Tensor | None:
    """The loss a model returned itself: a scalar tensor, or the ``loss`` of Hugging Face outputs."""
    candidate = output
    if not isinstance(output, torch.Tensor):
        candidate = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(candidate, torch.Tensor) and candidate.dim() == 0 and candidate.is_floating_point():
        return candidate
    return None


@dataclass
class RecordedCall:
    """One training forward: its inputs and what the user's backward did with its outputs. As a batch to plan
    (``ShapePlans``), its real inputs: a template's zeros would count in the profiled step."""

    args: tuple
    kwargs: dict
    loss_index: int | None = None  # position of the model's own loss among the output tensors
    grads: dict[int, Any] = field(default_factory=dict)  # output position -> gradient it received (a TensorSpec)
    backward_ran: bool = False
    used_model_loss: bool = False
    outputs: list = field(default_factory=list)  # weak references to the output tensors

    @property
    def shape(self) -> Shape:
        return batch_shape((self.args, self.kwargs)) or Shape(1)

    def at(self, shape: Shape) -> "CallTemplate":
        return CallTemplate.of(self).at(shape)

    def watch_outputs(self, leaves: list[torch.Tensor]) -> None:
        """Remember the outputs weakly, to learn later whether the user's loop still holds them."""
        self.outputs = [weakref.ref(t) for t in leaves]

    def held_bytes(self) -> int:
        """Bytes of the outputs still alive: read between two steps, what the user's loop holds.

        >>> call, out = RecordedCall(args=(), kwargs={}), torch.ones(4)
        >>> call.watch_outputs([out, out[:2]]); call.held_bytes()
        16
        >>> del out; call.held_bytes()
        0
        """
        storages = {}
        for ref in self.outputs:
            tensor = ref()
            if tensor is not None:
                storage = tensor.untyped_storage()
                storages[(storage.device, storage.data_ptr())] = storage.nbytes()
        return sum(storages.values())

    def on_grad(self, index: int, grad: torch.Tensor) -> None:
        self.backward_ran = True
        if index == self.loss_index:
            # The loss is the root of the backward (its gradient arrives first): re-running it covers the rest.
            self.used_model_loss = True
            self.grads.clear()
        elif not self.used_model_loss:
            # By shape only: kept alive, the gradient would add to the very step it observes.
            self.grads[index] = TensorSpec.of(grad)

    def loss(self, model: nn.Module) -> torch.Tensor:
        """Re-run the call on ``model`` and return the loss the profile backpropagates."""
        output = model(*self.args, **self.kwargs)
        if self.used_model_loss:
            loss = scalar_loss(output)
            if loss is None:
                raise StepError("the model returned a loss when it was observed, and none when re-run")
            return loss
        leaves = batch_tensors(output)
        # Stretched to another shape, an output may differ from its recorded gradient (an image's height): zeros.
        grads = {i: grad.make() if isinstance(grad, TensorSpec) else grad for i, grad in self.grads.items()}
        grads = {i: grad if grad.shape == leaves[i].shape else grad.new_zeros(leaves[i].shape)
                 for i, grad in grads.items()}
        terms = [(leaves[i] * grad.to(leaves[i].dtype)).sum().float() for i, grad in grads.items()]
        return terms[0] if len(terms) == 1 else torch.stack(terms).sum()


@dataclass(frozen=True)
class TensorSpec:
    """A tensor kept by its shape only, made as zeros when a profile needs it (under fake tensors: nothing)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorSpec":
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device)

    def make(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def resized(self, source: Shape, target: Shape) -> "TensorSpec":
        """At ``target``'s batch size and sequence length where it has ``source``'s (other sizes: the model's; a
        gradient has no path in a layout)."""
        return replace(self, shape=size_at("", self.shape, source, Shape(target.batch_size, target.seq_len)))


def _stretched(value: Any, path: str, source: Shape, target: Shape) -> Any:
    """A call's inputs at ``source`` stretched to ``target`` (``size_at``), tensors cycled as ``resize_batch`` does."""
    if isinstance(value, TensorSpec):
        return replace(value, shape=size_at(path, value.shape, source, target))
    if isinstance(value, torch.Tensor):
        return cycled(value, size_at(path, tuple(value.shape), source, target))
    if isinstance(value, Mapping):
        return {k: _stretched(v, path_in(path, k), source, target) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_stretched(v, path_in(path, i), source, target) for i, v in enumerate(value)))
    if isinstance(value, (list, tuple)):
        return type(value)(_stretched(v, path_in(path, i), source, target) for i, v in enumerate(value))
    return value


def _specs(value: Any, change: Any) -> Any:
    if isinstance(value, (TensorSpec, torch.Tensor)):
        return change(value) if isinstance(value, TensorSpec) or value.is_floating_point() else value
    if isinstance(value, Mapping):
        return {k: _specs(v, change) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_specs(v, change) for v in value)
    return value


@dataclass(frozen=True)
class CallTemplate:
    """A recorded forward for other batch shapes: integer inputs as they were, floats and gradients by shape only.

    >>> call = RecordedCall(args=(torch.ones(2, 5),), kwargs={"ids": torch.arange(10).view(2, 5)})
    >>> call.grads = {0: torch.ones(2, 5, 3)}
    >>> wider = CallTemplate.of(call).at(Shape(4, 8))
    >>> wider.shape, wider.args[0].shape, wider.kwargs["ids"].shape, wider.grads[0].shape
    (Shape(batch_size=4, seq_len=8), (4, 8), torch.Size([4, 8]), (4, 8, 3))
    """

    args: tuple
    kwargs: dict
    shape: Shape
    loss_index: int | None = None
    grads: dict = field(default_factory=dict)
    used_model_loss: bool = False

    @classmethod
    def of(cls, call: RecordedCall) -> "CallTemplate":
        return cls(_specs(call.args, TensorSpec.of), _specs(call.kwargs, TensorSpec.of), call.shape, call.loss_index,
                   {i: g if isinstance(g, TensorSpec) else TensorSpec.of(g) for i, g in call.grads.items()},
                   call.used_model_loss)

    def at(self, shape: Shape) -> "CallTemplate":
        """This call at ``shape`` (its layout's, or batch size and sequence length alone), as ``resize_batch``."""
        if shape == self.shape:
            return self
        if shape.layout and not self.shape.comparable(shape):
            raise ValueError(f"a call of shape {self.shape} cannot be stretched to {shape}: another layout")
        args, kwargs = _stretched((self.args, self.kwargs), "", self.shape, shape)
        return replace(self, args=args, kwargs=kwargs, shape=shape,
                       grads={i: g.resized(self.shape, shape) for i, g in self.grads.items()})

    def following(self, args: tuple, kwargs: dict, shape: Shape | None = None) -> "CallTemplate":
        """This call at another call's shape: stretched where the layout matches, else that call's own inputs.

        >>> template = CallTemplate.of(RecordedCall(args=(), kwargs={"x": torch.ones(2, 5)}))
        >>> [str(template.following((), {"x": x}).shape) for x in (torch.ones(2, 7), torch.ones(2, 7, 3))]
        ['2x1 {1.x: bx7}', '2x1 {1.x: bx7x3}']
        """
        shape = shape or batch_shape((args, kwargs)) or Shape(1)
        if self.shape.comparable(shape):
            return self.at(shape)
        return replace(self, args=_specs(args, TensorSpec.of), kwargs=_specs(kwargs, TensorSpec.of), shape=shape)

    def with_inputs(self, args: tuple, kwargs: dict, shape: Shape) -> "CallTemplate":
        """This call (its loss, its outputs' gradients) at ``shape``, with another call's inputs (of that shape)."""
        grads = {i: g.resized(self.shape, shape) for i, g in self.grads.items()}
        return replace(self, args=_specs(args, TensorSpec.of), kwargs=_specs(dict(kwargs), TensorSpec.of), shape=shape,
                       grads=grads)

    def inputs(self) -> tuple[tuple, dict]:
        """The call's arguments, made (zeros where kept by shape)."""
        make = lambda spec: spec.make()  # noqa: E731
        return _specs(self.args, make), _specs(self.kwargs, make)

    def loss(self, model: nn.Module) -> torch.Tensor:
        args, kwargs = self.inputs()
        call = RecordedCall(args=args, kwargs=kwargs, loss_index=self.loss_index,
                            grads={i: g.make() for i, g in self.grads.items()}, used_model_loss=self.used_model_loss)
        return call.loss(model)


class WindowTracker(PeakWindow):
    """A ``PeakWindow`` that also keeps whether the optimizer had state and the peak before it stepped."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        super().__init__(model, optimizer)
        # A first step creates the optimizer's state only at its end, after its forward and backward.
        self.optimizer_had_state = optimizer is not None and bool(optimizer.state)
        self.peak_before_optimizer: int | None = None

    def carried_bytes(self, excluded: list[torch.Tensor] = ()) -> int:
        """Between two micro-batches, bytes alive beyond the model's state and ``excluded`` (the next inputs).

        >>> net = nn.Linear(8, 8); window = WindowTracker(net, None)
        >>> loss = net(torch.randn(4, 8)).sum(); loss.backward()
        >>> kept = loss.detach() * 2; following = torch.randn(4, 8)   # a running loss; the next micro-batch
        >>> window.carried_bytes([following]), window.close() > 0   # the loss and its copy
        (8, True)
        """
        excluded = list(excluded)
        if self.cuda:
            now = int(torch.cuda.memory_allocated(self.device))
            mine = sum({s.data_ptr(): s.nbytes() for t in excluded for s in get_untyped_storages(t)}.values())
        else:
            now = snapshot_by_category(self.tracker.get_tracker_snapshot("current"), self.device).get("Total", 0)
            mine = self.tracker.counted_bytes(excluded)
        return max(0, now - model_state_bytes(self.model, self.optimizer) - mine)


def with_loop_references(profile: Profile, held_bytes: int, carried_bytes: int = 0) -> Profile:
    """Count in every term what the loop keeps alive: held outputs, what it carries between micro-batches, the loss.

    >>> from lightning_remat.core.memory_model import StageAction, StageOption, StageProfile
    >>> p = Profile((StageProfile("a", (StageOption("keep", StageAction("a"), 10, 100),)),), (Segment("head", 1, 50),))
    >>> [with_loop_references(p, 4096, c).stages[0].options[0].local_peak_bytes for c in (0, 6144)]
    [6244, 8292]
    """
    held = f"the model's outputs ({format_bytes(held_bytes)}) and " if held_bytes else ""
    note = f"the training loop holds {held}the loss ({ACCELERATE_LOOP_ALLOWANCE} bytes allowed) through the step"
    if carried_bytes > held_bytes:
        note += (f" and carries {format_bytes(carried_bytes - held_bytes)} more from one micro-batch into the next "
                 "(measured: its inputs, losses)")
    allowance = max(held_bytes, carried_bytes) + ACCELERATE_LOOP_ALLOWANCE
    return with_always_alive(profile, allowance, note + "; counted in every term")


def calibrate(profile: Profile, observed_peak: int, optimizer_had_state: bool = True,
              actions: Sequence[StageAction] = ()) -> Profile:
    """Charge the excess of ``observed_peak`` (forward and backward under ``actions``) over the profile's
    prediction to the end of forward, where the user's loss runs (docs/accelerate.md, "The loss").

    >>> from lightning_remat.core.memory_model import Costs, StageAction, StageOption, StageProfile
    >>> keep = StageOption("keep", StageAction("a"), 100, 150)
    >>> whole = StageOption("whole", StageAction.recompute("a"), 10, 160, Costs(1.0, 5))
    >>> p = Profile((StageProfile("a", (keep, whole)),), (Segment("head", 1, 50),))
    >>> [calibrate(p, 200, actions=a).baseline_peak_bytes for a in ((), [StageAction.recompute("a")])]
    [200, 290]
    """
    if not profile.stages:
        return profile
    if not optimizer_had_state:
        observed_peak += profile.optimizer_state_bytes
    # The profile's own forward/backward prediction: without the optimizer-step segment.
    model_only = replace(profile, segments=tuple(s for s in profile.segments if s.name != "optimizer step"))
    predicted = predict(model_only, actions, "flops").peak_bytes if actions else predict_peak(
        model_only, [0] * len(profile.stages))
    if observed_peak <= predicted:
        return profile
    stored = stored_at_end(model_only, actions)
    outside = Segment("outside the model (the loss)", len(profile.stages), observed_peak - stored)
    note = (f"the observed training step peaked {format_bytes(observed_peak - predicted)} above the profile of the "
            "model alone (code outside the model, such as the loss); counted at the end of forward")
    notes = (*profile.notes, note) if observed_peak - predicted > predicted // 200 else profile.notes
    return replace(profile, segments=(*profile.segments, outside), notes=notes).with_baseline()


def stored_at_end(profile: Profile, actions: Sequence[StageAction] = ()) -> int:
    """Bytes every stage stores at the end of forward under ``actions`` (none: nothing recomputed).

    >>> from lightning_remat.core.memory_model import Costs, StageAction, StageOption, StageProfile
    >>> keep = StageOption("keep", StageAction("a"), 100, 150)
    >>> whole = StageOption("whole", StageAction.recompute("a"), 10, 160, Costs(1.0, 5))
    >>> p = Profile((StageProfile("a", (keep, whole)),), ())
    >>> stored_at_end(p), stored_at_end(p, [StageAction.recompute("a")])
    (100, 10)
    """
    probe = replace(profile, segments=(*profile.segments, Segment("end of forward", len(profile.stages), 0)))
    choices, spans = schedule(probe, actions) if actions else ([0] * len(profile.stages), [])
    return next(t.stored_bytes for t in peak_terms_spans(probe, choices, spans)
                if t.kind == "segment" and t.index == len(probe.segments) - 1)
