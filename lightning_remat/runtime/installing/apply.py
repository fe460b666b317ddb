"""Apply a plan: recompute the chosen modules' forward during backward, and undo it exactly.

The module's ``forward`` is replaced by an instance attribute that runs the original forward under
``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``. Nothing else
about the module changes: no wrapper module is inserted, so parameter names, ``state_dict`` keys and
the parameter objects themselves (which optimizers and DDP hold) stay as they were, and a
checkpoint saved with recomputation loads without it and the reverse.

Semantics users should know:
- Dropout masks are reproduced on recompute (the RNG state is saved and restored).
- BatchNorm (and any ``_NormBase``) running statistics are updated once per step, not twice: a
  forward that runs inside backward (the autograd engine running: a recompute) puts the buffers
  back after itself, eager or under ``torch.compile`` with graph breaks in the block; a compiled
  backward does not update them again.
- Plans survive ``torch.compile`` in either order: compile after ``apply_plan``, or plan a model
  that is compiled (or holds compiled submodules): profiling runs it eagerly, the plan wraps the
  original modules (names of the uncompiled model, no ``_orig_mod.``), and the
  compiled module recompiles with the recompute at its next call.
- Forward hooks of the *children* of a recomputed module run again during backward; the module's
  own hooks run once, since they sit outside the recomputed forward.
- Under ``torch.no_grad()`` or ``inference_mode`` nothing is recomputed: the plain forward runs.
- A plan's ``policies`` run a module under op-level selective checkpointing (``runtime.sac``): the
  checkpoint's ``context_fn`` is the policy's pair of contexts and nothing else, so it is the same
  eagerly and under ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from ...core.errors import AlreadyCheckpointedError
from . import sac
from .compiled import uncompiled

_ORIGINAL = "_remat_original_forward"
_HAD_INSTANCE_FORWARD = "_remat_had_instance_forward"
_POLICY = "_remat_policy"


def existing_checkpointing(model: nn.Module) -> list[str]:
    """Describe activation checkpointing already present in ``model`` that is not ours.

    Detects Hugging Face ``gradient_checkpointing_enable()`` and torch's ``checkpoint_wrapper``
    (which Lightning's FSDP ``activation_checkpointing_policy`` uses).

    Example:
        >>> existing_checkpointing(nn.Linear(2, 2))
        []
    """
    found = []
    # transformers 5 renamed the flag (the old name warns); read whichever the class has.
    # Wrappers such as PEFT's forward attributes to the model they wrap, so ask the instance.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        flag = getattr(model, "is_activation_checkpointing", None)
        if flag is None:
            flag = getattr(model, "is_gradient_checkpointing", False)
    if flag:
        found.append(f"Hugging Face gradient checkpointing is enabled on {type(model).__name__} "
                     "(call model.gradient_checkpointing_disable() to let lightning-remat choose)")
    else:
        for name, module in model.named_modules():
            if getattr(module, "gradient_checkpointing", False) is True:
                found.append(f"Hugging Face gradient checkpointing is enabled on {name or type(model).__name__}")
                break
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # pragma: no cover - torch built without distributed
        CheckpointWrapper = ()  # type: ignore[assignment]
    wrapped = [name for name, m in model.named_modules() if CheckpointWrapper and isinstance(m, CheckpointWrapper)]
    if wrapped:
        found.append(f"torch checkpoint_wrapper wraps {len(wrapped)} module(s), e.g. {wrapped[0]!r} "
                     "(as FSDP activation_checkpointing_policy does)")
    return found


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that lightning-remat currently recomputes alone (the
    segments recomputed as one checkpoint are listed by ``segments.segmented_modules``).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> checkpointed_modules(apply_plan(net, ["0"]))
        ['0']
    """
    with uncompiled(model) as model:
        return [name for name, m in model.named_modules() if _ORIGINAL in m.__dict__]


def segmented_modules(model: nn.Module) -> list[list[str]]:
    """The segments of ``model`` lightning-remat currently recomputes as one checkpoint each (names as
    in the uncompiled model); the sibling of ``checkpointed_modules``.

    Example:
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(3)])
        >>> segmented_modules(apply_plan(net, [], segments=[["0", "1"]]))
        [['0', '1']]
    """
    from .segments import segmented_modules as listed

    with uncompiled(model) as model:
        return listed(model)


@contextlib.contextmanager
def _restore_norm_statistics(module: nn.Module) -> Iterator[None]:
    """Run a recompute without updating running statistics a second time."""
    norms = [m for m in module.modules()
             if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats]
    saved = [{k: b.clone() for k, b in m.named_buffers(recurse=False) if b is not None} for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, saved):
                for k, value in buffers.items():
                    getattr(m, k).copy_(value)


def _needs_graph(args: tuple, kwargs: dict, module: nn.Module) -> bool:
    if not torch.is_grad_enabled():
        return False
    if any(p.requires_grad for p in module.parameters()):
        return True
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


def _has_running_statistics(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
               for m in module.modules())


def _recomputing() -> bool:
    """Whether this forward runs as a recompute: inside backward, while the autograd engine runs.

    Checkpoint recomputes from the unpack hook of a saved tensor, that is inside the engine; an
    ordinary forward runs outside it (graph task -1). Unlike a ``context_fn`` this also holds for a
    recompute that runs eagerly because ``torch.compile`` broke the graph inside the block, and it
    leaves ``context_fn`` free for an op-level recompute policy.
    """
    return torch._C._current_graph_task_id() != -1


def _run_original(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The checkpointed function: the original forward, running statistics restored on recompute."""
    original = module.__dict__[_ORIGINAL]
    # While dynamo traces, the recompute becomes part of the compiled backward, which does not apply
    # buffer updates a second time; only an eager recompute (no compile, or dynamo broke the graph
    # and runs this frame eagerly in backward) updates them again, and is undone here.
    if torch.compiler.is_compiling() or not _recomputing() or not _has_running_statistics(module):
        return original(*args, **kwargs)
    # The copies are made outside the dispatch modes: selective checkpointing's cache replays the
    # forward's ops by count during the recompute, and these ops are not the forward's.
    restore = _restore_norm_statistics(module)
    with _disable_current_modes():
        restore.__enter__()
    try:
        return original(*args, **kwargs)
    finally:
        with _disable_current_modes():
            restore.__exit__(None, None, None)


def _recomputing_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if not _needs_graph(args, kwargs, module):
        return module.__dict__[_ORIGINAL](*args, **kwargs)
    policy = module.__dict__.get(_POLICY)
    # An op-level policy is the whole context_fn (BatchNorm statistics are restored above).
    extra = {"context_fn": sac.context_fn(policy)} if policy else {}
    return checkpoint(functools.partial(_run_original, module), *args, use_reentrant=False, preserve_rng_state=True,
                      **extra, **kwargs)


def _wrap(module: nn.Module, policy: str = "") -> None:
    had_instance_forward = "forward" in module.__dict__
    module.__dict__[_HAD_INSTANCE_FORWARD] = had_instance_forward
    module.__dict__[_ORIGINAL] = module.forward
    if policy:
        module.__dict__[_POLICY] = policy
    module.forward = functools.partial(_recomputing_forward, module)  # type: ignore[method-assign]


def _unwrap(module: nn.Module) -> None:
    original = module.__dict__.pop(_ORIGINAL)
    module.__dict__.pop(_POLICY, None)
    if module.__dict__.pop(_HAD_INSTANCE_FORWARD):
        module.forward = original  # type: ignore[method-assign]
    else:
        del module.forward


def _plan_names(plan: Any) -> list[str]:
    names = plan.checkpointed if hasattr(plan, "checkpointed") else plan
    if isinstance(names, (str, bytes)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"a plan is a Plan or a list of module names, got {plan!r}")
    return list(names)


def checkpoint_policies(model: nn.Module) -> dict[str, str]:
    """The selective-checkpointing policy of each recomputed module that has one.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> checkpoint_policies(apply_plan(net, ["0"], policies={"0": "save_matmuls"}))
        {'0': 'save_matmuls'}
    """
    with uncompiled(model) as model:
        return {name: m.__dict__[_POLICY] for name, m in model.named_modules() if _POLICY in m.__dict__}


def apply_plan(model: nn.Module, plan: Any, segments: Any = None,
               policies: dict[str, str] | None = None, offloaded: Any = None) -> nn.Module:
    """Recompute, in place, the modules a plan names; returns ``model``.

    Args:
        model: the model (the same module tree the plan was made for).
        plan: a ``Plan`` or an iterable of module names.
        segments: runs of consecutive items of one ``nn.Sequential``, each recomputed as one
            checkpoint (``runtime.segments``); default: the plan's ``segments`` (none for names).
        policies: per module name, the selective-checkpointing policy (``runtime.sac.POLICIES``)
            it recomputes under; default the plan's ``policies`` (a module without one recomputes
            its whole forward).
        offloaded: names of modules whose saved tensors go to host memory (``runtime.offload``);
            default the plan's ``offloaded`` (none for names). A module is recomputed or
            offloaded, never both.

    A previous plan of ours is replaced. Every name is checked before anything is wrapped, so an
    error never leaves a half-wrapped model.

    Names are those of the uncompiled model: a plan made for a model applies to its
    ``torch.compile`` twin and the reverse.

    Raises:
        AlreadyCheckpointedError: the model uses Hugging Face or torch checkpointing already.
        ValueError: a name is not a module of ``model``, or a name lies inside another named module.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> _ = apply_plan(net, ["0"])
        >>> net(torch.randn(2, 4, requires_grad=True)).sum().backward()
        >>> _ = remove_remat(net)
        >>> "forward" in net[0].__dict__
        False
    """
    names = _plan_names(plan)
    segments = [list(s) for s in (getattr(plan, "segments", []) if segments is None else segments)]
    if policies is None:
        policies = dict(getattr(plan, "policies", None) or {})
    stray = [n for n in policies if n not in names]
    if stray:
        raise ValueError(f"policies name module(s) {stray} that the plan does not recompute")
    for policy in policies.values():
        sac.check_policy(policy)
    existing = existing_checkpointing(model)
    if existing and (names or segments):
        raise AlreadyCheckpointedError(
            "Not applying the recompute plan, to avoid checkpointing twice: " + "; ".join(existing)
        )
    with uncompiled(model) as plain:
        modules = dict(plain.named_modules())
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise ValueError(f"plan names module(s) {unknown} that {type(model).__name__} does not have")
    nested = [n for n in names if any(n != o and n.startswith(o + ".") for o in names)]
    if nested:
        raise ValueError(f"plan names modules inside other planned modules: {nested}")
    if len(set(names)) != len(names):
        raise ValueError(f"plan names a module twice: {names}")
    from .segments import apply_segments, check_segments  # segments builds on this module's _wrap

    check_segments(modules, segments, names)
    offloaded = list(getattr(plan, "offloaded", []) if offloaded is None else offloaded)
    _check_offloaded(names, segments, offloaded)
    remove_remat(model)
    for name in names:
        _wrap(modules[name], policies.get(name, ""))
    if segments:
        with uncompiled(model) as plain:
            apply_segments(plain, segments)
    if offloaded:
        from .offload import apply_offload

        order = [c.stage for c in getattr(plan, "choices", [])] or None
        limits = {k: v for k, v in getattr(plan, "offload_limits", {}).items() if k in offloaded}
        with uncompiled(model) as plain:
            apply_offload(plain, offloaded, order=order, limits=limits)
    return model


def _check_offloaded(names: list[str], segments: list[list[str]], offloaded: list[str]) -> None:
    if isinstance(offloaded, (str, bytes)) or not all(isinstance(n, str) for n in offloaded):
        raise TypeError(f"offloaded is a list of module names, got {offloaded!r}")
    recomputed = [*names, *(n for s in segments for n in s)]
    both = [n for n in offloaded if any(n == r or n.startswith(r + ".") or r.startswith(n + ".") for r in recomputed)]
    if both:
        raise ValueError(f"module(s) {both} are both recomputed and offloaded: a module is one or the other")


def remove_remat(model: nn.Module) -> nn.Module:
    """Undo ``apply_plan``: every module gets back exactly the forward it had. Returns ``model``.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> remove_remat(apply_plan(net, ["0"])) is net and checkpointed_modules(net) == []
        True
    """
    from .offload import remove_offload
    from .segments import remove_segments

    for module in model.modules():
        if _ORIGINAL in module.__dict__:
            _unwrap(module)
    with uncompiled(model) as plain:
        remove_segments(plain)
        remove_offload(plain)
    return model


@contextlib.contextmanager
def applied(model: nn.Module, names: Iterable[str], segments: Iterable[Iterable[str]] = (),
            policies: dict[str, str] | None = None, plan: Any = None) -> Iterator[nn.Module]:
    """Apply a set of names (with their segments and policies) for the duration of a ``with`` block,
    then restore the previous plan. With ``plan`` (a ``Plan``), that plan is applied as it is instead
    (its offloaded modules included)."""
    previous, previous_policies = checkpointed_modules(model), checkpoint_policies(model)
    previous_segments = segmented_modules(model)
    from .offload import offloaded_modules

    with uncompiled(model) as plain:
        previous_offloaded = offloaded_modules(plain)
    if plan is not None:
        apply_plan(model, plan)
    else:
        apply_plan(model, list(names), segments=[list(s) for s in segments or ()], policies=policies or {}, offloaded=[])
    try:
        yield model
    finally:
        # (Prefetch order is not kept here: the offloaded modules come back without it.)
        apply_plan(model, previous, segments=previous_segments, policies=previous_policies, offloaded=previous_offloaded)
