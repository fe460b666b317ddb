"""A shallow ResNet (transformers' ResNet-50 layout, fewer bottlenecks), tiny Qwen2 and Qwen2-MoE causal language models (transformers configs, random weights, nothing
downloaded) and a step on random tokens, for the tests of models the package's own ``models``
does not build."""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip("transformers")


def qwen2(moe: bool = False, layers: int = 2, hidden: int = 64, seq_len: int = 512, batch_size: int = 2,
          vocab: int = 2048, seed: int = 0):
    """(model in training mode, ``step(model) -> loss``): a Qwen2 (or, with ``moe``, a Qwen2-MoE of 4
    experts, 2 per token, and a shared expert), ``use_cache`` off as for training."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    common = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=vocab, max_position_embeddings=seq_len, use_cache=False)
    if moe:
        config = transformers.Qwen2MoeConfig(intermediate_size=4 * hidden, moe_intermediate_size=hidden,
                                             shared_expert_intermediate_size=2 * hidden, num_experts=4,
                                             num_experts_per_tok=2, **common)
        model = transformers.Qwen2MoeForCausalLM(config)
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(intermediate_size=4 * hidden, **common))
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))
    return model.train(), (lambda m: m(input_ids=ids, labels=ids).loss)


class TrainerStepPeaks(transformers.TrainerCallback):
    """``TorchPeak`` of every optimizer step of a Hugging Face ``Trainer`` (first among the callbacks: its window
    opens before the package's work in the model's hooks and holds it), and the static bytes at the first."""

    def __init__(self):
        self.peaks, self.static, self.meter = [], None, None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from tests.torch_meter import TorchPeak, static_bytes

        self.static = self.static or static_bytes(model, optimizer)
        self.meter = TorchPeak(model, optimizer).start()

    def on_step_end(self, args, state, control, **kwargs):
        self.peaks.append(self.meter.stop())


def shallow_resnet(depths=(2,), batch_size: int = 2, image_size: int = 32, width: int = 16):
    """A ``ModelCase``: transformers' ResNet as ``models.build("resnet50")`` makes it (bottlenecks, BatchNorm, the
    stem ``resnet.embedder``), with ``depths`` bottlenecks a stage instead of ResNet-50's 3-4-6-3, for tests that
    need its layout or BatchNorm but not its 16 blocks (profiled whole: 14-79 s on a loaded 2-core machine)."""
    from lightning_remat.models import ModelCase

    transformers.logging.set_verbosity_error()
    config = transformers.ResNetConfig(depths=list(depths), layer_type="bottleneck", embedding_size=64 // width,
                                       hidden_sizes=[256 // width * 2**i for i in range(len(depths))], num_labels=10)
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(config).train()
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=g)
    labels = torch.randint(0, 10, (batch_size,), generator=g)
    return ModelCase("resnet", model, lambda m: m(pixel_values=images, labels=labels).loss, batch_size, False)
