"""What a newcomer sees while planning and after: the one progress display (after its delay, on a terminal, rank 0,
off with verbose=False; in plan_remat and AutoRemat) and the plan's picture in the loggers that take images."""

import io
import time
from types import SimpleNamespace

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_remat.report.render as render
from lightning_remat import AutoRemat, plan_remat
from lightning_remat.report.render import PhaseProgress


def _terminal():
    buffer = io.StringIO()
    return buffer, Console(file=buffer, force_terminal=True, width=100)


def test_the_display_appears_only_after_its_delay_on_a_terminal_and_when_enabled():
    buffer, console = _terminal()
    with PhaseProgress(2, delay=5.0, console=console) as quick:
        quick("solving")  # done long before the delay: nothing shown
    assert not quick.shown and buffer.getvalue() == ""
    with PhaseProgress(2, delay=0.05, console=console) as slow:
        slow("profiling a training step")
        time.sleep(0.4)
        slow("solving")
    assert slow.shown and "profiling a training step" in buffer.getvalue() and slow.phases_done == 2
    for display in (PhaseProgress(delay=0, console=console, enabled=False),
                    PhaseProgress(delay=0, console=Console(file=io.StringIO(), force_terminal=False))):
        with display as advance:
            advance("profiling")
        assert not display.shown


@pytest.fixture()
def shown(monkeypatch):
    """Every display at once, to a terminal we read."""
    buffer, console = _terminal()
    monkeypatch.setattr(render, "DELAY_SECONDS", 0.0)
    monkeypatch.setattr(render, "default_console", lambda: console)
    return buffer


def _chain():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3)])
    x = torch.randn(32, 16)
    return model, x


def test_plan_remat_shows_planning_unless_verbose_is_false(shown):
    model, x = _chain()
    plan_remat(model, lambda m: m(x).square().mean(), "min", verbose=False)
    assert shown.getvalue() == ""
    plan_remat(model, lambda m: m(x).square().mean(), "min", fake=True)
    assert "profiling a training step of Sequential on fake tensors" in shown.getvalue()


class _Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net, _ = _chain()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("verbose", [True, False])
def test_autoremat_with_fake_planning_shows_planning_unless_verbose_is_false(shown, verbose, tmp_path):
    loader = DataLoader(TensorDataset(torch.randn(64, 16)), batch_size=32)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[AutoRemat(budget="min", fake=True, verbose=verbose)])
    trainer.fit(_Module(), loader)
    assert ("profiling a training step of _Module on fake tensors" in shown.getvalue()) == verbose


class _ImageLogger(Logger):
    """A Lightning logger whose experiment takes figures as TensorBoard's SummaryWriter does
    (tensorboard is not installed here), or one with W&B's ``log_image``, or MLflow's ``log_figure``."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.images = kind, []
        if kind == "wandb":
            self.log_image = lambda key, images, step=None: self._take(key, images[0], step)
        elif kind == "mlflow":
            self.run_id = "run-1"

    @property
    def experiment(self):
        if self.kind == "tensorboard":
            return SimpleNamespace(add_figure=lambda tag, figure, global_step=None: self._take(tag, figure, global_step))
        if self.kind == "mlflow":
            return SimpleNamespace(log_figure=lambda run_id, figure, name: self._take(name, figure, run_id))
        return SimpleNamespace()

    def _take(self, tag, figure, step):
        ax = figure.axes[0]
        self.images.append((tag, step, [t.get_text() for t in ax.texts], [line.get_label() for line in ax.get_lines()]))

    name, version = "images", 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_autoremat_logs_the_plan_picture_with_its_measured_point_to_loggers_that_take_images(tmp_path):
    loggers = [_ImageLogger(kind) for kind in ("tensorboard", "wandb", "mlflow", "none")]
    loader = DataLoader(TensorDataset(torch.randn(96, 16)), batch_size=32)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=loggers, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[AutoRemat(budget="min", verbose=False)])
    trainer.fit(_Module(), loader)
    for logger in loggers[:3]:
        (tag, step, texts, lines), = logger.images
        assert tag.startswith("remat/pareto") and "measured" in texts and "budget" in lines
    assert loggers[3].images == []


def test_the_7b_example_in_bf16_mixed_ends_in_one_clean_line_with_advice_that_applies():
    """Static memory alone above the budget: the advice is precision, sharding or a larger GPU, not the batch."""
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([sys.executable, "examples/plan_llama7b.py", "--layers", "2", "--precision", "bf16-mixed",
                          "--device-memory", "8GB"], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    line = run.stderr.strip()
    assert "\n" not in line and line.startswith("plan_llama7b: no plan fits 90% of 8GB: parameters, gradients and AdamW")
    assert "--precision bf16-true" in line and "world_size" in line and "batch size" not in line


def test_the_batch_size_search_shows_its_profiles_unless_verbose_is_false(shown):
    from lightning_remat import find_remat_batch_size

    model, _ = _chain()

    def make_step(batch_size):
        x = torch.randn(batch_size, 16)
        return lambda m: m(x).square().mean()

    find_remat_batch_size(model, make_step, 2_000_000, max_val=64, apply=False, verbose=False)
    assert shown.getvalue() == ""
    find_remat_batch_size(model, make_step, 2_000_000, max_val=64, apply=False)
    assert "profiling a training step of Sequential" in shown.getvalue()
