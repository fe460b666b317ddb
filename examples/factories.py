"""Factories for the ``lightning-remat`` command line (random weights, synthetic batches, CPU-sized).

    lightning-remat plan examples/factories.py:gpt2 --budget min
    lightning-remat plan examples/factories.py:mlp --budget 60MB --cost flops --out report/
    lightning-remat plan examples/factories.py:lightning_mlp --json

A factory takes no arguments and returns ``(model, step)``, ``(model, step, optimizer)`` or
``(lightning_module, batch)``; ``step(model)`` returns the scalar loss of a forward pass.
"""

from __future__ import annotations

import torch
from torch import nn


def gpt2(layers: int = 4, hidden: int = 128, seq_len: int = 128, batch_size: int = 4):
    """A small GPT-2 (transformers config, random weights) with Adam: ``(model, step, optimizer)``."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=4, vocab_size=1024, n_positions=seq_len,
                                     use_cache=False)  # training: no key/value cache held through the step
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))

    def step(m):
        return m(input_ids=ids, labels=ids).loss

    return model, step, torch.optim.Adam(model.parameters(), lr=1e-4)


def mlp(depth: int = 8, width: int = 64, batch_size: int = 256):
    """A plain chain of MLP blocks with Adam: ``(model, step, optimizer)``."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                            for _ in range(depth)]).train()
    x, target = torch.randn(batch_size, width), torch.randn(batch_size, width)

    def step(m):
        return nn.functional.mse_loss(m(x), target)

    return model, step, torch.optim.Adam(model.parameters(), lr=1e-3)


def lightning_mlp(depth: int = 6, width: int = 64, batch_size: int = 128):
    """A LightningModule and a sample batch: ``(lightning_module, batch)``."""
    import lightning.pytorch as pl

    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                        nn.Linear(4 * width, width)) for _ in range(depth)])

        def forward(self, x):
            return self.blocks(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    return Regressor(), (torch.randn(batch_size, width), torch.randn(batch_size, width))


def llama7b(layers: int = 32, seq_len: int = 2048):
    """Llama-2-7B on the meta device (nothing allocated), for planning with ``--fake``:

        lightning-remat plan examples/factories.py:llama7b --fake --dtype bfloat16 --device cuda \\
            --device-memory 80GB --budget 90% --gpu h100
    """
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from plan_llama7b import build_llama

    model = build_llama(layers)
    ids = torch.randint(0, 32000, (1, seq_len))
    return model, lambda m: m(input_ids=ids, labels=ids).loss, torch.optim.AdamW(model.parameters())


def llama7b_two_layers():
    """The same with 2 layers: a quick demonstration of ``--fake``."""
    return llama7b(layers=2)


def llama_lengths(layers: int = 2, hidden: int = 64, vocab: int = 256):
    """A tiny Llama and ``make_step(seq_len)``, for ``lightning-remat seq-len`` (the longest sequence that fits):

        lightning-remat seq-len examples/factories.py:llama_lengths --budget 8MB --multiple-of 32
    """
    from lightning_remat.models import build

    model = build("llama", layers=layers, hidden=hidden, seq_len=128, vocab=vocab, batch_size=1).model

    def make_step(seq_len: int):
        ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
        return lambda m: m(input_ids=ids, labels=ids).loss

    return model, make_step, torch.optim.AdamW(model.parameters())
