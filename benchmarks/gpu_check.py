#!/usr/bin/env python
"""Check plans against the allocator on a GPU: does the budget hold, how far is the prediction, what does it cost.

For each model (transformers configs with random weights, a deep MLP chain), each configuration
runs on its own copy of the same weights with AdamW (its default implementation on the device:
the batched "foreach" step on CUDA), gradients set to None before every forward:

- ``none``: no checkpointing (the baseline);
- ``hf``: Hugging Face every-layer checkpointing (``gradient_checkpointing_enable``, non-reentrant);
- ``ours@50%``: ``plan_remat`` at static memory + 50% of the baseline's activation memory;
- ``ours@hf``: ``plan_remat`` at the peak Hugging Face checkpointing measured (to compare overheads);
- ``ours@50%+compile`` (GPT-2, Llama): the 50% plan, then ``torch.compile`` (inductor);
- ``gpt2-lora``, ``llama-lora``: LoRA fine-tunes (PEFT, frozen base weights), no checkpointing and ours@50%;
- the features that had never run on a GPU (GPT-2, Llama; ``--no-features`` skips them): ``offload@30%``
  (``offload=True``, static + 30% of the activations), ``sac@50%`` (op policy ``save_matmuls``), ``chunk@min``
  (``chunk_loss=True`` at the least peak, the head chunked), ``fake@50%`` (planned on fake tensors for the
  GPU), ``shapes@50%:L`` (``ShapePlans`` over batches of half and full length, each step measured).

Measurement, over a steady window (after 2 warm-up steps, so AdamW's state exists): on CUDA, per
step ``reset_peak_memory_stats`` then ``max_memory_allocated`` (what the budget means) and
``max_memory_reserved`` (what the caching allocator holds, fragmentation included), and CUDA-event
time of forward + backward + optimizer step; the window's largest peaks and median time. The
figures are absolute: everything on the device at the time (the model, its inputs, the optimizer),
and nothing else, since each configuration starts from an emptied device. On the CPU (``--smoke``,
or no GPU) the same code runs one small model, with MemTracker (``measure_step``) as the meter.

    python benchmarks/gpu_check.py                    # every model on the GPU, ~5 minutes on an H100
    python benchmarks/gpu_check.py --models gpt2 llama --steps 6
    python benchmarks/gpu_check.py --smoke            # the CPU version the test suite runs (--models mlp llama)

Exit code 0 when every feasible plan held its budget on allocated memory, 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lightning_remat import (BudgetTooSmallError, ShapePlans, apply_plan, format_bytes, measure_step,  # noqa: E402
                             plan_remat)
from lightning_remat.models import build  # noqa: E402

# Sized so that activations are hundreds of MiB to several GiB on one GPU, and the whole run stays
# within a few minutes on an H100.
GPU_MODELS: dict[str, dict[str, Any]] = {
    "gpt2": dict(layers=12, hidden=768, seq_len=1024, batch_size=8, vocab=8192),
    "bert": dict(layers=12, hidden=768, seq_len=512, batch_size=16, vocab=8192),
    "vit": dict(layers=12, hidden=768, image_size=128, batch_size=32),
    "llama": dict(layers=8, hidden=1024, seq_len=1024, batch_size=4, vocab=8192),
    "resnet50": dict(batch_size=64, image_size=224),
    "mlp": dict(batch_size=8192, depth=24, width=1024),
}
SMOKE_MODELS: dict[str, dict[str, Any]] = {"mlp": dict(batch_size=64, depth=4, width=32),
                                           "llama": dict(layers=2, hidden=64, seq_len=64, batch_size=4, vocab=128)}
# Also run the plan at 50% under torch.compile (inductor) for these; and LoRA fine-tunes of these.
COMPILED = ("gpt2", "llama")
FEATURES = ("gpt2", "llama")  # language models: the chunked head and shape plans need token batches
LORA = {"gpt2": dict(target_modules=["c_attn"], fan_in_fan_out=True), "llama": dict(target_modules=["q_proj", "v_proj"])}


@dataclass
class Row:
    """One configuration of one model, as measured."""

    model: str
    config: str
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    allocated_peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None
    step_ms: float | None = None
    checkpointed: int = 0
    note: str = ""

    @property
    def error(self) -> float | None:
        """(measured - predicted) / predicted, allocated memory."""
        if self.predicted_peak_bytes and self.allocated_peak_bytes is not None:
            return (self.allocated_peak_bytes - self.predicted_peak_bytes) / self.predicted_peak_bytes
        return None

    @property
    def held(self) -> bool | None:
        if self.budget_bytes is None or self.allocated_peak_bytes is None:
            return None
        return self.allocated_peak_bytes <= self.budget_bytes


class Meter:
    """Peak memory and time of one training step, on CUDA or with MemTracker on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def clear(self) -> None:
        """Start a configuration on an emptied device."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def step(self, model: nn.Module, step: Callable, optimizer: torch.optim.Optimizer) -> tuple[int, int, float]:
        """(allocated peak, reserved peak, seconds) of zero_grad + forward + backward + optimizer step."""
        if not self.cuda:
            start = time.perf_counter()
            peak = measure_step(model, step, optimizer).peak_bytes
            return peak, peak, time.perf_counter() - start
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        model.zero_grad(set_to_none=True)
        step(model).backward()
        optimizer.step()
        end.record()
        torch.cuda.synchronize(self.device)
        return (int(torch.cuda.max_memory_allocated(self.device)), int(torch.cuda.max_memory_reserved(self.device)),
                begin.elapsed_time(end) / 1000)


def _on_device(case: Any, device: torch.device) -> tuple[nn.Module, Callable]:
    """The case's model and step with the batch the step closes over moved to ``device``."""
    for cell in case.step.__closure__ or ():
        if isinstance(cell.cell_contents, torch.Tensor):
            cell.cell_contents = cell.cell_contents.to(device)
    return case.model.to(device), case.step


def _window(meter: Meter, model: nn.Module, step: Callable, optimizer: torch.optim.Optimizer,
            steps: int) -> tuple[int, int, float]:
    """Two warm-up steps (AdamW's state is created), then the largest peaks and median time of ``steps``."""
    for _ in range(2):
        meter.step(model, step, optimizer)
    runs = [meter.step(model, step, optimizer) for _ in range(steps)]
    return max(r[0] for r in runs), max(r[1] for r in runs), statistics.median(r[2] for r in runs)


def _dispose(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Free a configuration's tensors even if something still references the module: torch's
    MemTracker leaves a reference cycle through C++ hooks that keeps a deleted model's tensors
    (0.69 GiB for the GPT-2 here) alive, and the next configuration would be measured with them."""
    model.zero_grad(set_to_none=True)
    if optimizer is not None:
        optimizer.state.clear()
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = torch.empty(0, device=tensor.device, dtype=tensor.dtype)


def _fresh(base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = copy.deepcopy(base).train()
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def _ours(name: str, config: str, base: nn.Module, step: Callable, budget: int | str | None, meter: Meter,
          steps: int, compiled: bool = False, **options: Any) -> Row:
    model, optimizer = _fresh(base)
    row = Row(name, config, budget_bytes=budget if isinstance(budget, int) else None)
    try:
        plan = plan_remat(model, step, budget, optimizer=optimizer, cost=options.pop("cost", "time"), **options)
    except BudgetTooSmallError as err:
        row.note = f"infeasible (least peak {format_bytes(err.smallest_peak_bytes)})"
        _dispose(model, optimizer)
        meter.clear()
        return row
    apply_plan(model, plan)
    row.predicted_peak_bytes, row.checkpointed = plan.predicted_peak_bytes, len(plan.checkpointed)
    row.budget_bytes = row.budget_bytes or plan.predicted_peak_bytes  # "min": the least peak is the budget
    runner = torch.compile(model) if compiled else model
    row.note = "; ".join(n.split(":")[0] + ":" + n.split(":")[1][:60] for n in plan.notes if n.startswith("calibrated"))
    row.allocated_peak_bytes, row.reserved_peak_bytes, seconds = _window(meter, runner, step, optimizer, steps)
    row.step_ms = 1000 * seconds
    _dispose(model, optimizer)
    meter.clear()
    return row


def _features(name: str, base: nn.Module, step: Callable, static: int, plain: int, meter: Meter,
              steps: int) -> list[Row]:
    """The options that never ran on a GPU before: offload, an op policy, the chunked head, fake planning, shapes."""
    at = {share: int(static + share * (plain - static)) for share in (0.3, 0.5)}
    rows = []
    if meter.cuda:  # offload needs an accelerator target
        rows.append(_ours(name, "offload@30%", base, step, at[0.3], meter, steps, offload=True))
    rows.append(_ours(name, "sac@50%", base, step, at[0.5], meter, steps, policies=("save_matmuls",)))
    rows.append(_ours(name, "chunk@min", base, step, "min", meter, steps, chunk_loss=True))
    rows.append(_ours(name, "fake@50%", base, step, at[0.5], meter, steps, fake=True, cost="flops"))
    rows.extend(_shapes(name, base, step, at[0.5], meter, steps))
    return rows


def _shapes(name: str, base: nn.Module, step: Callable, budget: int, meter: Meter, steps: int) -> list[Row]:
    """``ShapePlans`` following batches of half and full length (as padded batches vary), each shape measured."""
    ids = next(c.cell_contents for c in step.__closure__ if isinstance(c.cell_contents, torch.Tensor))
    model, optimizer = _fresh(base)
    plans = ShapePlans(model, lambda m, batch: m(input_ids=batch, labels=batch).loss, budget, optimizer=optimizer,
                       per_octave=0, verbose=False)
    rows = []
    for length in (ids.shape[1] // 2, ids.shape[1]):
        batch = ids[:, :length].contiguous()
        row = Row(name, f"shapes@50%:{length}", budget)
        try:
            plan = plans.use(batch)
        except BudgetTooSmallError as err:
            row.note = f"infeasible (least peak {format_bytes(err.smallest_peak_bytes)})"
            rows.append(row)
            continue
        row.predicted_peak_bytes, row.checkpointed = plan.predicted_peak_bytes, len(plan.checkpointed)
        row.allocated_peak_bytes, row.reserved_peak_bytes, seconds = _window(
            meter, model, lambda m, batch=batch: m(input_ids=batch, labels=batch).loss, optimizer, steps)
        row.step_ms = 1000 * seconds
        rows.append(row)
    _dispose(model, optimizer)
    meter.clear()
    return rows


def check_model(name: str, kwargs: dict[str, Any], device: torch.device, steps: int, compiled: bool = False,
                lora: dict[str, Any] | None = None, features: bool = False) -> list[Row]:
    """Every configuration of one model (with ``lora``, of a LoRA fine-tune of it)."""
    meter = Meter(device)
    meter.clear()
    if meter.cuda and torch.cuda.memory_allocated(device):
        print(f"{name}: {format_bytes(torch.cuda.memory_allocated(device))} still allocated before it starts",
              file=sys.stderr)
    case = build(name, **kwargs)
    if hasattr(case.model, "config"):
        case.model.config.use_cache = False
    if lora is not None:
        import peft

        case.model = peft.get_peft_model(case.model, peft.LoraConfig(r=16, lora_dropout=0.0, **lora))
        case.supports_hf_checkpointing = False
        name = f"{name}-lora"
    base, step = _on_device(case, device)
    rows = []
    model, optimizer = _fresh(base)
    none = Row(name, "none")
    none.allocated_peak_bytes, none.reserved_peak_bytes, seconds = _window(meter, model, step, optimizer, steps)
    none.step_ms = 1000 * seconds
    # Static memory (parameters, gradients, AdamW's state) from the tensors themselves.
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    static = params + grads + state
    rows.append(none)
    _dispose(model, optimizer)
    meter.clear()
    hf_peak = None
    if case.supports_hf_checkpointing:
        model, optimizer = _fresh(base)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf = Row(name, "hf")
        hf.allocated_peak_bytes, hf.reserved_peak_bytes, seconds = _window(meter, model, step, optimizer, steps)
        hf.step_ms, hf_peak = 1000 * seconds, hf.allocated_peak_bytes
        rows.append(hf)
        _dispose(model, optimizer)
        meter.clear()
    budget = int(static + 0.5 * (none.allocated_peak_bytes - static))
    rows.append(_ours(name, "ours@50%", base, step, budget, meter, steps))
    if compiled:
        rows.append(_ours(name, "ours@50%+compile", base, step, budget, meter, steps, compiled=True))
    if hf_peak is not None:
        rows.append(_ours(name, "ours@hf", base, step, hf_peak, meter, steps))
    if features and lora is None:
        rows.extend(_features(name, base, step, static, none.allocated_peak_bytes, meter, steps))
    _dispose(base)
    meter.clear()
    return rows


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def table(rows: list[Row]) -> str:
    """The rows as a plain-text table, with time overhead against ``none`` of the same model."""
    baseline_ms = {r.model: r.step_ms for r in rows if r.config == "none"}
    header = ("model", "config", "budget", "predicted", "allocated", "reserved", "meas-pred", "res/alloc",
              "step ms", "time ovh", "held", "note")
    lines = [header]
    for r in rows:
        overhead = (r.step_ms / baseline_ms[r.model] - 1) if r.step_ms and baseline_ms.get(r.model) else None
        ratio = (r.reserved_peak_bytes / r.allocated_peak_bytes) if r.allocated_peak_bytes else None
        lines.append((
            r.model, r.config, format_bytes(r.budget_bytes) if r.budget_bytes else "-",
            format_bytes(r.predicted_peak_bytes) if r.predicted_peak_bytes else "-",
            format_bytes(r.allocated_peak_bytes) if r.allocated_peak_bytes is not None else "-",
            format_bytes(r.reserved_peak_bytes) if r.reserved_peak_bytes is not None else "-",
            _percent(r.error), f"{ratio:.2f}" if ratio else "-", f"{r.step_ms:.1f}" if r.step_ms else "-",
            _percent(overhead) if r.config != "none" else "", {None: "", True: "yes", False: "NO"}[r.held], r.note))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=None, help=f"models (default all: {list(GPU_MODELS)})")
    parser.add_argument("--steps", type=int, default=5, help="steady steps measured per configuration")
    parser.add_argument("--smoke", action="store_true", help="one small model on the CPU (what the tests run)")
    parser.add_argument("--no-lora", action="store_true", help="skip the LoRA fine-tunes (they need peft)")
    parser.add_argument("--no-features", action="store_true", help="skip offload, policies, chunked head, shapes")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    models = GPU_MODELS if cuda else SMOKE_MODELS
    names = args.models or (list(models) if cuda else ["mlp"])
    unknown = [n for n in names if n not in models]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(models)}")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    rows: list[Row] = []
    for name in names:
        torch.manual_seed(0)
        start = time.perf_counter()
        rows.extend(check_model(name, models[name], device, args.steps, compiled=cuda and name in COMPILED,
                                features=name in FEATURES and not args.no_features))
        if cuda and name in LORA and not args.no_lora:
            rows.extend(check_model(name, models[name], device, args.steps, lora=LORA[name]))
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    failed = [r for r in rows if r.held is False]
    args.out.mkdir(parents=True, exist_ok=True)
    info = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "steps": args.steps}
    (args.out / "gpu_check.json").write_text(json.dumps(
        {"info": info, "rows": [{**asdict(r), "error": r.error, "held": r.held} for r in rows]}, indent=1))
    (args.out / "gpu_check.txt").write_text(f"{info}\n{text}\n")
    if failed:
        print("budget exceeded: " + ", ".join(f"{r.model} {r.config}" for r in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
