"""One training run through Lightning's loop (``AutoRemat``) or the Hugging Face Trainer's
(``RematTrainerCallback``), with the package (a byte budget) or without it (None).

A recorded step is an optimizer step: with gradient accumulation (``variant="accumulate"``: 2
micro-batches; an odd last batch is dropped in both runs), its window holds both micro-batches and
its loss is their sum. Windows (``loops`` says why there):

- Lightning: a callback first among the Trainer's callbacks: ``on_train_batch_start`` of the
  window's first micro-batch (before ``AutoRemat``'s, where planning runs) to ``on_train_batch_end``
  of its last (after the optimizer step); it then drops the gradients (``zero_grad(set_to_none=True)``,
  in both runs: the profiler cannot see the frees of what was allocated before a window opens).
  ``variant="manual"``: manual optimization with two optimizers (the parameters in two halves).
- Hugging Face: a ``TrainerCallback`` first among the callbacks, ``on_step_begin`` to ``on_step_end``
  (the Trainer zeroes the gradients before ``on_step_end``); the losses are ``training_step``'s.
  ``variant="lora"``: PEFT LoRA adapters on the attention projections (``ModelSpec.lora``).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from .loops import LR, quiet
from .recorder import Recorder, RunRecord
from .zoo import ModelSpec

ACCUMULATION = 2


def _windows(batches: list, variant: str) -> tuple[list, int]:
    steps = ACCUMULATION if variant == "accumulate" else 1
    return batches[: len(batches) // steps * steps], steps


def _lightning_module(spec: ModelSpec, seed: int, manual: bool) -> Any:
    """A ``LightningModule`` holding ``spec``'s model at ``model`` (Adam; ``manual``: manual
    optimization with two Adams over the two halves of the parameters)."""
    import lightning.pytorch as L

    class Zoo(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = spec.build(seed)
            self.automatic_optimization = not manual

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.automatic_optimization:
                return spec.loss(self.model, batch)
            optimizers = self.optimizers()
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            loss = spec.loss(self.model, batch)
            self.manual_backward(loss)
            for optimizer in optimizers:
                optimizer.step()
            return loss.detach()

        def configure_optimizers(self) -> Any:
            parameters = list(self.parameters())
            if not manual:
                return torch.optim.Adam(parameters, lr=LR)
            half = len(parameters) // 2
            return [torch.optim.Adam(parameters[:half], lr=LR), torch.optim.Adam(parameters[half:], lr=LR)]

    return Zoo()


@quiet
def run_lightning(spec: ModelSpec, batches: list, budget: int | None, seed: int, variant: str = "") -> RunRecord:
    """A ``LightningModule`` holding the model at ``model``; ``AutoRemat(budget, cost="flops")``."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from lightning_remat import AutoRemat

    batches, steps = _windows(batches, variant)
    manual = variant == "manual"
    module = _lightning_module(spec, seed, manual)
    callback = None if budget is None else AutoRemat(budget=budget, cost="flops", verbose=False,
                                                     candidates=spec.candidates_under("model."))
    rec = Recorder(module, module.model, None if callback is None else (lambda: callback.plan))
    window_loss = []

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx % steps == 0:
                window_loss.clear()
                rec.begin(pl_module, trainer.optimizers)

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            rec.enter_backward()

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            rec.exit_backward()  # and compares what ran again with the plan

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            window_loss.append(float(outputs["loss"]))
            if (batch_idx + 1) % steps == 0:
                rec.check("after the step")
                rec.end(sum(window_loss))
                pl_module.zero_grad(set_to_none=True)

    # One epoch over exactly the batches (max_steps would count each of the manual optimizers' steps).
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        accumulate_grad_batches=1 if manual else steps,
                        callbacks=[Probe(), *([callback] if callback else [])], enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    torch.manual_seed(seed + 1)
    try:
        trainer.fit(module, DataLoader(batches, batch_size=None))
    except Exception as error:  # noqa: BLE001 - recorded
        return rec.finish(error)
    return rec.finish()


def hf_model(spec: ModelSpec, seed: int, variant: str) -> torch.nn.Module:
    """The model the Hugging Face Trainer trains: ``spec``'s, with LoRA adapters (the only trainable
    parameters) for ``variant="lora"``."""
    model = spec.build(seed)
    if variant != "lora":
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(spec.lora)))


@quiet
def run_hf_trainer(spec: ModelSpec, batches: list, budget: int | None, seed: int, variant: str = "") -> RunRecord:
    """The Hugging Face ``Trainer`` (its own AdamW, seed, gradient clipping) with ``RematTrainerCallback``;
    a collator that hands out the drawn batches in order (one index per micro-batch)."""
    import transformers

    from lightning_remat import RematTrainerCallback

    transformers.logging.set_verbosity_error()
    batches, steps = _windows(batches, variant)
    model = hf_model(spec, seed, variant)
    callback = None if budget is None else RematTrainerCallback(budget=budget, cost="flops")
    rec = Recorder(model, model, None if callback is None else (lambda: callback.plan))
    losses: list[float] = []

    class Recording(transformers.Trainer):
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            losses.append(float(loss))
            return loss

    class Probe(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                          **kwargs: Any) -> None:
            losses.clear()
            rec.begin(model, optimizer)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rec.check("after the step")
            rec.end(sum(losses))

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=steps,
            max_steps=len(batches) // steps, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0, seed=seed, learning_rate=LR, remove_unused_columns=False,
            train_sampling_strategy="sequential")
        trainer = Recording(model=model, args=args, train_dataset=list(range(len(batches))),
                            data_collator=lambda features: batches[features[0]],
                            callbacks=[Probe(), *([callback] if callback else [])])
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # the log dicts on stdout
        backward = trainer.accelerator.backward

        def recorded_backward(loss: Any, **kwargs: Any) -> Any:
            with rec.backward():
                return backward(loss, **kwargs)

        trainer.accelerator.backward = recorded_backward
        try:
            trainer.train()
        except Exception as error:  # noqa: BLE001 - recorded
            return rec.finish(error)
    return rec.finish()
