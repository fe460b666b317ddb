"""The runtime: everything that touches torch, in four folders by job.

- ``measuring``: run and meter a real step (trackers, the peak meter, FLOPs, roofline costs, trials).
- ``profiling``: turn a step into the memory model's terms (candidates, per-stage options, stacks).
- ``installing``: put a plan on a model and take it off (recompute, segments, policies, offload).
- ``targets``: what is not here (fake tensors for a GPU one lacks, FSDP2 ranks, the host link).

The modules lived directly under ``runtime`` before 0.2; their old paths (``runtime.apply``,
``runtime.profile``, ...) still import, with a ``DeprecationWarning``, for one release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_FOLDERS = {
    "measuring": ("tracking", "stance", "measure", "observe", "trial", "roofline"),
    "profiling": ("profile", "profile_adjust", "held_inputs", "candidates", "repeated", "optimizer_step"),
    "installing": ("apply", "segments", "offload", "sac", "compiled", "fingerprint"),
    "targets": ("fake", "fake_attention", "sharded", "offload_link"),
}
MOVED = {f"{__name__}.{module}": f"{__name__}.{folder}.{module}"
         for folder, modules in _FOLDERS.items() for module in modules}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old ``lightning_remat.runtime.<module>`` path as the module at its new place."""

    def __init__(self) -> None:
        self._own_specs: dict = {}

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(MOVED[spec.name])
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        # The import system stamped the old name's spec on the module: give it back its own.
        old = module.__spec__.name
        module.__spec__ = self._own_specs.pop(old)
        sys.modules[old] = module


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
