"""The CPU verification table of ``long_context_table.py --cpu``: each long-context mechanism on a small real Llama.

For each mechanism the profile's options are restricted to it (``core.memory_model.restricted``), the plan of least
peak is solved, applied to the real model, and its steady peak measured by torch's allocator events
(``tests/torch_meter.steady_peak``, independent of the package); its gradients are compared with the plain step's.
Offloaded checkpoint inputs have nothing to gain on the CPU (the host is the device: the planner refuses
``offload=True`` there), so their rows are planned and measured on fake tensors for an H100 (the package's
``MemTracker`` counts the device; the host copies are metadata), as tests/test_offload.py measures them, and their
gradients are those of the same plan applied to the real model on the CPU (the host copy is a plain copy there).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SIZES = dict(batch_size=1, seq_len=256, layers=2, hidden=64, vocab=2048)


def _only(kinds):
    def allowed(option):
        tiled = "tile:" in option.name
        kind = {"chunk": "chunks", "fuse": "fused"}.get(option.action.action, option.name)
        return (("tile" in kinds and tiled) or (kind in kinds and not tiled)
                or ("offload-input" in kinds and option.action.offload_input and ("tile" in kinds or not tiled)))
    return allowed


MECHANISMS = {  # the options each row may choose besides "keep"
    "chunked head": {"chunks"}, "fused head": {"fused"}, "tiled MLP": {"tile"},
    "offloaded inputs": {"offload-input"}, "all together": {"chunks", "fused", "tile", "offload-input", "whole"},
}


def _grads(model, step) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    step(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def cpu_rows() -> list[dict]:
    from lightning_remat import apply_plan, profile_step, remove_remat, solve
    from lightning_remat.core.config import ProfileOptions
    from lightning_remat.core.memory_model import restricted
    from lightning_remat.models import build
    from tests.torch_meter import fake_plan_peak, steady_peak

    case = build("llama", **SIZES)
    model, step = case.model, case.step
    optimizer = torch.optim.AdamW(model.parameters())
    real = profile_step(model, step, optimizer=optimizer, options=ProfileOptions(chunk_loss=True, tile_mlp=True))
    fake = profile_step(model, step, options=ProfileOptions(fake=True, gpu="h100", device="cuda", dtype=torch.bfloat16,
                                                            chunk_loss=True, tile_mlp=True, offload=True,
                                                            host_memory="1TB", repeated_blocks=False))
    rows = []
    for mechanism, kinds in MECHANISMS.items():
        on_fake = "offload-input" in kinds
        plan = solve(restricted(fake if on_fake else real, _only(kinds)), "min", cost="flops")
        plain = _grads(model, step)  # at this row's weights: the rows before stepped the optimizer
        apply_plan(model, plan)
        grads = _grads(model, step)
        measured = fake_plan_peak(model, step, plan) if on_fake else steady_peak(model, step, optimizer)
        remove_remat(model)
        diff = max((grads[n] - plain[n]).abs().max().item() for n in plain)
        rows.append(dict(kind="cpu", mechanism=mechanism, model=f"Llama {SIZES['layers']} layers, hidden "
                         f"{SIZES['hidden']}, {SIZES['seq_len']} tokens" + (" (fake, bf16, H100)" if on_fake else " (CPU)"),
                         predicted=plan.predicted_peak_bytes, measured=measured,
                         difference=(plan.predicted_peak_bytes - measured) / measured, grad_diff=diff,
                         options=sorted({c.option for c in plan.choices} - {"keep"})))
    return rows
