"""Load ``FILE.py:FACTORY`` and turn what the factory returns into a model, a step and an optimizer."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ...core.errors import RematError


class UsageError(RematError):
    """A mistake in the command line or the factory; printed without a traceback, exit code 2."""


@dataclass
class Target:
    """What a factory gave: the model, its step and (optionally) its optimizer."""

    model: Any
    step: Callable[[Any], Any]
    optimizer: Any = None


def _lightning_optimizer(module: Any) -> Any:
    import torch

    try:
        configured = module.configure_optimizers()
    except Exception:  # noqa: BLE001 - some need a trainer; the plan is then made without optimizer state
        return None
    for _ in range(3):
        if isinstance(configured, torch.optim.Optimizer):
            return configured
        if isinstance(configured, dict):
            configured = configured.get("optimizer")
        elif isinstance(configured, (list, tuple)) and configured:
            configured = configured[0]
        else:
            return None
    return configured if isinstance(configured, torch.optim.Optimizer) else None


def normalize(result: Any, name: str = "factory") -> Target:
    """Turn what a factory returned into a ``Target``; raise ``UsageError`` for anything else.

    >>> import torch
    >>> net = torch.nn.Linear(2, 1)
    >>> target = normalize((net, lambda m: m(torch.ones(1, 2)).sum()))
    >>> target.model is net, target.optimizer
    (True, None)
    """
    from torch import nn

    expected = "expected (model, step), (model, step, optimizer) or (lightning_module, batch)"
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise UsageError(f"{name} returned a {type(result).__name__}; {expected}")
    model = result[0]
    if not isinstance(model, nn.Module):
        raise UsageError(f"{name} returned a {type(model).__name__} as the model; {expected}")
    if len(result) == 2 and not callable(result[1]) and hasattr(model, "training_step"):
        batch = result[1]
        from ..lightning.step import training_step_closure

        return Target(model, training_step_closure(model, batch), _lightning_optimizer(model))
    if not callable(result[1]):
        raise UsageError(f"{name} returned a {type(result[1]).__name__} as the step, which is not callable; {expected}")
    optimizer = result[2] if len(result) == 3 else None
    if optimizer is not None:
        import torch

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError(f"{name} returned a {type(optimizer).__name__} as the optimizer; {expected}")
    return Target(model, result[1], optimizer)


def load_factory(spec: str) -> tuple[Callable[[], Any], str]:
    """Import ``FILE.py:FACTORY`` and return the factory and a display name; ``UsageError`` if not found."""
    if ":" not in spec:
        raise UsageError(f"expected FILE.py:FACTORY (for example examples/factories.py:gpt2), got {spec!r}")
    file, factory_name = spec.rsplit(":", 1)
    path = Path(file)
    if not path.is_file():
        raise UsageError(f"file not found: {file}")
    if not factory_name.isidentifier():
        raise UsageError(f"{factory_name!r} is not a function name (expected FILE.py:FACTORY)")
    module_name = f"_lightning_remat_factory_{abs(hash(str(path.resolve())))}"
    spec_obj = importlib.util.spec_from_file_location(module_name, path)
    if spec_obj is None or spec_obj.loader is None:
        raise UsageError(f"cannot import {file} as a Python file")
    module = importlib.util.module_from_spec(spec_obj)
    sys.modules[module_name] = module
    # The factory's own imports of files next to it should work as when it is run as a script.
    sys.path.insert(0, str(path.resolve().parent))
    try:
        spec_obj.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - reported to the user as a usage error
        raise UsageError(f"importing {file} failed: {type(err).__name__}: {err}") from err
    factory = getattr(module, factory_name, None)
    if factory is None or not callable(factory):
        found = sorted(n for n, v in vars(module).items()
                       if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module_name)
        what = "no function" if factory is None else "a non-callable"
        raise UsageError(f"{file} has {what} {factory_name!r}; functions defined there: {', '.join(found) or 'none'}")
    return factory, f"{file}:{factory_name}"
