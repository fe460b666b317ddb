#!/usr/bin/env python
"""The integrations on a GPU: AutoRemat in a Lightning fit and RematAccelerator in an Accelerate loop.

Each trains a GPT-2 (12 x 768, 8 x 1024 tokens, AdamW) on CUDA with a budget of static memory +
50% of the baseline's activations, and compares what the integration predicted and measured
(``max_memory_allocated`` over a steady step, what it logs as ``remat/measured_peak_bytes``) with
the budget; bf16-mixed in Lightning, fp32 with gradient accumulation 2 in Accelerate.

    python benchmarks/gpu_integrations.py
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_remat import ProfileOptions, format_bytes, profile_step  # noqa: E402
from lightning_remat.models import build  # noqa: E402

CONFIG = dict(layers=12, hidden=768, seq_len=1024, batch_size=8, vocab=8192)


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab"], (n, CONFIG["seq_len"]), generator=torch.Generator().manual_seed(0))


def _budget(model, accumulation: int = 1, autocast: bool = False) -> int:
    ids = _ids(CONFIG["batch_size"]).cuda()

    def step(m):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return m(input_ids=ids, labels=ids).loss

    profile = profile_step(model, step, optimizer=torch.optim.AdamW(model.parameters()),
                           options=ProfileOptions(accumulation_steps=accumulation))
    ids = None  # the batch the closure holds: freed before the next model is built
    torch.cuda.empty_cache()
    return int(profile.static_bytes + 0.5 * profile.baseline_activation_bytes)


def lightning_fit() -> dict:
    import lightning.pytorch as L

    from lightning_remat import AutoRemat

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = build("gpt2", **CONFIG).model

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    lit = LM().cuda()
    budget = _budget(lit.model, autocast=True)
    lit = lit.cpu()
    torch.cuda.empty_cache()
    callback = AutoRemat(budget=budget, verbose=False)
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=6, callbacks=[callback],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(lit, DataLoader(TensorDataset(_ids(6 * CONFIG["batch_size"])), batch_size=CONFIG["batch_size"]))
    return {"integration": "Lightning AutoRemat, bf16-mixed", "budget": budget,
            "predicted": callback.plan.predicted_peak_bytes, "measured": callback.measured_peak_bytes,
            "checkpointed": len(callback.plan.checkpointed), "notes": callback.plan.notes}


def accelerate_loop() -> dict:
    from accelerate.state import AcceleratorState

    from lightning_remat.accelerate import RematAccelerator, RematPlugin

    AcceleratorState._reset_state(True)
    torch.manual_seed(0)
    model = build("gpt2", **CONFIG).model.cuda()
    budget = _budget(model, accumulation=2)
    model = model.cpu()
    torch.cuda.empty_cache()
    accelerator = RematAccelerator(gradient_accumulation_steps=2, remat_plugin=RematPlugin(budget=budget))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader(TensorDataset(_ids(12 * CONFIG["batch_size"])), batch_size=CONFIG["batch_size"])
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for (ids,) in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
            optimizer.zero_grad()
    metrics = accelerator.remat_metrics
    return {"integration": "RematAccelerator, accumulation 2", "budget": budget,
            "predicted": int(metrics["remat/predicted_peak_bytes"]), "measured": int(metrics["remat/measured_peak_bytes"]),
            "checkpointed": int(metrics["remat/num_checkpointed"]), "notes": accelerator.remat_plan.notes}


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU", file=sys.stderr)
        return 0
    rows = [lightning_fit(), accelerate_loop()]
    for r in rows:
        r["held"] = r["measured"] <= r["budget"]
        print(f"{r['integration']}: {r['checkpointed']} recomputed, budget {format_bytes(r['budget'])}, predicted "
              f"{format_bytes(r['predicted'])}, measured {format_bytes(r['measured'])} "
              f"({100 * (r['measured'] - r['predicted']) / r['predicted']:+.1f}%), held: {r['held']}")
        for note in r["notes"]:
            print(f"    note: {note[:140]}")
    out = Path(os.environ.get("OUT", "gpu_check_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_integrations.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["held"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
