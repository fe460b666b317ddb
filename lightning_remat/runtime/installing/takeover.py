"""Where an integration was given a budget, it turns Hugging Face's gradient checkpointing off (TRL's
``SFTConfig`` switches it on) and plans instead, saying so once. A torch ``checkpoint_wrapper`` cannot be taken
off without renaming the parameters it wraps, so it is refused. ``apply_plan`` alone keeps refusing both."""

from __future__ import annotations

import functools
import warnings

from torch import nn

from ...core.errors import AlreadyCheckpointedError
from .apply import existing_checkpointing

WRAPPER_SETTINGS = ("torch's checkpoint_wrapper / apply_activation_checkpointing in your own code, Accelerate's "
                    "FSDP plugin activation_checkpointing=True (FSDP_ACTIVATION_CHECKPOINTING, the Trainer's "
                    "fsdp_config activation_checkpointing), Lightning's FSDPStrategy activation_checkpointing_policy")


def _checkpointing_models(model: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face models in ``model`` (under PEFT too) with a layer checkpointing."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not hasattr(module, "_set_gradient_checkpointing"):
            continue
        if any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules()):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def _describe(owner: nn.Module) -> str:
    flagged = [m for m in owner.modules() if hasattr(m, "gradient_checkpointing")]
    # The layers are the innermost flagged modules (the backbone above them carries the flag too).
    layers = [m for m in flagged if not any(hasattr(c, "gradient_checkpointing") for c in list(m.modules())[1:])]
    on = [m for m in layers if m.gradient_checkpointing is True]
    parts = [f"{type(owner).__name__}: {len(on)} of {len(layers)} layers"]
    func = getattr(on[0], "_gradient_checkpointing_func", None) if on else None
    if isinstance(func, functools.partial):
        parts += [f"{k}={v!r}" for k, v in sorted(func.keywords.items())]
        # transformers 5's offload=True wraps checkpoint in save_on_cpu inside a local ``checkpoint_func``.
        if getattr(func.func, "__name__", "") == "checkpoint_func":
            parts.append("offload=True")
    return ", ".join(parts)


def take_over_checkpointing(model: nn.Module, who: str, speaks: bool = True) -> str | None:
    """Turn off Hugging Face's gradient checkpointing in ``model`` so that ``who`` plans instead; the line that
    says so (warned where ``speaks``), or None. ``enable_input_require_grads``' hook is kept (harmless).

    Raises:
        AlreadyCheckpointedError: a torch ``checkpoint_wrapper`` wraps a module, or checkpointing stays on.

    >>> import transformers
    >>> transformers.logging.set_verbosity_error()
    >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2,
    ...                                                                vocab_size=64))
    >>> model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    >>> print(take_over_checkpointing(model, "AutoRemat", speaks=False))  # doctest: +NORMALIZE_WHITESPACE
    AutoRemat turned off the model's own gradient checkpointing (GPT2LMHeadModel: 2 of 2 layers,
    use_reentrant=False) and plans recomputation within its budget instead; set gradient_checkpointing=False
    (TrainingArguments, SFTConfig) or drop gradient_checkpointing_enable() to not see this line.
    >>> existing_checkpointing(model), take_over_checkpointing(model, "AutoRemat")
    ([], None)
    """
    wrapped = [line for line in existing_checkpointing(model) if "checkpoint_wrapper" in line]
    if wrapped:
        raise AlreadyCheckpointedError(
            f"{who} was given a budget, but {wrapped[0]}: lightning-remat cannot take those off without renaming "
            f"the parameters they wrap. Turn off the setting that put them there ({WRAPPER_SETTINGS}), or drop "
            "the budget to keep them")
    owners = _checkpointing_models(model)
    if not owners and not existing_checkpointing(model):
        return None
    described = "; ".join(_describe(owner) for owner in owners)
    for owner in owners:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed gradient_ to activation_
            (getattr(owner, "activation_checkpointing_disable", None) or owner.gradient_checkpointing_disable)()
    left = existing_checkpointing(model)
    if left:
        raise AlreadyCheckpointedError(f"{who} was given a budget, but could not turn off the model's own "
                                       f"checkpointing: {'; '.join(left)}")
    said = (f"{who} turned off the model's own gradient checkpointing ({described}) and plans recomputation "
            "within its budget instead; set gradient_checkpointing=False (TrainingArguments, SFTConfig) or drop "
            "gradient_checkpointing_enable() to not see this line.")
    if speaks:
        warnings.warn(said, UserWarning, stacklevel=2)
    return said
