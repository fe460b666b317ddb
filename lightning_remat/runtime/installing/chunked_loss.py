"""A causal LM's head and ``ForCausalLMLoss`` over sequence chunks, each recomputed in backward."""

from __future__ import annotations

import contextvars
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...core.actions import StageAction
from ...core.errors import UnsupportedSetupError
from ...core.vocabulary import Action
from .records import Behaviour, Target, record_of

# The chunk counts a profile offers (1 is the head and loss as the model computes them).
CHUNK_COUNTS = (2, 4, 8, 16, 32)
IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"
_DECLARED = "_remat_head_loss"  # in a head's __dict__: its loss is computed by head_loss (a model of its own)


def find_head_loss(model: nn.Module) -> str | None:
    """The name of the head a chunked loss is installed on: the ``lm_head`` of the outermost causal LM with a linear
    one and an exactly chunked loss, else a ``head_loss`` head."""
    for name, module in model.named_modules():
        if not type(module).__name__.endswith(("ForCausalLM", "LMHeadModel")):
            continue
        head = getattr(module, "lm_head", None)
        if isinstance(head, nn.Linear) and label_smoothing(module) is not None and not _scaled(module):
            return f"{name}.lm_head" if name else "lm_head"
    return next((name for name, m in model.named_modules() if declared(m)), None)


@dataclass(frozen=True)
class CausalLMLoss:
    """Hugging Face's ``ForCausalLMLoss`` with label smoothing, for ``model.loss_function`` (chunked exactly).

    >>> logits, labels = torch.randn(2, 6, 16), torch.randint(0, 16, (2, 6))
    >>> shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    >>> plain = F.cross_entropy(logits.reshape(-1, 16), shifted, label_smoothing=0.1)
    >>> torch.allclose(CausalLMLoss(0.1)(logits, labels, 16), plain)
    True
    """

    label_smoothing: float = 0.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, num_items_in_batch: Any = None,
                 ignore_index: int = IGNORE_INDEX, shift_labels: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        total = _chunk_loss(lambda x: x, logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index,
                            self.label_smoothing)
        return _divided(total, shift_labels, ignore_index, num_items_in_batch)


def label_smoothing(model: nn.Module) -> float | None:
    """The label smoothing of ``model``'s ``loss_function`` where a chunked loss computes it exactly, else None."""
    try:
        loss = model.loss_function
    except AttributeError:
        return None
    if isinstance(loss, CausalLMLoss):
        return loss.label_smoothing
    own = getattr(loss, "__name__", "") == "ForCausalLMLoss" and getattr(loss, "__module__", "").startswith(
        "transformers.")
    return 0.0 if own else None


def refused(model: nn.Module) -> str | None:
    """Why ``chunk_loss`` leaves the head of ``model`` whole, or None."""
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith(("ForCausalLM", "LMHeadModel")) and isinstance(getattr(module, "lm_head", None), nn.Linear):
            loss = getattr(module, "loss_function", None)
            if label_smoothing(module) is None and loss is not None:
                return (f"chunk_loss: {kind}.loss_function is {_named(loss)}, not transformers' "
                        "ForCausalLMLoss or lightning_remat.CausalLMLoss, so a chunked loss would not be its loss: "
                        "its head and loss are kept whole (docs/long_context.md)")
            if _scaled(module):
                return (f"chunk_loss: {kind} scales its logits after its head ({_scaled(module)}), which neither a "
                        "chunked nor a fused loss computes: its head and loss are kept whole (docs/long_context.md)")
        if kind.endswith("ForMaskedLM"):
            return (f"chunk_loss: {kind} is a masked LM (a transform before its decoder, the loss over masked tokens), "
                    "not a causal LM's linear head and shifted loss: its head and loss are kept whole "
                    "(docs/long_context.md)")
    if find_head_loss(model) is None:  # a classifier, a speech or translation model: said, not silently ignored
        return (f"chunk_loss: {type(model).__name__} has no causal LM head and loss (a *ForCausalLM's linear "
                "lm_head under transformers' causal loss, or a head declared with head_loss): nothing is chunked, "
                "its head and loss run as the model computes them (docs/long_context.md)")
    return None


# Scales some causal LMs put on their logits after the head, by config attribute: Granite divides, Cohere multiplies.
_SCALES = ("logits_scaling", "logit_scale")


def _scaled(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return next((f"{name}={getattr(config, name)}" for name in _SCALES if getattr(config, name, None) is not None), None)


def capped(project: Callable[[torch.Tensor], torch.Tensor], cap: float | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``project`` followed by the model's logit soft-capping (``cap * tanh(logits / cap)``, Gemma-2's order of ops).

    >>> logits = torch.randn(4, 8) * 100
    >>> torch.equal(capped(lambda x: x, 30.0)(logits), torch.tanh(logits / 30.0) * 30.0)
    True
    """
    if not cap:
        return project
    return lambda hidden: torch.tanh(project(hidden) / cap) * cap


def _named(function: Any) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


def declared(head: nn.Module) -> bool:
    """Whether ``head``'s loss is computed by ``head_loss`` (it ran at least once)."""
    return isinstance(head, nn.Linear) and head.__dict__.get(_DECLARED, False)


def _chunk_loss(project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                ignore_index: int, smoothing: float = 0.0) -> torch.Tensor:
    # As ForCausalLMLoss: logits upcast to float before the cross-entropy; summed here, divided once.
    # With label smoothing the sum over tokens divided by the valid ones is still torch's mean.
    logits = project(hidden).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index,
                           reduction="sum", label_smoothing=smoothing)


def chunked_cross_entropy(project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                          shift_labels: torch.Tensor, chunks: int, ignore_index: int = IGNORE_INDEX,
                          num_items_in_batch: Any = None, smoothing: float = 0.0) -> torch.Tensor:
    """``ForCausalLMLoss`` of ``project(hidden)`` over ``chunks`` sequence chunks, each recomputed in backward."""
    size = -(-hidden.shape[-2] // chunks)
    total = None
    for h, y in zip(hidden.split(size, dim=-2), shift_labels.split(size, dim=-1)):
        if torch.is_grad_enabled():
            # No random ops in a projection and a cross-entropy: no RNG state to keep.
            part = checkpoint(_chunk_loss, project, h, y, ignore_index, smoothing, use_reentrant=False,
                              preserve_rng_state=False)
        else:
            part = _chunk_loss(project, h, y, ignore_index, smoothing)
        total = part if total is None else total + part
    return _divided(total, shift_labels, ignore_index, num_items_in_batch)


def _divided(total: torch.Tensor, labels: torch.Tensor, ignore_index: int, num_items_in_batch: Any) -> torch.Tensor:
    # As Hugging Face's fixed_cross_entropy: the mean over valid tokens, or the sum over num_items_in_batch.
    if num_items_in_batch is None:
        return total / (labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def head_loss(head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, *, shift: bool = True,
              ignore_index: int = IGNORE_INDEX, num_items_in_batch: Any = None,
              label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy(head(hidden), labels)`` for a model that is not a Hugging Face causal LM.

    Called in the model's forward, ``chunk_loss=True`` plans this head and loss as a stage. ``shift``: position
    ``t`` predicts the label at ``t + 1``.

    >>> head, hidden, labels = nn.Linear(8, 16), torch.randn(2, 6, 8), torch.randint(0, 16, (2, 6))
    >>> plain = F.cross_entropy(head(hidden).reshape(-1, 16), labels.reshape(-1))
    >>> torch.allclose(head_loss(head, hidden, labels, shift=False), plain)
    True
    """
    head.__dict__[_DECLARED] = True  # so that find_head_loss finds it (a flag, no parameter or buffer)
    shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:] if shift else labels
    pending = _Pending(shift_labels, ignore_index, num_items_in_batch, label_smoothing)
    out = _handing(head, pending, head, hidden)  # a chunked head (installed by a plan) computes the loss, returns it
    if pending.loss is not None and out is pending.loss:
        return out
    total = _chunk_loss(lambda logits: logits, out, shift_labels.to(out.device), ignore_index, label_smoothing)
    return _divided(total, shift_labels, ignore_index, num_items_in_batch)


@dataclass
class _Pending:
    """The labels a routed call hands to its head, and the loss the head hands back."""

    shift_labels: torch.Tensor
    ignore_index: int
    num_items_in_batch: Any
    smoothing: float = 0.0
    loss: torch.Tensor | None = None
    softcap: float | None = None  # the model's logit soft-capping, computed in each chunk


_PENDING: contextvars.ContextVar[dict[int, _Pending] | None] = contextvars.ContextVar("remat_chunked_loss",
                                                                                      default=None)
_HANDED = "_remat_pending_loss"  # under torch.compile: the head's attribute holding its _Pending


def _handing(head: nn.Module, pending: _Pending, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` with ``pending`` handed to ``head``'s chunked forward: by a context variable (per
    thread), or under torch.compile an attribute (dynamo breaks at ContextVar)."""
    previous = getattr(head, _HANDED, None)
    setattr(head, _HANDED, pending)
    context = None if torch.compiler.is_compiling() else _PENDING.set({**(_PENDING.get() or {}), id(head): pending})
    try:
        return call(*args, **kwargs)
    finally:
        if previous is None:
            head.__dict__.pop(_HANDED, None)  # nothing of ours left on the model (remove_remat: exactly as it was)
        else:
            setattr(head, _HANDED, previous)
        if context is not None:
            _PENDING.reset(context)


def _take_labels(original: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    if "labels" in kwargs:
        return kwargs["labels"], args, {**kwargs, "labels": None}
    names = list(inspect.signature(original).parameters)
    at = names.index("labels") if "labels" in names else len(args)
    if at < len(args):
        return args[at], (*args[:at], None, *args[at + 1:]), kwargs
    return None, args, kwargs


def routed_call(original: Callable[..., Any], root: nn.Module, head: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The causal LM's forward with its labels handed to its chunked head: the output has the loss, ``logits=None``."""
    labels, unlabelled_args, unlabelled_kwargs = _take_labels(original, args, kwargs)
    if labels is None or not torch.is_grad_enabled():
        return original(*args, **kwargs)  # gradients off (evaluation): the model's own loss over full logits
    smoothing = label_smoothing(root)  # its loss as called now: loss_function may change after planning
    if smoothing is None:
        raise UnsupportedSetupError(
            f"chunk_loss: {type(root).__name__}.loss_function is now {_named(root.loss_function)}, not transformers' "
            "ForCausalLMLoss or lightning_remat.CausalLMLoss, which the plan chunks: a chunked loss would not be its "
            "loss, and its own over full logits would not fit the plan. Set loss_function before planning (its head "
            "is then kept whole), or use CausalLMLoss(label_smoothing=...) (docs/long_context.md)")
    ignore_index = kwargs.get("ignore_index", IGNORE_INDEX)
    shift = kwargs.get("shift_labels")
    if shift is None:
        shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    # Gemma-2's (and Gemma-3's) tanh capping of the logits after the head, computed in each chunk (capped()).
    softcap = getattr(getattr(root, "config", None), "final_logit_softcapping", None)
    pending = _Pending(shift, ignore_index, kwargs.get("num_items_in_batch"), smoothing, softcap=softcap)
    out = _handing(head, pending, original, *unlabelled_args, **unlabelled_kwargs)
    logits = out[0] if isinstance(out, tuple) else getattr(out, "logits", None)
    # A soft-capped model caps what its head returned (the loss, capped in its chunks already): replaced below.
    if pending.loss is None or (logits is not pending.loss and not pending.softcap):
        raise UnsupportedSetupError(
            f"chunk_loss: {type(root).__name__} does not return its lm_head's output as its logits (it changes them "
            "after the head, or never calls it), so a chunked loss would not be its loss. Plan without chunk_loss")
    if isinstance(out, tuple):
        return (pending.loss, *out[1:])
    return type(out)(**{k: v for k, v in out.items() if k not in ("loss", "logits")}, loss=pending.loss)


def head_call(behaviour: ChunkedLoss, original: Callable[..., Any], head: nn.Module, chunks: int,
              hidden: torch.Tensor) -> Any:
    """The head's forward: ``behaviour``'s loss where ``routed_call`` handed it labels, else the projection."""
    # What _handing handed: under torch.compile the attribute, else this thread's (another may run the same model).
    pending = getattr(head, _HANDED, None) if torch.compiler.is_compiling() else (_PENDING.get() or {}).get(id(head))
    if pending is None or pending.loss is not None:
        return original(hidden)
    pending.loss = behaviour.loss(head, capped(original, pending.softcap), hidden,
                                  pending.shift_labels.to(hidden.device), chunks, pending)
    return pending.loss


class ChunkedLoss(Behaviour):
    """A ``CHUNK`` action: the head returns its loss over sequence chunks; its causal LM hands it the labels."""

    name = "chunked_loss"
    action = Action.CHUNK

    def settings(self, action: StageAction) -> dict[str, Any]:
        return {action.stage: action.chunks} if action.action is self.action else {}

    def check(self, modules: dict[str, nn.Module], settings: dict[str, Any]) -> None:
        for head in settings:
            root = head.rpartition(".")[0]
            if getattr(modules.get(root), "lm_head", None) is not modules.get(head) and not declared(modules.get(head)):
                raise ValueError(f"a chunked loss names a causal LM's head, its lm_head; {head!r} is not one")

    def install(self, target: Target, settings: dict[str, Any]) -> None:
        for head, count in settings.items():
            record_of(target.modules[head]).behaviours[self.name] = (count, None)
            if not declared(target.modules[head]):  # a head of head_loss gets its labels from the model itself
                record_of(target.modules[head.rpartition(".")[0]]).behaviours[self.name] = (None, target.modules[head])

    def wrap(self, module: nn.Module, setting: Any, state: Any, call: Callable[..., Any]) -> Callable[..., Any]:
        if state is not None:
            return functools.partial(routed_call, call, module, state)
        return functools.partial(head_call, self, call, module, setting)

    def loss(self, head: nn.Module, project: Callable[..., Any], hidden: torch.Tensor, labels: torch.Tensor,
             chunks: int, p: _Pending) -> torch.Tensor:
        """The head's loss over ``chunks`` chunks (``p``: what its causal LM handed it)."""
        return chunked_cross_entropy(project, hidden, labels, chunks, p.ignore_index, p.num_items_in_batch, p.smoothing)

    def fields(self, name: str, setting: Any) -> dict[str, Any]:
        return {"action": self.action, "chunks": setting}
