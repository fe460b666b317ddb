"""Every integration the harness runs, by name, and the variants each draws among.

- ``shape_plans``: a hand-written loop with ``ShapePlans.use(batch)`` before each forward.
- ``fabric``: Lightning Fabric with ``ShapePlans`` on the ``_FabricModule`` (docs/shapes.md), or
  ``recipe``: docs/fabric.md's ``plan_remat`` on the first batch and ``apply_plan``.
- ``accelerate``: ``RematAccelerator`` (``accelerator``), or the stock ``Accelerator`` with
  ``prepare_remat`` before (``prepare_before``) or after (``prepare_after``) ``accelerator.prepare``.
- ``lightning``: ``AutoRemat``; plain, ``accumulate`` (2 micro-batches per optimizer step) or
  ``manual`` (manual optimization, two optimizers).
- ``hf_trainer``: ``RematTrainerCallback``; plain, ``accumulate`` or ``lora`` (PEFT adapters).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .loops import HAND_WRITTEN, LR
from .recorder import RunRecord
from .trainers import ACCUMULATION, hf_model, run_hf_trainer, run_lightning
from .zoo import ModelSpec

RUNNERS: dict[str, Callable[..., RunRecord]] = {**HAND_WRITTEN, "lightning": run_lightning,
                                                "hf_trainer": run_hf_trainer}
# The first of each is what a case draws first (and shrinks to).
VARIANTS: dict[str, tuple[str, ...]] = {
    "shape_plans": ("",), "fabric": ("", "recipe"), "accelerate": ("accelerator", "prepare_before", "prepare_after"),
    "lightning": ("", "accumulate", "manual"), "hf_trainer": ("", "accumulate", "lora")}


def trained(integration: str, variant: str, spec: ModelSpec, seed: int) -> tuple[torch.nn.Module, Any, dict]:
    """A fresh copy of the model and optimizer(s) the integration trains, and what else ``plan_remat``
    needs to plan its step (gradient accumulation): to plan ``budget="min"`` on."""
    options = {"accumulation_steps": ACCUMULATION} if variant == "accumulate" else {}
    if integration == "hf_trainer":
        model = hf_model(spec, seed, variant)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR), options
    model = spec.build(seed)
    parameters = list(model.parameters())
    if integration == "lightning" and variant == "manual":
        half = len(parameters) // 2
        return model, [torch.optim.Adam(parameters[:half], lr=LR), torch.optim.Adam(parameters[half:], lr=LR)], options
    return model, torch.optim.Adam(parameters, lr=LR), options
