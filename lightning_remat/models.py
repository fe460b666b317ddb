"""Small real models with random weights and synthetic batches (nothing downloaded), each a ``ModelCase``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

MODEL_NAMES = ("gpt2", "bert", "vit", "resnet50", "llama", "mlp")
# CNNs whose blocks nest (planned whole or through their children: benchmarks/hierarchy.py), not in the main table.
CNN_NAMES = ("convnext", "tv_resnet")


@dataclass
class ModelCase:
    """A model, a training step on a fixed synthetic batch, and what it is."""

    name: str
    model: nn.Module
    step: Callable[[nn.Module], torch.Tensor]
    batch_size: int
    supports_hf_checkpointing: bool = False
    sequential: nn.Sequential | None = None  # the chain checkpoint_sequential can split


def _transformers() -> Any:
    """``transformers``, its warnings silenced (about weights initialised at random, as every model here is)."""
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _images(batch_size: int, image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, image_size, image_size, generator=g),
            torch.randint(0, 10, (batch_size,), generator=g))


def gpt2(batch_size: int = 4, seq_len: int = 128, layers: int = 6, hidden: int = 128, vocab: int = 1024) -> ModelCase:
    """A GPT-2 language model (``use_cache`` off, as for training) on random tokens."""
    transformers = _transformers()
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=4, vocab_size=vocab, n_positions=seq_len,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return ModelCase("gpt2", model, lambda m: m(input_ids=ids, labels=ids).loss, batch_size, True)


def bert(batch_size: int = 4, seq_len: int = 128, layers: int = 4, hidden: int = 128, vocab: int = 1024) -> ModelCase:
    """A BERT masked-language model on random tokens."""
    transformers = _transformers()
    config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4,
                                     intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=seq_len)
    model = transformers.BertForMaskedLM(config).train()
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return ModelCase("bert", model, lambda m: m(input_ids=ids, labels=ids).loss, batch_size, True)


def vit(batch_size: int = 4, image_size: int = 64, layers: int = 4, hidden: int = 128) -> ModelCase:
    """A ViT image classifier on random images."""
    transformers = _transformers()
    config = transformers.ViTConfig(image_size=image_size, patch_size=8, num_hidden_layers=layers, hidden_size=hidden,
                                    num_attention_heads=4, intermediate_size=4 * hidden, num_labels=10)
    model = transformers.ViTForImageClassification(config).train()
    images, labels = _images(batch_size, image_size)
    return ModelCase("vit", model, lambda m: m(pixel_values=images, labels=labels).loss, batch_size, True)


def resnet50(batch_size: int = 8, image_size: int = 96, width: int = 1) -> ModelCase:
    """ResNet-50 (depths 3-4-6-3, bottlenecks, BatchNorm) on random images; ``width`` divides the channel counts."""
    transformers = _transformers()
    config = transformers.ResNetConfig(depths=[3, 4, 6, 3], layer_type="bottleneck",
                                       embedding_size=64 // width,
                                       hidden_sizes=[256 // width, 512 // width, 1024 // width, 2048 // width],
                                       num_labels=10)
    model = transformers.ResNetForImageClassification(config).train()
    images, labels = _images(batch_size, image_size)
    # transformers' ResNet has no gradient checkpointing of its own.
    return ModelCase("resnet50", model, lambda m: m(pixel_values=images, labels=labels).loss, batch_size, False)


def convnext(batch_size: int = 8, image_size: int = 64, depths: tuple[int, ...] = (2, 2, 4, 2), width: int = 2) -> ModelCase:
    """A ConvNeXt image classifier on random images; ``width`` divides the channel counts (96-192-384-768 at 1)."""
    transformers = _transformers()
    config = transformers.ConvNextConfig(depths=list(depths), hidden_sizes=[96 // width * 2 ** i for i in range(len(depths))],
                                         num_labels=10, image_size=image_size)
    model = transformers.ConvNextForImageClassification(config).train()
    images, labels = _images(batch_size, image_size)
    return ModelCase("convnext", model, lambda m: m(pixel_values=images, labels=labels).loss, batch_size, False)


class Bottleneck(nn.Module):
    """torchvision's bottleneck block, written out here: torchvision is not a dependency."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torchvision's order and its in-place residual add.
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class TorchvisionResNet(nn.Module):
    """torchvision's ResNet layout: a loose stem, ``layer1``..``layer4`` Sequentials of ``Bottleneck``, ``fc``."""

    def __init__(self, depths: tuple[int, ...] = (3, 4, 6, 3), width: int = 1, num_classes: int = 10):
        super().__init__()
        self.inplanes = 64 // width
        self.conv1 = nn.Conv2d(3, self.inplanes, 7, 2, 3, bias=False)
        self.bn1, self.relu = nn.BatchNorm2d(self.inplanes), nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        for i, depth in enumerate(depths):
            setattr(self, f"layer{i + 1}", self._layer(64 // width * 2 ** i, depth, 1 if i == 0 else 2))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(self.inplanes, num_classes)

    def _layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride, bias=False),
                                       nn.BatchNorm2d(planes * Bottleneck.expansion))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        return nn.Sequential(*layers, *(Bottleneck(self.inplanes, planes) for _ in range(1, blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def tv_resnet(batch_size: int = 8, image_size: int = 96, depths: tuple[int, ...] = (3, 4, 6, 3), width: int = 1) -> ModelCase:
    """A bottleneck ResNet in torchvision's layout (``TorchvisionResNet``: the loose stem) on random images."""
    model = TorchvisionResNet(depths, width).train()
    images, labels = _images(batch_size, image_size)
    return ModelCase("tv_resnet", model, lambda m: nn.functional.cross_entropy(m(images), labels), batch_size, False)


def llama(batch_size: int = 4, seq_len: int = 128, layers: int = 4, hidden: int = 128, vocab: int = 1024) -> ModelCase:
    """A small Llama causal language model (``use_cache`` off) on random tokens."""
    transformers = _transformers()
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=344,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      max_position_embeddings=seq_len, use_cache=False)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return ModelCase("llama", model, lambda m: m(input_ids=ids, labels=ids).loss, batch_size, True)


def mlp(batch_size: int = 512, depth: int = 24, width: int = 128) -> ModelCase:
    """A deep plain MLP chain: an ``nn.Sequential`` of Linear-GELU-Linear-LayerNorm blocks, no residuals."""
    g = torch.Generator().manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.LayerNorm(width))
              for _ in range(depth)]
    model = nn.Sequential(*blocks).train()
    x = torch.randn(batch_size, width, generator=g)
    target = torch.randn(batch_size, width, generator=g)
    return ModelCase("mlp", model, lambda m: nn.functional.mse_loss(m(x), target), batch_size, False, model)


_FACTORIES = {"gpt2": gpt2, "bert": bert, "vit": vit, "resnet50": resnet50, "llama": llama, "mlp": mlp,
              "convnext": convnext, "tv_resnet": tv_resnet}


def build(name: str, seed: int = 0, **kwargs) -> ModelCase:
    """Build one of ``MODEL_NAMES`` or ``CNN_NAMES`` with random weights drawn from ``seed``.

    >>> build("mlp", depth=2).name
    'mlp'
    """
    if name not in _FACTORIES:
        raise ValueError(f"unknown model {name!r}; choose from {MODEL_NAMES + CNN_NAMES}")
    torch.manual_seed(seed)
    return _FACTORIES[name](**kwargs)


def padded_batches(steps: int = 12, batch_size: int = 4, min_len: int = 32, max_len: int = 128,
                   longest_at: int | None = 8, vocab: int = 128, pad_id: int = 0, seed: int = 0) -> list[dict]:
    """Random token batches padded to each batch's longest sequence (as ``DataCollatorWithPadding``), drawn from
    ``[min_len, max_len)`` except at step ``longest_at``, where it has ``max_len`` tokens.

    >>> batches = padded_batches(steps=3, longest_at=2)
    >>> [b["input_ids"].shape[1] < 128 for b in batches], int(batches[0]["attention_mask"].sum()) < 4 * 128
    ([True, True, False], True)
    """
    g = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        width = max_len if step == longest_at else int(torch.randint(min_len, max_len, (1,), generator=g))
        lengths = torch.randint(min_len, width + 1, (batch_size,), generator=g)
        lengths[0] = width
        ids = torch.randint(1, vocab, (batch_size, width), generator=g)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, pad_id)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return batches
