"""TRL's ``SFTTrainer`` with ``RematTrainerCallback``: a LoRA fine-tune with TRL's defaults, on the CPU.

    pip install "lightning-remat[test]"     # trl, peft and datasets
    python examples/trl_sft.py

``SFTConfig`` switches the model's own gradient checkpointing on by default (every layer recomputed). The
callback turns it off at the start of training, says so in one warning, and recomputes only what the
budget needs. The model is a small random-weight Llama built from its config and the tokenizer a
word-level one built here, so nothing is downloaded; the whole run takes well under a minute.
"""

from __future__ import annotations

import torch
import transformers
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from trl import SFTConfig, SFTTrainer

from lightning_remat import RematTrainerCallback, format_bytes

VOCAB, LENGTH = 512, 128


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    inner = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>")


def main() -> dict:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=LENGTH, pad_token_id=0, eos_token_id=1)
    model = transformers.LlamaForCausalLM(config)
    rows = Dataset.from_list([{"input_ids": torch.randint(2, VOCAB, (LENGTH,)).tolist()} for _ in range(8)])
    # "min": the least peak any plan reaches. A real run gives its GPU's figure: budget="20GB" or "90%".
    callback = RematTrainerCallback(budget="min")
    args = SFTConfig(output_dir="trl_sft_output", per_device_train_batch_size=2, max_steps=4, max_length=LENGTH,
                     use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer(),
                         peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"]), callbacks=[callback])
    trainer.train()
    metrics = callback.session.metrics
    baseline, planned = metrics["remat/baseline_peak_bytes"], metrics["remat/predicted_peak_bytes"]
    measured = metrics.get("remat/measured_peak_bytes")
    print(f"recomputed {len(callback.plan.checkpointed)} of {config.num_hidden_layers} layers; step peak "
          f"{format_bytes(planned)} planned" + (f" ({format_bytes(measured)} measured)" if measured else "")
          + f", {format_bytes(baseline)} without recomputation: {format_bytes(baseline - planned)} saved "
          f"({1 - planned / baseline:.0%})")
    return metrics


if __name__ == "__main__":
    main()
