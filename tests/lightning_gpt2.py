"""Lightning pieces several tests share: a small GPT-2 LightningModule and a callback that measures
steady training steps. Imported by test modules, and by the scripts the multi-process tests launch
(``script_header()`` puts the repository on their ``sys.path``)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_remat.models import build
from lightning_remat.runtime.measuring.measure import PeakWindow

SMALL = dict(layers=3, hidden=64, seq_len=32, batch_size=2, vocab=128)


def script_header() -> str:
    """The first line of a launched script: the repository on its import path (``tests.*``)."""
    return f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"


class LitGPT2(L.LightningModule):
    """GPT-2 (``SMALL`` unless ``sizes`` say otherwise) trained on its own tokens with Adam (lr 1e-3).

    ``shard``: ``fully_shard`` every block and the model in ``configure_model`` (FSDP2 under
    ``ModelParallelStrategy``); ``dropout=False`` zeroes the dropouts (sharded and compiled runs
    draw other random numbers); ``batch_size`` is the attribute a batch-size finder sets, read by
    ``train_dataloader`` (64 sequences of token ids).
    """

    def __init__(self, shard: bool = False, dropout: bool = True, batch_size: int = 2, **sizes):
        super().__init__()
        self.shard, self.batch_size, self.sizes = shard, batch_size, {**SMALL, **sizes}
        torch.manual_seed(0)
        self.model = build("gpt2", **self.sizes).model
        if not dropout:
            for module in self.model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0

    def configure_model(self):
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def train_dataloader(self):
        ids = torch.randint(0, self.sizes["vocab"], (64, self.sizes["seq_len"]), generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(ids), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class SteadyPeaks(L.Callback):
    """The MemTracker peak of every step from step ``first`` on (``peaks``), every step's loss
    (``losses``) and the shape of every batch (``shapes``)."""

    def __init__(self, first: int = 2):
        self.first, self.peaks, self.losses, self.shapes, self.window = first, [], [], [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.shapes.append(list(batch[0].shape))
        if batch_idx >= self.first:
            self.window = PeakWindow(pl_module, trainer.optimizers[0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if self.window is not None:
            self.peaks.append(self.window.close())
            self.window = None
