"""Real trackers, read back: what the Hugging Face Trainer with ``RematTrainerCallback`` sends to
TensorBoard (its event files, read with TensorBoard's ``EventAccumulator``), MLflow (a file store, read with
the MLflow client) and W&B (an offline run, read with wandb's own ``wandb leet inspect``), what it prints, the
plans it keeps in the Trainer's checkpoint (a resumed run profiles nothing); Lightning's ``TensorBoardLogger``,
``MLFlowLogger`` and ``WandbLogger`` with ``AutoRemat``: the figures and the ``remat/pareto`` picture each stored."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_remat import RematTrainerCallback

transformers = pytest.importorskip("transformers")
pytest.importorskip("tensorboard")

FIGURES = ("remat/budget_bytes", "remat/baseline_peak_bytes", "remat/predicted_peak_bytes", "remat/predicted_overhead",
           "remat/num_checkpointed", "remat/num_plans", "remat/measured_peak_bytes")


def _model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64)
    return transformers.GPT2LMHeadModel(config)


def _data():
    ids = torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": x, "labels": x} for x in ids]


def _trainer(out, callback, steps, report_to=(), **arguments):
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=steps, report_to=list(report_to), use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0, seed=0, **{"save_strategy": "no", "logging_steps": 10, **arguments})
    return transformers.Trainer(model=_model(), args=args, train_dataset=_data(), callbacks=[callback])


def _figures_at_steps(log_history):
    """Each figure of the run's log history with the Trainer's global step it was logged at."""
    return {k: (entry["step"], v) for entry in log_history for k, v in entry.items() if k.startswith("remat/")}


def _tensorboard(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


def test_the_trainer_sends_every_figure_to_tensorboard_mlflow_and_wandb_and_prints_the_plan(
        tmp_path, monkeypatch, capsys):
    """Before: the figures reached ``trainer.state.log_history`` only (the reporting callbacks run before a
    user's, so its ``on_log`` came too late), and nothing was printed. Now each figure goes with the Trainer's
    log of the step where it became known (forced at that step), to every ``report_to`` tracker, once."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps the file store behind this switch
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "remat")
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(name, value)
    callback = RematTrainerCallback(budget="min")
    trainer = _trainer(tmp_path, callback, steps=3, report_to=["tensorboard", "mlflow", "wandb"])
    trainer.train()
    import wandb

    wandb.finish()
    expected = _figures_at_steps(trainer.state.log_history)
    assert set(FIGURES) <= set(expected) and expected["remat/measured_peak_bytes"][0] == 2, expected
    assert {k: v for k, (_, v) in expected.items()} == callback.metrics

    # TensorBoard: the Trainer's tags (``train/`` before every training log), one point each, at its step.
    events = _tensorboard(tmp_path / "tb")
    board = {tag[len("train/"):]: [(e.step, e.value) for e in events.Scalars(tag)]
             for tag in events.Tags()["scalars"] if tag.startswith("train/remat/")}
    assert board == {k: [(step, pytest.approx(v, rel=1e-6))] for k, (step, v) in expected.items()}

    # MLflow: the figures under their own names, at their steps.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("remat").experiment_id])
    for key, (step, value) in expected.items():
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] == [(step, value)], key

    # W&B: the offline run's history records, read by wandb's own reader.
    (log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    records = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(log)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [json.loads(line)["history"]["item"] for line in records.splitlines() if '"type":"history"' in line]
    logged = {k[len("train/"):]: (row["train/global_step"], v) for row in rows for k, v in row.items()
              if k.startswith("train/remat/")}
    assert logged == expected
    assert sum(k.startswith("train/remat/") for row in rows for k in row) == len(expected)  # once each

    printed = capsys.readouterr().out
    assert printed.count("Recompute plan: ") == 2  # planned on fake tensors, then again after the observed step
    assert printed.count("lightning-remat: measured peak of a steady training step with the plan: ") == 1


def test_a_resumed_trainer_installs_the_checkpoint_s_plans_without_profiling_with_the_same_losses(tmp_path, capsys):
    """Before: the plan was not in the Trainer's checkpoint, and a resumed run profiled again. Now the
    callback is an ``ExportableState``: its plans are in ``trainer_state.json`` and a resume installs them."""
    first = RematTrainerCallback(budget="min")
    whole = _trainer(tmp_path / "whole", first, steps=4, save_strategy="steps", save_steps=2, logging_steps=1)
    whole.train()
    saved = json.loads((tmp_path / "whole" / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["RematTrainerCallback"]["attributes"]["remat_plans"]["plans"]
    capsys.readouterr()

    callback = RematTrainerCallback(budget="min")
    resumed = _trainer(tmp_path / "resumed", callback, steps=4, logging_steps=1)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert callback.session.run.profiles == 0
    counts = callback.session.shape_plans.counts
    assert counts.real_profiles == counts.fake_profiles == counts.solves == 0
    assert callback.plan.to_dict()["actions"] == first.plan.to_dict()["actions"]
    losses = [(e["step"], e["loss"]) for e in resumed.state.log_history if "loss" in e]
    assert losses == [(e["step"], e["loss"]) for e in whole.state.log_history if "loss" in e]  # steps 3, 4 too
    assert [step for step, _ in losses] == [1, 2, 3, 4]
    assert "remat/measured_peak_bytes" in callback.metrics  # a resumed run measures its own step
    assert "the checkpoint's plan, applied without profiling" in capsys.readouterr().out


def _fit_a_chain(tmp_path, logger):
    """``AutoRemat(budget="min")`` over 3 steps of a 4-block MLP chain under Lightning with ``logger``."""
    import lightning.pytorch as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_remat import AutoRemat

    class Chain(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callback = AutoRemat(budget="min", verbose=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[callback])
    trainer.fit(Chain(), DataLoader(TensorDataset(torch.randn(96, 16)), batch_size=32))
    return trainer, callback


def test_lightning_s_tensorboard_logger_gets_the_figures_and_the_pareto_picture(tmp_path):
    """Before: loggers were tested with stand-ins only. Lightning's ``TensorBoardLogger`` writes the figures and
    the ``remat/pareto`` picture (a PNG, at the measured step) into event files TensorBoard reads back."""
    from lightning.pytorch.loggers import TensorBoardLogger

    trainer, callback = _fit_a_chain(tmp_path, TensorBoardLogger(tmp_path, name="tb"))
    events = _tensorboard(trainer.logger.log_dir)
    plan = callback.plan
    scalars = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["remat/predicted_peak_bytes"][-1] == pytest.approx(plan.predicted_peak_bytes)
    assert scalars["remat/num_checkpointed"][-1] == len(plan.checkpointed)
    assert scalars["remat/predicted_peak_bytes"][-1] < scalars["remat/baseline_peak_bytes"][-1]  # it recomputes
    assert scalars["remat/measured_peak_bytes"] == [pytest.approx(callback.measured_peak_bytes)]
    (image,) = events.Images("remat/pareto")
    assert image.encoded_image_string.startswith(b"\x89PNG") and image.width > 100 and image.height > 100


def test_lightning_s_mlflow_and_wandb_loggers_get_the_figures_and_the_pareto_picture(tmp_path, monkeypatch):
    """Before: Lightning's MLflow and W&B loggers were tested with stand-ins. Both, real: the figures read back
    with MLflow's client and wandb's own reader, the ``remat/pareto`` picture as the PNG file each stored."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_SILENT", "true")

    uri = f"file:{tmp_path / 'mlruns'}"
    loggers = [MLFlowLogger(experiment_name="remat", tracking_uri=uri), WandbLogger(offline=True, save_dir=str(tmp_path))]
    _, callback = _fit_a_chain(tmp_path, loggers)
    import wandb

    wandb.finish()
    plan = callback.plan
    expected = {"remat/predicted_peak_bytes": plan.predicted_peak_bytes, "remat/num_checkpointed": len(plan.checkpointed),
                "remat/measured_peak_bytes": callback.measured_peak_bytes}
    assert plan.checkpointed and callback.measured_peak_bytes

    client = MlflowClient(tracking_uri=uri)
    run_id = loggers[0].run_id
    for key, value in expected.items():
        assert client.get_metric_history(run_id, key)[-1].value == pytest.approx(value), key
    (picture,) = [a.path for a in client.list_artifacts(run_id, "remat") if "pareto" in a.path]
    assert Path(client.download_artifacts(run_id, picture, str(tmp_path))).read_bytes().startswith(b"\x89PNG")

    (log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    records = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(log)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [json.loads(line)["history"]["item"] for line in records.splitlines() if '"type":"history"' in line]
    logged = {k: v for row in rows for k, v in row.items() if k in expected}
    assert logged == {k: pytest.approx(v) for k, v in expected.items()}
    (png,) = tmp_path.glob("wandb/offline-run-*/files/media/images/remat/pareto*.png")
    assert png.read_bytes().startswith(b"\x89PNG")
