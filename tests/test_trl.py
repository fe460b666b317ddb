"""TRL's ``SFTTrainer`` with ``RematTrainerCallback`` (issue 33): a tiny Llama (random weights, a word-level
tokenizer built here, nothing downloaded), full fine-tune and LoRA, padded and padding-free batches, with
``SFTConfig``'s defaults, which switch the model's own gradient checkpointing on. The callback takes it
over (turns it off and says so in exactly one warning), every optimizer step's peak, measured from
``torch.profiler``'s allocator events (``tests/torch_meter.py``, the first step included), is within the
budget, and the losses equal those of the same run with neither the callback nor Hugging Face's
checkpointing. The other trainers on the ``Trainer`` below: DPO, KTO, Reward, GRPO and RLOO (generation inside the
step), GKD; the DistillationTrainer's refusal."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_remat import RematTrainerCallback
from lightning_remat.core.errors import UnsupportedSetupError
from lightning_remat.accelerate import ENV_BUDGET

from tests.tiny_hf import TrainerStepPeaks

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

VOCAB = 128


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread for tiny models
TAKE_OVER = "turned off the model's own gradient checkpointing"


def tokenizer():
    """A word-level tokenizer of ``VOCAB`` words ("<pad>", "<eos>", "w0".."w125"), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    inner = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>")


def tiny_llama(lora: bool = False, seed: int = 0):
    """A 2-layer Llama of hidden 64 in training mode, or it under a LoRA adapter on q/v (rank 4)."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    model = transformers.LlamaForCausalLM(config)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                          target_modules=["q_proj", "v_proj"]))
    return model


def token_rows(n: int = 8, seed: int = 1, length: int = 32):
    """``n`` pre-tokenized sequences of ``length`` tokens (a ``datasets.Dataset``). One length: every batch
    has one shape, planned once (each new shape is planned on fake tensors: seconds with TRL's fused head)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [length] * n
    return datasets.Dataset.from_list([{"input_ids": torch.randint(2, VOCAB, (k,), generator=generator).tolist()}
                                       for k in lengths])




def sft_run(tmp_path, *callbacks, lora: bool = False, steps: int = 2, **config):
    """(peaks, losses, the model, the take-over warnings) of an ``SFTTrainer`` run with ``SFTConfig``'s
    defaults (gradient checkpointing on) but for ``config``."""
    peaks = TrainerStepPeaks()
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=steps, report_to=[],
                         use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", disable_tqdm=True,
                         dataloader_num_workers=0, seed=0, dataset_num_proc=None, **{"max_length": 64, **config})
    model = tiny_llama(lora)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=token_rows(), processing_class=tokenizer(),
                                 callbacks=[peaks, *callbacks])
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    said = [str(w.message) for w in caught if TAKE_OVER in str(w.message)]
    return peaks, losses, model, said


SETUPS = {"full-padded": dict(lora=False), "lora-padded": dict(lora=True),
          # TRL enforces no max_length without packing (the rows are shorter than 64)
          "full-padding-free": dict(lora=False, padding_free=True, max_length=None),
          "lora-packed": dict(lora=True, packing=True)}


@pytest.mark.parametrize("setup", SETUPS)
def test_sft_trainer_defaults_with_the_callback_take_over_and_hold_the_budget(tmp_path, monkeypatch, setup):
    monkeypatch.delenv(ENV_BUDGET, raising=False)
    assert trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True).gradient_checkpointing  # TRL default: as users run
    plain, plain_losses, _, _ = sft_run(tmp_path, gradient_checkpointing=False, **SETUPS[setup])
    # TRL's fused head allocates a (tokens x 32768) float32 tile whatever the vocabulary: most of the peak
    # here, and no recomputation lowers it. The budget: 2% below the plain peak, which the layers' stored
    # activations (about 6% of it) can make up.
    budget = int(max(plain.peaks) * 0.98)
    callback = RematTrainerCallback(budget=budget)
    planned, losses, model, said = sft_run(tmp_path, callback, **SETUPS[setup])
    assert len(said) == 1 and "RematTrainerCallback" in said[0], said
    assert not model.is_activation_checkpointing
    assert callback.plan is not None and callback.plan.checkpointed
    assert max(planned.peaks) <= budget, (budget, planned.peaks, plain.peaks)
    # The package's own meter reports the steady step too (TRL's head reads the hidden states, not the logits:
    # the measured step used to wait for a gradient of the first output, which never came).
    assert 0 < callback.metrics["remat/measured_peak_bytes"] <= budget
    assert losses == plain_losses


def preference_rows(kind: str, n: int = 8, length: int = 16):
    """``n`` rows of words of the tokenizer (a ``datasets.Dataset``): prompt / chosen / rejected for DPO, prompt /
    completion / label for KTO."""
    generator = torch.Generator().manual_seed(1)

    def words(k):
        return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 2, (k,), generator=generator))

    if kind == "dpo":
        return datasets.Dataset.from_list([{"prompt": words(length), "chosen": words(8), "rejected": words(8)}
                                           for _ in range(n)])
    return datasets.Dataset.from_list([{"prompt": words(length), "completion": words(8), "label": bool(i % 2)}
                                       for i in range(n)])


PREFERENCE = {"dpo": ("DPOConfig", "DPOTrainer", 2), "kto": ("KTOConfig", "KTOTrainer", 4)}  # 4 rows a step each


def preference_run(tmp_path, kind, *callbacks, **config):
    """(peaks, losses, the model) of a LoRA ``DPOTrainer`` or ``KTOTrainer`` run: its config's defaults (gradient
    checkpointing on) but for ``config``; the reference is the adapter-free base model, as TRL does for PEFT."""
    config_class, trainer_class, batch = PREFERENCE[kind]
    peaks = TrainerStepPeaks()
    args = getattr(trl, config_class)(output_dir=str(tmp_path), per_device_train_batch_size=batch, max_steps=3,
                                      report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no",
                                      disable_tqdm=True, dataloader_num_workers=0, seed=0, max_length=64, **config)
    model = tiny_llama(lora=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = getattr(trl, trainer_class)(model=model, args=args, train_dataset=preference_rows(kind),
                                              processing_class=tokenizer(), callbacks=[peaks, *callbacks])
        trainer.train()
    return peaks, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], model


@pytest.mark.parametrize("kind", PREFERENCE)
def test_preference_trainers_defaults_with_the_callback_hold_the_budget_with_the_plain_losses(tmp_path, monkeypatch,
                                                                                               kind):
    """Other TRL trainers on the ``Trainer``: DPO and KTO run the policy and a no-gradient reference forward in
    each step; the reference forward is not a training call, the policy's is."""
    monkeypatch.delenv(ENV_BUDGET, raising=False)
    assert getattr(trl, PREFERENCE[kind][0])(output_dir=str(tmp_path), use_cpu=True).gradient_checkpointing  # default
    plain, plain_losses, _ = preference_run(tmp_path, kind, gradient_checkpointing=False)
    budget = int(max(plain.peaks) * 0.97)
    callback = RematTrainerCallback(budget=budget)
    planned, losses, model = preference_run(tmp_path, kind, callback)
    assert not model.is_activation_checkpointing and callback.plan.checkpointed
    assert max(planned.peaks) <= budget < max(plain.peaks), (budget, planned.peaks, plain.peaks)
    assert 0 < callback.metrics["remat/measured_peak_bytes"] <= budget
    assert losses == plain_losses


def prompt_rows(n: int = 8, length: int = 8):
    """``n`` prompts of ``length`` words of the tokenizer (a ``datasets.Dataset``), for the trainers that generate."""
    generator = torch.Generator().manual_seed(1)
    return datasets.Dataset.from_list([{"prompt": " ".join(f"w{int(i)}" for i in torch.randint(
        0, VOCAB - 2, (length,), generator=generator))} for _ in range(n)])


def length_reward(completions, **kwargs):
    """A reward function: a completion's length in characters."""
    return [float(len(completion)) for completion in completions]


# Trainers that generate completions inside the training step (model.generate, no vLLM): GRPO and RLOO score them
# with a reward function, the distillation trainer with a teacher. A full RLOO run would build its reference from
# the model's hub name (none here): LoRA's reference is the adapter-free base, in the step, without gradients.
GENERATING = {"grpo-full": ("GRPO", False), "grpo-lora": ("GRPO", True), "rloo-lora": ("RLOO", True)}
KINDS = {**GENERATING, "distillation-full": ("Distillation", False)}


def generating_run(tmp_path, setup, *callbacks, peaks=None, **config):
    """(peaks, losses, the model, the trainer) of a run of ``GENERATING[setup]`` with its config's defaults
    (gradient checkpointing on) but for ``config``: 4 completions of at most 8 tokens of 1 prompt a step, 3 steps."""
    kind, lora = KINDS[setup]
    peaks = peaks or TrainerStepPeaks()
    args = getattr(trl, f"{kind}Config")(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_completion_length=8, max_steps=3, report_to=[],
        use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        seed=0, **({} if kind == "Distillation" else {"num_generations": 4}), **config)
    model = tiny_llama(lora)
    scorer = {"teacher_model": tiny_llama()} if kind == "Distillation" else {"reward_funcs": length_reward}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = getattr(trl, f"{kind}Trainer")(model=model, args=args, train_dataset=prompt_rows(),
                                                 processing_class=tokenizer(), callbacks=[peaks, *callbacks], **scorer)
        trainer.train()
    return peaks, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], model, trainer


@pytest.mark.parametrize("setup", GENERATING)
def test_trainers_that_generate_in_the_step_hold_the_budget_on_every_step_with_the_plain_losses(tmp_path, monkeypatch,
                                                                                                capsys, setup):
    """``generate``'s forwards run without gradients (not training calls: not planned, not observed); the sampled
    lengths change the batch's sequence and its padding. The first batch here has none (every completion runs to
    the limit), for which Hugging Face builds no attention mask; a later padded one of the same sizes needs more
    (its plan made from an unpadded one peaked 18 KB over the budget): it is planned again before its forward."""
    monkeypatch.delenv(ENV_BUDGET, raising=False)
    kind = GENERATING[setup][0]
    assert getattr(trl, f"{kind}Config")(output_dir=str(tmp_path), use_cpu=True).gradient_checkpointing  # default
    plain, plain_losses, _, _ = generating_run(tmp_path, setup, gradient_checkpointing=False)
    budget = int(max(plain.peaks) * 0.97)
    callback = RematTrainerCallback(budget=budget)
    capsys.readouterr()
    seen = LogsSeen()
    planned, losses, model, trainer = generating_run(tmp_path, setup, callback, seen)
    console = capsys.readouterr().out
    assert not getattr(model, "is_gradient_checkpointing", False) and callback.plan.checkpointed
    assert len(planned.peaks) == 3 and max(planned.peaks) <= budget < max(plain.peaks), (budget, planned.peaks,
                                                                                         plain.peaks)
    assert 0 < callback.metrics["remat/measured_peak_bytes"] <= budget
    assert losses == plain_losses
    # What a user sees: the plan and the measured line on the console, the figures in the Trainer's own logs
    # (what its report_to trackers get, with the step's loss: tests/test_trackers.py reads them back).
    assert "Recompute plan:" in console and "measured peak of a steady training step" in console, console
    if kind == "GRPO":
        assert "(the first with padding: every shape planned again)" in console, console
    logged = [logs for logs in seen.logs if "loss" in logs and "remat/budget_bytes" in logs]
    assert logged and logged[0]["remat/budget_bytes"] == budget
    assert any(logs.get("remat/measured_peak_bytes") == callback.metrics["remat/measured_peak_bytes"]
               for logs in seen.logs if "loss" in logs)


class LogsSeen(transformers.TrainerCallback):
    """Every log of the Trainer as its callbacks get them (``report_to``'s reporters among them)."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def reward_run(tmp_path, lora, *callbacks, **config):
    """(peaks, losses, the model) of a ``RewardTrainer`` run (a 2-layer Llama with a one-logit score head; LoRA on
    q/v, the head trained whole) on chosen / rejected pairs, with ``RewardConfig``'s defaults but for ``config``."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config_ = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, num_labels=1,
                                       max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    model = transformers.LlamaForSequenceClassification(config_)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0,
                                                          target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(1)

    def words(k):
        return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 2, (k,), generator=generator))

    rows = datasets.Dataset.from_list([{"chosen": words(24), "rejected": words(16 + i)} for i in range(8)])
    peaks = TrainerStepPeaks()
    args = trl.RewardConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, report_to=[],
                            use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", disable_tqdm=True,
                            dataloader_num_workers=0, seed=0, max_length=64, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.RewardTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer(),
                                    callbacks=[peaks, *callbacks])
        trainer.train()
    return peaks, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], model


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_reward_trainer_with_the_callback_holds_the_budget_with_the_plain_losses(tmp_path, monkeypatch, lora):
    """``RewardTrainer``: chosen and rejected in one forward of a sequence classifier (no LM head), padded."""
    monkeypatch.delenv(ENV_BUDGET, raising=False)
    assert trl.RewardConfig(output_dir=str(tmp_path), use_cpu=True).gradient_checkpointing  # TRL's default
    plain, plain_losses, _ = reward_run(tmp_path, lora, gradient_checkpointing=False)
    budget = int(max(plain.peaks) * 0.97)
    callback = RematTrainerCallback(budget=budget)
    planned, losses, model = reward_run(tmp_path, lora, callback)
    assert callback.plan.checkpointed
    assert max(planned.peaks) <= budget < max(plain.peaks), (budget, planned.peaks, plain.peaks)
    assert 0 < callback.metrics["remat/measured_peak_bytes"] <= budget
    assert losses == plain_losses


def test_the_distillation_trainer_is_refused_before_its_first_step_naming_the_forward_redirection(tmp_path,
                                                                                                 monkeypatch):
    """TRL's ``DistillationTrainer`` computes its loss inside the student's call (``_ForwardRedirection``: the
    model's ``forward`` swapped for the loss function, the model an argument), a call the session cannot replay:
    refused at that first training forward, before any backward or optimizer step, naming why and what works."""
    monkeypatch.delenv(ENV_BUDGET, raising=False)
    peaks = TrainerStepPeaks()
    with pytest.raises(UnsupportedSetupError, match="_ForwardRedirection.*DistillationTrainer.*apply_plan"):
        generating_run(tmp_path, "distillation-full", RematTrainerCallback(budget="min"), peaks=peaks)
    assert peaks.meter is not None and peaks.peaks == []  # the first step began and never ended


def test_gkd_trainer_with_the_callback_holds_the_budget_with_the_plain_losses(tmp_path, monkeypatch):
    """TRL's experimental ``GKDTrainer`` (an ``SFTTrainer``: TRL's fused head added, its plain forward called, the
    loss a JSD against a no-gradient teacher outside the model; completions generated on-policy in some steps).
    Its plain call runs the forward TRL's head wraps, kept in a closure: the fake twin used to run it on the real
    module (``StepError``: no candidate ran); it is now bound to the twin (``rebound_closure``)."""
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    monkeypatch.delenv(ENV_BUDGET, raising=False)
    generator = torch.Generator().manual_seed(1)

    def words(k):
        return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 2, (k,), generator=generator))

    rows = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": words(8)},
                                                     {"role": "assistant", "content": words(8)}]} for _ in range(8)])

    def run(*callbacks, **config):
        peaks, chat = TrainerStepPeaks(), tokenizer()
        chat.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        args = GKDConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, report_to=[],
                         use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", disable_tqdm=True,
                         dataloader_num_workers=0, seed=0, max_new_tokens=8, max_length=64, **config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = GKDTrainer(model=tiny_llama(), teacher_model=tiny_llama(seed=1), args=args, train_dataset=rows,
                                 processing_class=chat, callbacks=[peaks, *callbacks])
            trainer.train()
        return peaks, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    assert GKDConfig(output_dir=str(tmp_path), use_cpu=True).gradient_checkpointing  # TRL's default
    plain, plain_losses = run(gradient_checkpointing=False)
    budget = int(max(plain.peaks) * 0.97)
    callback = RematTrainerCallback(budget=budget)
    planned, losses = run(callback)
    assert callback.plan.checkpointed
    assert max(planned.peaks) <= budget < max(plain.peaks), (budget, planned.peaks, plain.peaks)
    assert 0 < callback.metrics["remat/measured_peak_bytes"] <= budget
    assert losses == plain_losses and all(loss > 0 for loss in losses)
