"""Train a small GPT-2 (random weights, synthetic tokens) with Accelerate under a memory budget.

The script is an ordinary Accelerate loop; the only change is ``RematAccelerator`` in place of
``Accelerator``. Recomputation is switched on at launch by the environment:

    ACCELERATE_REMAT_BUDGET=70MB accelerate launch --cpu examples/accelerate_train.py

Without ``ACCELERATE_REMAT_BUDGET`` it trains exactly as with the stock ``Accelerator``.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from accelerate.utils import set_seed

from lightning_remat import format_bytes
from lightning_remat.accelerate import RematAccelerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="training steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()

    accelerator = RematAccelerator()  # reads ACCELERATE_REMAT_BUDGET & co.; a bad value fails here
    set_seed(0)
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=4, vocab_size=args.vocab,
                                     n_positions=args.seq_len, bos_token_id=0, eos_token_id=0,
                                     use_cache=False)  # the key/value cache would hold memory all step long
    model = transformers.GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, args.vocab, (args.steps * args.batch_size, args.seq_len),
                           generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(tokens, batch_size=args.batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    for step, batch in enumerate(loader):
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step}: loss {loss.item():.4f}")

    plan = accelerator.remat_plan
    if plan is None:
        accelerator.print(f"no recomputation (set ACCELERATE_REMAT_BUDGET to enable it; now "
                          f"{accelerator.remat_plugin.budget!r})")
        return
    accelerator.print(plan.summary())
    metrics = accelerator.remat_metrics
    if "remat/measured_peak_bytes" in metrics:
        accelerator.print(f"measured peak {format_bytes(metrics['remat/measured_peak_bytes'])} "
                          f"(predicted {format_bytes(metrics['remat/predicted_peak_bytes'])}, "
                          f"budget {format_bytes(metrics['remat/budget_bytes'])}, "
                          f"baseline {format_bytes(metrics['remat/baseline_peak_bytes'])})")


if __name__ == "__main__":
    main()
