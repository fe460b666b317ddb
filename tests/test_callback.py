"""The Lightning callback, on CPU with a tiny GPT-2 (random weights, dropout active).

The expensive runs (a profile for the budget, a fit with and one without the callback) happen once
per module in the ``runs`` fixture; the tests then check different things about them.
"""

from __future__ import annotations

import csv
import json
import os
import runpy
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import lightning_remat
import lightning_remat.runtime.profiling.profile as profile_module
from lightning_remat import (AlreadyCheckpointedError, AutoRemat, BudgetTooSmallError, NoCandidateError, format_bytes,
                             measure_step, profile_step, solve)
from lightning_remat.runtime.installing.apply import checkpointed_modules
from lightning_remat.models import build

VOCAB, SEQ, BATCH, LAYERS, HIDDEN = 128, 32, 2, 3, 32
METRICS = ["remat/budget_bytes", "remat/baseline_peak_bytes", "remat/predicted_peak_bytes",
           "remat/measured_peak_bytes", "remat/predicted_overhead", "remat/num_checkpointed"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread for tiny models


class LitLM(L.LightningModule):
    """A tiny GPT-2 language model; the weights are the same for every instance (seeded build)."""

    def __init__(self, layers: int = LAYERS, hidden: int = HIDDEN, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.model = build("gpt2", layers=layers, hidden=hidden, seq_len=SEQ, vocab=VOCAB, batch_size=BATCH).model

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def token_batches(n: int = 16) -> DataLoader:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(ids), batch_size=BATCH)


def lit_step(lit: LitLM):
    (ids,) = next(iter(token_batches()))
    return lambda module: module.model(input_ids=ids, labels=ids).loss


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def make_trainer(tmp: Path, callbacks: list, max_steps: int = 6, **kwargs) -> L.Trainer:
    kwargs.setdefault("logger", False)
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, deterministic=True,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     default_root_dir=tmp, **kwargs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Budget = static + 50% of activation memory; one fit without and one with AutoRemat."""
    tmp = tmp_path_factory.mktemp("callback")
    lit = LitLM()
    profile = profile_step(lit, lit_step(lit), optimizer=torch.optim.Adam(lit.parameters()))
    budget = profile.static_bytes + profile.baseline_activation_bytes // 2

    L.seed_everything(0)
    plain, plain_losses = LitLM(), LossRecorder()
    plain_trainer = make_trainer(tmp, [plain_losses])
    plain_trainer.fit(plain, token_batches())
    plain_trainer.save_checkpoint(tmp / "plain.ckpt")
    plain_weights = {k: v.clone() for k, v in plain.state_dict().items()}

    L.seed_everything(0)
    lit, losses, callback = LitLM(), LossRecorder(), AutoRemat(budget=budget, verbose=True)
    trainer = make_trainer(tmp, [callback, losses], logger=CSVLogger(tmp / "logs", name="remat"))
    started = time.perf_counter()
    trainer.fit(lit, token_batches())
    seconds = time.perf_counter() - started
    trainer.save_checkpoint(tmp / "remat.ckpt")
    weights = {k: v.clone() for k, v in lit.state_dict().items()}
    return dict(tmp=tmp, profile=profile, budget=budget, plain=plain, plain_trainer=plain_trainer,
                plain_losses=plain_losses.losses, lit=lit, trainer=trainer, callback=callback,
                losses=losses.losses, seconds=seconds, weights=weights, plain_weights=plain_weights)


@pytest.fixture
def count_profiles(monkeypatch):
    calls = []
    real = profile_module.profile_step

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(profile_module, "profile_step", counting)
    return calls


# ------------------------------------------------------------------------------------ (1) fit


def test_plan_keeps_the_step_under_the_budget(runs):
    callback, lit, budget = runs["callback"], runs["lit"], runs["budget"]
    plan = callback.plan
    assert plan is not None and plan.checkpointed, "half the activation memory cannot be met without recomputation"
    assert checkpointed_modules(lit) == plan.checkpointed
    assert all(name.startswith("model.transformer.h.") for name in plan.checkpointed)
    assert plan.predicted_peak_bytes <= budget < plan.baseline_peak_bytes
    # The callback's own measurement of a Lightning training step with the plan ...
    assert callback.measured_peak_bytes is not None and callback.measured_peak_bytes <= budget
    # ... agrees with measure_step of the wrapped model (Adam with state, as in every later step),
    step = lit_step(lit)
    with_plan = measure_step(lit, step, runs["trainer"].optimizers[0])
    assert with_plan.peak_bytes <= budget
    assert abs(with_plan.peak_bytes - callback.measured_peak_bytes) <= 0.05 * budget
    # ... and the same step without recomputation does not fit: the budget really binds.
    without = measure_step(runs["plain"], step, runs["plain_trainer"].optimizers[0])
    assert without.peak_bytes > budget
    assert with_plan.peak_bytes < without.peak_bytes


def test_losses_equal_those_without_the_callback(runs):
    # Dropout is active: equal losses also mean profiling restored the RNG state and recomputation
    # reproduced the masks.
    assert len(runs["losses"]) == 6
    assert runs["losses"] == runs["plain_losses"]
    assert list(runs["weights"]) == list(runs["plain_weights"])
    for name, p in runs["plain_weights"].items():
        torch.testing.assert_close(runs["weights"][name], p, rtol=0, atol=0)


def test_metrics_are_written_to_the_csv_logger(runs):
    path = Path(runs["trainer"].loggers[0].log_dir) / "metrics.csv"
    rows = list(csv.DictReader(path.open()))
    values = {}
    for row in rows:
        for key in METRICS:
            if row.get(key):
                values[key] = float(row[key])
    assert set(values) == set(METRICS)
    plan = runs["callback"].plan
    assert values["remat/budget_bytes"] == runs["budget"]
    assert values["remat/num_checkpointed"] == len(plan.checkpointed)
    assert values["remat/predicted_peak_bytes"] == plan.predicted_peak_bytes
    assert values["remat/baseline_peak_bytes"] == plan.baseline_peak_bytes
    assert values["remat/measured_peak_bytes"] == runs["callback"].measured_peak_bytes
    assert 0 < values["remat/predicted_overhead"] < 1


# ------------------------------------------------------------------------------------ (2) DDP

DDP_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset
    import lightning_remat.runtime.profiling.profile as profile_module
    from lightning_remat import AutoRemat
    from lightning_remat.runtime.installing.apply import checkpointed_modules
    from lightning_remat.models import build

    devices, out = int(sys.argv[1]), sys.argv[2]
    calls = []
    real = profile_module.profile_step
    profile_module.profile_step = lambda *a, **k: (calls.append(1), real(*a, **k))[1]

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build("gpt2", layers=2, hidden=32, seq_len=32, vocab=128).model
            for m in self.model.modules():  # ranks draw different masks than one process would
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

        def train_dataloader(self):
            # Rank r reads samples r, r+2, ...: per optimizer step the two ranks together see the
            # same 4 samples as the single process (Lightning's DistributedSampler would shuffle).
            ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
            return DataLoader(TensorDataset(ids[self.global_rank::devices]), batch_size=4 // devices)

    lit = LitLM()
    callback = AutoRemat(budget="min", cost="flops", verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=2,
                        callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(lit)
    rank = trainer.global_rank
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"profile_calls": len(calls), "checkpointed": checkpointed_modules(lit),
                   "plan": callback.plan.checkpointed, "world_size": trainer.world_size,
                   "budget": callback.plan.budget_bytes, "predicted": callback.plan.predicted_peak_bytes,
                   "measured": callback.measured_peak_bytes, "notes": callback.plan.notes}, f)
    torch.save(lit.state_dict(), f"{out}/weights{rank}.pt")
''')


def _run_ddp_script(script: Path, out: Path) -> None:
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, str(script), "2", str(out)], cwd=out, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.distributed
def test_ddp_ranks_apply_the_plan_of_rank_zero(tmp_path, monkeypatch):
    """strategy="ddp", devices=2 on CPU (gloo), launched as a script as users launch it."""
    script = tmp_path / "ddp_fit.py"
    script.write_text(DDP_SCRIPT)
    _run_ddp_script(script, tmp_path / "ddp")
    # The single-process reference runs the same script in this process (no second start-up);
    # the script replaces profile_step with a counter, which monkeypatch puts back.
    (tmp_path / "single").mkdir()
    monkeypatch.setattr(profile_module, "profile_step", profile_module.profile_step)
    monkeypatch.setattr(sys, "argv", [str(script), "1", str(tmp_path / "single")])
    monkeypatch.chdir(tmp_path / "single")
    runpy.run_path(str(script), run_name="__main__")
    ranks = [json.loads((tmp_path / "ddp" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    # Only rank 0 profiles; both wrap the same (non-empty) set of modules, the one rank 0 chose.
    assert [r["profile_calls"] for r in ranks] == [1, 0]
    assert ranks[0]["checkpointed"] and ranks[0]["checkpointed"] == ranks[1]["checkpointed"] == ranks[0]["plan"]
    # DDP's gradient buckets are in the prediction, and the largest peak of either rank over a
    # steady step (the callback reduces it with max) is within the budget and the prediction.
    assert any("DDP's gradient buckets" in note for note in ranks[0]["notes"])
    assert ranks[0]["measured"] == ranks[1]["measured"] <= ranks[0]["budget"]
    assert ranks[0]["measured"] == pytest.approx(ranks[0]["predicted"], rel=0.05)
    # (The single process plans for its own batch of 4, so its plan may differ; values may not.)
    assert json.loads((tmp_path / "single" / "rank0.json").read_text())["checkpointed"]
    # Two SGD steps on 2 ranks x 2 samples equal two steps of one process on 4 samples.
    w0, w1 = (torch.load(tmp_path / "ddp" / f"weights{r}.pt") for r in (0, 1))
    w_single = torch.load(tmp_path / "single" / "weights0.pt")
    initial = LitLM(layers=2).state_dict()
    for name, value in w_single.items():
        torch.testing.assert_close(w0[name], w1[name], rtol=0, atol=0)
        torch.testing.assert_close(w0[name], value, rtol=1e-4, atol=1e-5)
    moved = [n for n, v in w_single.items() if n in initial and v.shape == initial[n].shape and not torch.equal(v, initial[n])]
    assert moved, "training changed no weight"


# ------------------------------------------------------------------------------------ (3) resume


def test_resume_applies_the_saved_plan_without_profiling(runs, count_profiles, tmp_path):
    plan = runs["callback"].plan
    ckpt = torch.load(runs["tmp"] / "remat.ckpt", weights_only=False)
    (state,) = [v for k, v in ckpt["callbacks"].items() if k.startswith("AutoRemat")]
    assert state["plan"]["checkpointed"] == plan.checkpointed

    lit, losses, callback = LitLM(), LossRecorder(), AutoRemat(budget=runs["budget"], verbose=False)
    trainer = make_trainer(tmp_path, [callback, losses], max_steps=8)
    trainer.fit(lit, token_batches(), ckpt_path=runs["tmp"] / "remat.ckpt")
    assert count_profiles == []
    assert callback.plan.checkpointed == plan.checkpointed == checkpointed_modules(lit)
    assert len(losses.losses) == 2 and trainer.global_step == 8
    assert callback.measured_peak_bytes is not None and callback.measured_peak_bytes <= runs["budget"]


def test_resume_with_the_cost_named_does_not_profile_and_another_cost_plans_again(runs, count_profiles, tmp_path):
    """The run was made with ``cost`` unset (the CPU's: flops). The state key does not hold the cost: resumed with
    ``cost="flops"`` named, the plan is installed without profiling; resumed with another cost, it is planned again,
    said once."""
    budget, plan = runs["budget"], runs["callback"].plan
    assert plan.cost_kind.value == "flops"
    ckpt = torch.load(runs["tmp"] / "remat.ckpt", weights_only=False)
    (key,) = [k for k in ckpt["callbacks"] if k.startswith("AutoRemat")]
    assert key == f"AutoRemat{{'budget': '{budget}', 'candidates': None}}"
    lit, callback = LitLM(), AutoRemat(budget=budget, cost="flops", verbose=False)
    make_trainer(tmp_path, [callback], max_steps=8).fit(lit, token_batches(), ckpt_path=runs["tmp"] / "remat.ckpt")
    assert count_profiles == [] and callback.plan.checkpointed == plan.checkpointed == checkpointed_modules(lit)
    lit, callback = LitLM(), AutoRemat(budget=budget, cost="time", verbose=False)
    with pytest.warns(UserWarning, match="made for another cost .priced in flops, this run in time"):
        make_trainer(tmp_path, [callback], max_steps=8).fit(lit, token_batches(), ckpt_path=runs["tmp"] / "remat.ckpt")
    assert callback.plan.cost_kind.value == "time" and checkpointed_modules(lit) == callback.plan.checkpointed


def test_checkpoints_load_with_and_without_the_callback(runs, count_profiles, tmp_path):
    with_cb = torch.load(runs["tmp"] / "remat.ckpt", weights_only=False)["state_dict"]
    without_cb = torch.load(runs["tmp"] / "plain.ckpt", weights_only=False)["state_dict"]
    assert list(with_cb) == list(without_cb)
    fresh = LitLM()
    fresh.load_state_dict(with_cb, strict=True)
    # A checkpoint written with the callback resumes without it: nothing is wrapped.
    lit = LitLM()
    make_trainer(tmp_path, [], max_steps=7).fit(lit, token_batches(), ckpt_path=runs["tmp"] / "remat.ckpt")
    assert checkpointed_modules(lit) == []
    # And one written without it resumes with it: no saved plan, so it profiles once and wraps. Its
    # second batch is the one measured (profile_steps=1).
    lit, callback = LitLM(), AutoRemat(budget=runs["budget"], profile_steps=1, cost="flops", verbose=False)
    make_trainer(tmp_path, [callback], max_steps=8).fit(lit, token_batches(), ckpt_path=runs["tmp"] / "plain.ckpt")
    assert len(count_profiles) == 1
    assert checkpointed_modules(lit) == callback.plan.checkpointed != []
    assert callback.measured_peak_bytes <= runs["budget"]


# ------------------------------------------------------------------------------------ (4) CLI


def test_lightning_cli_builds_the_callback_from_the_command_line(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(LitLM, run=False, save_config_callback=None, args=[
        "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=lightning_remat.AutoRemat", "--trainer.callbacks.budget=1GB",
        "--trainer.callbacks.cost=flops", "--trainer.callbacks.candidates=[GPT2Block]",
    ])
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, AutoRemat)]
    assert callback.config.budget.resolve() == 10**9 and callback.cost == "flops" and callback.candidates == ["GPT2Block"]
    assert callback.profile_steps == 1 and callback.verbose is True


# ------------------------------------------------------------------------------------ (5) bad input


def test_budget_that_cannot_be_met_stops_fit_before_training(runs, tmp_path):
    losses = LossRecorder()
    budget = runs["profile"].static_bytes  # no activation memory at all
    trainer = make_trainer(tmp_path, [AutoRemat(budget=budget, cost="flops", verbose=False), losses])
    with pytest.raises(BudgetTooSmallError, match="smallest reachable peak") as info:
        trainer.fit(LitLM(), token_batches())
    assert losses.losses == [] and trainer.global_step == 0
    smallest = info.value.smallest_peak_bytes
    assert budget < smallest < runs["profile"].baseline_peak_bytes
    assert format_bytes(smallest) in str(info.value)


def test_unknown_candidate_lists_what_exists(tmp_path):
    trainer = make_trainer(tmp_path, [AutoRemat(budget="1GB", candidates=["NoSuchBlock"])])
    with pytest.raises(NoCandidateError, match="NoSuchBlock") as info:
        trainer.fit(LitLM(), token_batches())
    assert "GPT2Block" in str(info.value) and trainer.global_step == 0


@pytest.mark.parametrize("kwargs", [dict(budget="ten"), dict(budget="10XB"), dict(budget=0), dict(budget=-5),
                                    dict(budget=None), dict(budget="1GB", cost="speed"),
                                    dict(budget="1GB", profile_steps=0), dict(budget="1GB", candidates=[])])
def test_bad_arguments_fail_at_construction(kwargs):
    with pytest.raises(ValueError):
        AutoRemat(**kwargs)


def test_budget_error_names_the_value_and_accepted_forms():
    with pytest.raises(ValueError, match=r"'10XB'.*Accepted"):
        AutoRemat(budget="10XB")


# ------------------------------------------------------------------------------------ robustness


def test_out_of_memory_while_profiling_falls_back_to_whole_blocks(monkeypatch, tmp_path):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(profile_module, "profile_step", oom)
    lit, losses, callback = LitLM(layers=2), LossRecorder(), AutoRemat(budget="1GB", verbose=False)
    with pytest.warns(UserWarning, match="out of memory while profiling"):
        make_trainer(tmp_path, [callback, losses], max_steps=2).fit(lit, token_batches())
    assert checkpointed_modules(lit) == ["model.transformer.h.0", "model.transformer.h.1"]
    assert len(losses.losses) == 2 and callback.measured_peak_bytes > 0


def test_hugging_face_checkpointing_is_taken_over_with_one_warning(count_profiles, tmp_path):
    """Issue 33: a model whose own gradient checkpointing is on was left alone (no plan, no budget); the
    budget asked of AutoRemat now wins: Hugging Face's checkpointing is turned off, one warning says so,
    the plan recomputes, and the losses are those of the plain model."""
    import warnings

    plain = LossRecorder()
    make_trainer(tmp_path, [plain], max_steps=2).fit(LitLM(layers=2), token_batches())
    lit = LitLM(layers=2)
    lit.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    losses = LossRecorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [AutoRemat(budget="min"), losses], max_steps=2).fit(lit, token_batches())
    said = [str(w.message) for w in caught if "turned off the model's own gradient checkpointing" in str(w.message)]
    assert len(said) == 1 and "use_reentrant=False" in said[0] and "AutoRemat" in said[0], said
    assert not lit.model.is_activation_checkpointing and count_profiles and checkpointed_modules(lit)
    assert losses.losses == plain.losses


def test_a_torch_checkpoint_wrapper_is_refused_before_training(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    lit = LitLM(layers=2)
    lit.model.transformer.h[0] = checkpoint_wrapper(lit.model.transformer.h[0])
    losses = LossRecorder()
    with pytest.raises(AlreadyCheckpointedError, match="checkpoint_wrapper.*activation_checkpointing_policy"):
        make_trainer(tmp_path, [AutoRemat(budget="1GB"), losses], max_steps=1).fit(lit, token_batches())
    assert losses.losses == []


def test_autoremat_is_exported_lazily():
    import importlib

    # Not bound by `import lightning_remat` (test_layout: that import loads neither torch nor
    # Lightning); each lazy name is the object its module (or package) defines, and is in __all__.
    lazy = lightning_remat._LAZY
    assert lazy["AutoRemat"] == "lightning_remat.integrations.lightning.callback"
    for name, module in lazy.items():
        assert name not in vars(lightning_remat) and name in lightning_remat.__all__, name
        found = getattr(lightning_remat, name)
        assert found is getattr(importlib.import_module(module), name), name
        assert (found.__module__ + ".").startswith(module + "."), f"{name} is defined in {found.__module__}, not {module}"
    assert AutoRemat.__module__ == lazy["AutoRemat"]
    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        lightning_remat.NotAName


# ------------------------------------------------------------------------------------ the example


def test_example_train_gpt_runs_and_saves_memory(tmp_path, capsys):
    example = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "train_gpt.py"))
    result = example["main"](["--layers", "2", "--n-embd", "32", "--seq-len", "32", "--vocab", "128",
                              "--batch-size", "2", "--steps", "3", "--cost", "flops", "--log-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert result["after"] <= result["budget"] < result["before"]
    # One baseline in the run's output: the example's measured one is the one AutoRemat's plan line shows (its
    # sample batch has its own storage; a view counted every batch's tokens: 340.17 against 340.10 MiB).
    assert f"baseline {format_bytes(result['before'])})" in out and "memory saved:" in out and "AutoRemat plan" in out
    assert list(tmp_path.glob("train_gpt/version_0/metrics.csv"))


def test_fake_planning_applies_the_same_plan_before_the_first_real_step(runs, tmp_path):
    # Planned on fake tensors, the first real step already runs under the plan: same modules as a
    # real profile priced in FLOPs, the budget held, and the same losses as without the callback.
    expected = solve(runs["profile"], runs["budget"], cost="flops")
    L.seed_everything(0)
    lit, losses = LitLM(), LossRecorder()
    callback = AutoRemat(budget=runs["budget"], cost="flops", fake=True, verbose=False)
    trainer = make_trainer(tmp_path, [callback, losses], max_steps=3)
    trainer.fit(lit, token_batches())
    assert callback.plan.checkpointed == expected.checkpointed
    assert callback.plan.predicted_peak_bytes == pytest.approx(expected.predicted_peak_bytes, rel=0.01)
    assert callback.measured_peak_bytes <= runs["budget"]
    assert losses.losses == runs["plain_losses"][:3]
    # The LightningModule itself was never touched by the fake profile.
    assert all(type(p) is torch.nn.Parameter for p in lit.parameters())
    # fake=True with cost="time" is no longer refused: FLOPs are priced at a measured step's seconds
    # per FLOP (tests/test_first_step_integrations.py).
