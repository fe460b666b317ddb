"""The one installer: puts a plan's actions on a model and takes them off exactly.

A module the plan touches gets ONE record (in its ``__dict__``): the forward it had (and whether
it was set on the instance) and the behaviours installed on it. Its ``forward`` becomes an instance
attribute that composes them, as torch composes a checkpoint's ``context_fn`` with saved-tensor hooks:

- recompute: the original forward runs under ``torch.utils.checkpoint.checkpoint`` (non-reentrant,
  RNG state preserved: dropout masks replay), BatchNorm running statistics put back after a recompute;
- op-level policy: the checkpoint's ``context_fn`` is the policy's pair of contexts (``sac.py``), and
  nothing else, so it is the same eagerly and under ``torch.compile``;
- checkpoint input to the host: a recomputed module's checkpoint keeps a host copy of its input
  (``input_offload.py``);
- offload: the call runs under ``saved_tensors_hooks`` that send what it saves to host memory
  (``offloader.py``), outside the checkpoint;
- chunked loss: a causal LM hands its labels to its head, whose forward returns the loss computed
  over sequence chunks, each recomputed in backward (``chunked_loss.py``);
- segment: several consecutive items of an ``nn.Sequential`` recomputed as one checkpoint. The
  items are run by a *runner*, an ``nn.Sequential`` of them that is not registered in the model,
  recomputed like any module; the Sequential yields it in place of the items when iterated
  (``nn.Sequential.forward`` and code that loops over a Sequential itself, as transformers'
  ``ResNetStage``). Python looks ``__iter__`` up on the type, so that is the one thing done by a
  class swap (a subclass of the same name, undone on removal), not by patching ``forward``.

Nothing else about a module changes: parameter names, ``state_dict`` keys and parameter objects
stay, and removing the plan restores each forward (and class) as it was. Names are those of the
uncompiled model (``compiled.uncompiled``).

Example:
    >>> import torch
    >>> from lightning_remat.core.plan import Plan
    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)])
    >>> _ = install(net, Plan(["3"], policies={"3": "save_matmuls"}, segments=[["0", "1"]], offloaded=["2"]))
    >>> recomputed(net), installed_segments(net), offloaded(net)
    ({'3': 'save_matmuls'}, [['0', '1']], ['2'])
    >>> net(torch.randn(2, 4, requires_grad=True)).sum().backward()
    >>> uninstall(net) is net and recomputed(net) == {} and "forward" not in net[3].__dict__
    True
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from ...core.actions import StageAction, check_actions, refuse_nested
from ...core.errors import InvalidPlanError, PlanMismatchError
from ...core.plan import Plan
from ...core.vocabulary import Action
from . import chunked_loss, sac
from .compiled import uncompiled
from .input_offload import InputOffload, checkpointed_with_host_input
from .offloader import Offloader, offloaded_call, release_after_next
from .records import (RECORD, Record, input_offload_of, installed_segments, offloaded, offloader_of,
                      recomputed)
from .sequential import SEGMENTS, qualifies, segment_positions, segmented_class
from .verify import check_installed

__all__ = ["Installation", "install", "install_offload", "install_segments", "installed_segments", "offloaded",
           "offloader_of", "qualifies", "recomputed", "restore", "segment_positions", "snapshot", "uninstall",
           "uninstall_offload", "uninstall_segments"]

# ------------------------------------------------------------------------------------ the forward


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
    original = module.__dict__[RECORD].original
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


def _recomputed_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    record = module.__dict__[RECORD]
    if not record.recompute or not _needs_graph(args, kwargs, module):
        return record.original(*args, **kwargs)
    # An op-level policy is the whole context_fn (BatchNorm statistics are restored above).
    extra = {"context_fn": sac.context_fn(record.policy)} if record.policy else {}
    if record.input_offload is not None:
        offload, name = record.input_offload
        return checkpointed_with_host_input(offload, name, functools.partial(_run_original, module), args, kwargs,
                                            dict(preserve_rng_state=True, **extra))
    return checkpoint(functools.partial(_run_original, module), *args, use_reentrant=False, preserve_rng_state=True,
                      **extra, **kwargs)


def _installed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a module with a record: its behaviours around its original forward."""
    record = module.__dict__[RECORD]
    if record.route is not None:
        return chunked_loss.routed_call(record.original, module, record.route, *args, **kwargs)
    if record.chunks:
        return chunked_loss.chunked_head_call(record.original, module, record.chunks, *args, **kwargs)
    if record.offload is None:
        return _recomputed_call(module, *args, **kwargs)
    offloader, name = record.offload
    return offloaded_call(offloader, name, module, record.release_hook is not None,
                          functools.partial(_recomputed_call, module), args, kwargs)


def _record(module: nn.Module) -> Record:
    """The module's record, made (and its forward patched, once) on first use. The forward is
    patched first: a module that refuses it (its ``__setattr__`` raises) is left without a record."""
    if RECORD not in module.__dict__:
        record = Record(module.forward, "forward" in module.__dict__)
        module.forward = functools.partial(_installed_forward, module)  # type: ignore[method-assign]
        record.installed = module.__dict__["forward"]
        module.__dict__[RECORD] = record
    return module.__dict__[RECORD]


def _settle(module: nn.Module) -> None:
    """Give a module without behaviours its own forward back exactly."""
    record = module.__dict__.get(RECORD)
    if record is None or not record.empty():
        return
    del module.__dict__[RECORD]
    if record.had_instance_forward:
        module.forward = record.original  # type: ignore[method-assign]
    else:
        del module.forward


# -------------------------------------------------------------------------------------- segments


def _install_segments(modules: dict[str, nn.Module], segments: Sequence[Sequence[str]]) -> None:
    by_parent: dict[str, list] = {}
    for names in segments:
        parent, positions = segment_positions(modules, names)
        runner = nn.Sequential(*[modules[n] for n in names])
        _record(runner).recompute = True
        by_parent.setdefault(parent, []).append((positions[0], positions[-1] + 1, runner, list(names)))
    for parent, entries in by_parent.items():
        container = modules[parent]
        container.__dict__[SEGMENTS] = sorted(entries, key=lambda e: e[0])
        if not getattr(type(container), "_remat_segmented", False):
            container.__class__ = segmented_class(type(container))


def install_segments(model: nn.Module, segments: Sequence[Sequence[str]]) -> None:
    """Recompute each run of names as one checkpoint (names as ``model.named_modules()`` gives them),
    after checking them all; other behaviours stay (``uninstall_segments`` first to replace a set)."""
    modules = dict(model.named_modules())
    check_actions([StageAction.in_segment(s, names) for names in segments for s in names])
    for names in segments:
        segment_positions(modules, names)
    _install_segments(modules, segments)


def uninstall_segments(model: nn.Module) -> None:
    """Every Sequential gets back its class and iterates its items again."""
    for module in model.modules():
        if SEGMENTS in module.__dict__:
            del module.__dict__[SEGMENTS]
            if getattr(type(module), "_remat_segmented", False):
                module.__class__ = type(module).__mro__[1]


# ------------------------------------------------------------------------------ install, uninstall


def _check_names(model: nn.Module, modules: dict[str, nn.Module], names: Sequence[str], what: str = "plan") -> None:
    unknown = [n for n in names if n not in modules]
    if unknown:  # a plan for another model (docs/plans.md): PlanMismatchError, a ValueError as before
        raise PlanMismatchError(f"{what} names module(s) {unknown} that {type(model).__name__} does not have")


def install_offload(model: nn.Module, names: Sequence[str], order: Sequence[str] | None = None, measure: bool = False,
                    limits: dict[str, int] | None = None) -> Offloader:
    """Offload what the named modules of ``model`` save (names as ``model.named_modules()`` gives
    them); a previous offload is replaced, other behaviours stay. Returns the modules' offloader."""
    modules = dict(model.named_modules())
    _check_names(model, modules, names, "offload")
    if len(set(names)) != len(names):
        raise InvalidPlanError(f"offload names a module twice: {list(names)}")
    refuse_nested(names, "offloads")
    uninstall_offload(model)
    offloader = Offloader(measure=measure, limits=limits, order=order)
    for name in names:
        _record(modules[name]).offload = (offloader, name)
    position = {n: i for i, n in enumerate(order or ())}
    for name in names:
        i = position.get(name)
        if i is not None and i + 1 < len(position):
            # The next stage's forward ran: this stage's copies are done, its device tensors may go.
            nxt = modules[order[i + 1]]  # type: ignore[index]
            modules[name].__dict__[RECORD].release_hook = nxt.register_forward_hook(release_after_next(offloader, name))
    return offloader


def uninstall_offload(model: nn.Module) -> None:
    for module in list(model.modules()):
        record = module.__dict__.get(RECORD)
        if record is not None and record.offload is not None:
            if record.release_hook is not None:
                record.release_hook.remove()
            record.offload, record.release_hook = None, None
            _settle(module)


def install(model: nn.Module, plan: Plan, order: Sequence[str] | None = None, measure: bool = False) -> nn.Module:
    """Put ``plan``'s actions on ``model`` in place (a previous plan of ours is replaced); returns ``model``.

    Every name and segment is checked before anything changes, and a failure while installing (a
    module that refuses a new ``forward``) takes off what was installed and puts the previous plan
    back before it is raised: the model is as it was. ``order`` (default the plan's ``stage_order``): every stage in execution
    order, for offloading one stage ahead. ``measure``: offload only metadata (fake profiles).

    Raises:
        PlanMismatchError: a name is not a module of ``model`` (a ``ValueError``).
        ValueError: the actions cannot go together
            (``core.actions.check_actions``), or a segment is not a run of items of one Sequential.
        InstallationMismatchError: what is installed, read back from the records, is not the plan
            (the previous plan is put back first).
    """
    with uncompiled(model) as plain:
        modules = dict(plain.named_modules())
        _check_names(model, modules, list(dict.fromkeys(
            m for a in plan.actions if a.action is not Action.KEEP for m in (a.stage, *a.modules, *a.segment))))
        check_actions(plan.actions)
        for names in plan.segments:
            segment_positions(modules, names)
        chunked_loss.check_heads(modules, plan.chunked_loss)
        previous = snapshot(plain)
        uninstall(plain)
        try:
            _install(plain, modules, plan.policies, plan.checkpointed, plan.segments, plan.offloaded,
                     plan.offload_limits, plan.stage_order if order is None else order, measure, plan.offloaded_inputs)
            _install_chunks(modules, plan.chunked_loss)
            check_installed(plain, plan, "(right after installing it)")  # read back, never assumed
        except BaseException:
            restore(plain, previous)  # all or nothing: the model as it was, then the error as it was
            raise
    return model


def _install_chunks(modules: dict[str, nn.Module], chunks: dict[str, int]) -> None:
    for head, count in chunks.items():
        _record(modules[head]).chunks = count
        if not chunked_loss.declared(modules[head]):  # a head of head_loss gets its labels from the model itself
            _record(modules[head.rpartition(".")[0]]).route = modules[head]


def _install(plain: nn.Module, modules: dict[str, nn.Module], policies: dict[str, str], recompute: Sequence[str],
             segments: Sequence[Sequence[str]], offload: Sequence[str], limits: dict[str, int],
             order: Sequence[str] | None, measure: bool, offload_inputs: Sequence[str] = ()) -> None:
    for name in recompute:
        record = _record(modules[name])
        record.recompute, record.policy = True, sac.check_policy(policies[name]) if name in policies else ""
    inputs = InputOffload(measure=measure)  # one per model: its host_bytes say what went, per module
    for name in offload_inputs:
        modules[name].__dict__[RECORD].input_offload = (inputs, name)
    _install_segments(modules, segments)
    if offload:
        install_offload(plain, offload, order=order, measure=measure,
                        limits={k: v for k, v in limits.items() if k in offload})


def uninstall(model: nn.Module) -> nn.Module:
    """Take every behaviour of ours off ``model``: each module gets back exactly the forward (and
    class) it had. Returns ``model``."""
    with uncompiled(model) as plain:
        uninstall_segments(plain)
        uninstall_offload(plain)
        for module in plain.modules():
            record = module.__dict__.get(RECORD)
            if record is not None:
                record.recompute, record.policy, record.chunks, record.route, record.input_offload = False, "", 0, None, None
                _settle(module)
    return model


@dataclass
class Installation:
    """What is installed on a model, to put back later exactly (``snapshot``, ``restore``)."""

    recompute: dict[str, str] = field(default_factory=dict)
    segments: list[list[str]] = field(default_factory=list)
    offloaded: list[str] = field(default_factory=list)
    limits: dict[str, int] = field(default_factory=dict)
    order: tuple[str, ...] | None = None
    measure: bool = False
    chunks: dict[str, int] = field(default_factory=dict)
    offload_inputs: list[str] = field(default_factory=list)
    inputs_measure: bool = False


def snapshot(model: nn.Module) -> Installation:
    """What is installed on ``model`` now (names of the uncompiled model)."""
    with uncompiled(model) as plain:
        offloader = offloader_of(plain)
        inputs, offload = input_offload_of(plain)
        return Installation(recompute=recomputed(plain), segments=installed_segments(plain), offloaded=offloaded(plain),
                            limits=dict(offloader.limits) if offloader else {},
                            order=offloader.order if offloader else None,
                            measure=bool(offloader and offloader.measure),
                            offload_inputs=inputs, inputs_measure=bool(offload and offload.measure),
                            chunks={n: m.__dict__[RECORD].chunks for n, m in plain.named_modules()
                                    if RECORD in m.__dict__ and m.__dict__[RECORD].chunks})


def restore(model: nn.Module, installation: Installation) -> nn.Module:
    """Install exactly ``installation`` (from ``snapshot``) on ``model`` in place of what it has."""
    with uncompiled(model) as plain:
        uninstall(plain)
        _install(plain, dict(plain.named_modules()), {k: v for k, v in installation.recompute.items() if v},
                 list(installation.recompute), installation.segments, installation.offloaded, installation.limits,
                 installation.order, installation.measure or installation.inputs_measure, installation.offload_inputs)
        _install_chunks(dict(plain.named_modules()), installation.chunks)
    return model
