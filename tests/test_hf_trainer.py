"""The Hugging Face Trainer with ``RematTrainerCallback``: a tiny GPT-2 (random weights, nothing
downloaded) trained by ``Trainer`` on the CPU holds a budget of static memory + 50% of its
activations over steady steps (``TorchPeak``, opened by the test), the prediction is within 5%
of that peak, and the logged losses equal those of the same run without the callback. Under dynamic
padding (the longest batch late), the plans follow each batch's shape and every step holds the budget."""

from __future__ import annotations

import pytest
import torch

from lightning_remat import RematTrainerCallback
from lightning_remat.accelerate import ENV_BUDGET
from lightning_remat.core.errors import AlreadyCheckpointedError, ConflictingArgumentsError

from tests.torch_meter import TorchPeak, static_bytes

transformers = pytest.importorskip("transformers")

STEPS = 6
FIRST_STEADY = 3  # step 0 observed and planned, step 1 measured by the session, then steady steps


def _model(positions: int = 64):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=positions, vocab_size=128)
    return transformers.GPT2LMHeadModel(config)


def _data(n: int = 48):
    ids = torch.randint(0, 128, (n, 64), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": x, "labels": x} for x in ids]


class SteadyPeaks(transformers.TrainerCallback):
    """``TorchPeak`` of every optimizer step from ``first`` on (first among the callbacks: its window
    opens before any other's ``on_step_begin`` and holds the session's work in the model's hooks), the
    static bytes (parameters, gradients, optimizer state) at the first of them and, with ``grads``,
    the gradients each optimizer step applies."""

    def __init__(self, first: int = FIRST_STEADY, grads: bool = False):
        self.first, self.peaks, self.static, self.meter = first, [], None, None
        self.grads = [] if grads else None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step >= self.first:
            self.static = self.static or static_bytes(model, optimizer)
            self.meter = TorchPeak(model, optimizer).start()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is not None:
            self.grads.append([p.grad.clone() for p in model.parameters()])

    def on_step_end(self, args, state, control, **kwargs):
        if self.meter is not None:
            self.peaks.append(self.meter.stop())
            self.meter = None


def _train(tmp_path, *callbacks, accumulation: int = 1, peaks=None, model=None, data=None, collator=None,
           steps: int = STEPS, **arguments):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
        max_steps=steps, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0, **arguments)
    peaks = peaks or SteadyPeaks()
    trainer = transformers.Trainer(model=model or _model(), args=args, train_dataset=data or _data(),
                                   data_collator=collator, callbacks=[peaks, *callbacks])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, peaks, losses


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_holds_the_budget_from_the_environment_with_the_same_losses(tmp_path, monkeypatch, accumulation):
    monkeypatch.delenv(ENV_BUDGET, raising=False)
    _, plain, plain_losses = _train(tmp_path, accumulation=accumulation)
    baseline = max(plain.peaks)
    budget = plain.static + (baseline - plain.static) // 2
    # The Trainer builds its own Accelerator: the environment reaches it through the callback.
    monkeypatch.setenv(ENV_BUDGET, str(budget))
    callback = RematTrainerCallback()
    trainer, planned, losses = _train(tmp_path, callback, accumulation=accumulation)

    plan = callback.plan
    assert plan is not None and plan.checkpointed
    steady = max(planned.peaks)
    assert steady <= budget, (steady, budget, baseline)
    assert abs(plan.predicted_peak_bytes - steady) <= 0.05 * steady, (plan.predicted_peak_bytes, steady)
    assert losses == plain_losses
    logged = {k: v for entry in trainer.state.log_history for k, v in entry.items() if k.startswith("remat/")}
    assert logged["remat/budget_bytes"] == budget
    assert logged["remat/predicted_peak_bytes"] == plan.predicted_peak_bytes
    assert logged["remat/measured_peak_bytes"] <= budget


def test_the_least_peak_holds_under_accumulation_with_what_the_trainer_carries_between_micro_batches(
        tmp_path, monkeypatch):
    """The Trainer fetches every micro-batch of an accumulation window up front and keeps the
    previous one's loss and its running loss: between two micro-batches it carries their inputs and
    scalars (2056 bytes here) into the next, which a profile of one call does not see. Once 12 bytes
    beyond the allowance for the loss made the measured step exceed a ``budget="min"`` plan; the
    carried bytes are now measured in the observed step and counted in every term."""
    import warnings

    monkeypatch.delenv(ENV_BUDGET, raising=False)
    callback = RematTrainerCallback(budget="min")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(tmp_path, callback, accumulation=2)
    metrics = callback.session.metrics
    assert metrics["remat/measured_peak_bytes"] <= metrics["remat/budget_bytes"], metrics
    assert not [w for w in caught if "above the budget" in str(w.message)]
    assert any("from one micro-batch into the next" in note for note in callback.plan.notes)


def test_without_a_budget_the_callback_warns_and_leaves_the_run_alone(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_BUDGET, raising=False)
    callback = RematTrainerCallback()
    model = _model()
    with pytest.warns(UserWarning, match="no budget given"):
        callback.on_train_begin(None, None, None, model=model)
    assert callback.plan is None and callback.session is None


def test_two_callbacks_with_different_budgets_are_refused_naming_both(tmp_path, monkeypatch):
    """Before: the second callback's budget was ignored silently (one session per model, the first's)."""
    monkeypatch.delenv(ENV_BUDGET, raising=False)
    with pytest.raises(ConflictingArgumentsError, match="budget='1GB' and budget='min'"):
        _train(tmp_path, RematTrainerCallback(budget="1GB"), RematTrainerCallback(budget="min"), steps=1)
    from lightning_remat import RematPlugin, prepare_remat
    from lightning_remat.integrations.accelerate import remat_session

    model = _model()
    prepare_remat(model, RematPlugin(budget="1GB"))
    prepare_remat(model, RematPlugin(budget="1GB"))  # the same settings again share the one session
    with pytest.raises(ConflictingArgumentsError, match="cost unset and cost='time'"):
        prepare_remat(model, RematPlugin(budget="1GB", cost="time"))
    remat_session(model).remove()


def test_the_trainer_s_own_gradient_checkpointing_is_taken_over(tmp_path, monkeypatch):
    """Issue 33: ``gradient_checkpointing=True`` was refused (AlreadyCheckpointedError), so TRL's default stopped
    every run. The Trainer switches it on in train(), before on_train_begin: the callback turns it off there
    (offload too), says so in one warning, and the plan keeps the budget with the plain run's losses."""
    import warnings

    monkeypatch.delenv(ENV_BUDGET, raising=False)
    _, plain, plain_losses = _train(tmp_path, steps=4)
    budget = plain.static + (max(plain.peaks) - plain.static) // 2
    callback = RematTrainerCallback(budget=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, planned, losses = _train(tmp_path, callback, steps=4, gradient_checkpointing=True,
                                          gradient_checkpointing_kwargs={"offload": True, "use_reentrant": False})
    said = [str(w.message) for w in caught if "turned off the model's own gradient checkpointing" in str(w.message)]
    assert len(said) == 1 and "offload=True" in said[0] and "3 of 3 layers" in said[0], said
    assert not trainer.model.is_activation_checkpointing and callback.plan.checkpointed
    assert max(planned.peaks) <= budget and losses == plain_losses


def test_a_torch_checkpoint_wrapper_is_refused_before_the_first_step(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _model()
    model.transformer.h[1] = checkpoint_wrapper(model.transformer.h[1])
    peaks = SteadyPeaks(first=0)
    with pytest.raises(AlreadyCheckpointedError, match="checkpoint_wrapper.*apply_activation_checkpointing"):
        _train(tmp_path, RematTrainerCallback(budget="1GB"), model=model, peaks=peaks)
    assert peaks.peaks == []


# ------------------------------------------------------------------------------ dynamic padding (issue 21)


def _padded_data(batches):
    """The sequences of ``batches`` (``padded_batches``) without their padding, in order, and a collator
    that pads each batch to its own longest sequence (ids 0, mask 0, labels -100), as the batches were."""
    rows = [{k: v[i, :int(b["attention_mask"][i].sum())] for k, v in b.items()}
            for b in batches for i in range(b["input_ids"].shape[0])]

    def collate(features):
        width = max(len(f["input_ids"]) for f in features)
        pad = {"input_ids": 0, "attention_mask": 0, "labels": -100}
        return {k: torch.stack([torch.nn.functional.pad(f[k], (0, width - len(f[k])), value=v) for f in features])
                for k, v in pad.items()}

    return rows, collate


def test_trainer_follows_the_batch_shape_under_dynamic_padding(tmp_path):
    """12 batches of 4 sequences padded to their longest (32..127 tokens), the longest (128) first at
    step 8, in order (``train_sampling_strategy="sequential"``); budget: static + 50% of the longest
    step's activations in the run without the callback. Every step's ``TorchPeak``, planning work in
    the model's hooks included, holds it: step 0 too, which the session observes without a plan (it
    runs as written; its shape fits without recomputation) and plans in its optimizer step."""
    from lightning_remat.models import padded_batches

    batches = padded_batches(steps=12, batch_size=4, longest_at=8)
    rows, collate = _padded_data(batches)

    def run(*callbacks):
        peaks = SteadyPeaks(first=0, grads=True)
        _, _, losses = _train(tmp_path, *callbacks, peaks=peaks, model=_model(128), data=rows,
                                    collator=collate, steps=len(batches), train_sampling_strategy="sequential")
        return peaks, losses

    plain, plain_losses = run()
    budget = plain.static + (plain.peaks[8] - plain.static) // 2
    callback = RematTrainerCallback(budget=budget, cost="flops")
    planned, losses = run(callback)

    shapes = [tuple(b["input_ids"].shape) for b in batches]
    table = list(zip(shapes, plain.peaks, planned.peaks))
    assert max(plain.peaks) == plain.peaks[8] > 1.5 * budget, (budget, table)  # it needs recomputation
    assert len(planned.peaks) == len(batches) and all(peak <= budget for peak in planned.peaks), (budget, table)
    counts = callback.session.shape_plans.counts
    # docs/shapes.md: at most one real profiling pass; the session's is none (the observed step calibrates
    # fake profiles). Fake: the first batch's shape, then ladder nodes (4 per doubling, 32..128).
    assert counts.real_profiles == 0 and counts.fake_profiles <= 1 + 2 * 4 * 2, counts
    # Steps: the observed call (step 0's, planned at its end) and every later training forward.
    assert counts.steps == len(batches) and len(callback.session.shape_plans.plans) > 3, counts
    assert callback.metrics["remat/measured_peak_bytes"] <= budget
    assert losses == plain_losses and len(losses) == len(batches)  # log_history's losses, not rounded
    for step, (expected, got) in enumerate(zip(plain.grads, planned.grads)):
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), step
