"""The harness's model zoo: five tiny models, each where a feature of the package meets one of the data's.

Each ``ModelSpec`` builds its model from a seed (hidden 16-64, 2-4 blocks, CPU-fast), makes a batch
at a drawn shape (a tuple whose meaning is the model's own: ``describe`` prints it) and computes the
loss of a forward pass on any module given to it (the package profiles fake copies of the model).

- ``token``: a tiny causal transformer (2 attention blocks, hidden 32, attention dropout: SDPA's math
  path on the CPU) called as a Hugging Face model (``input_ids``, ``attention_mask``, ``labels`` ->
  a dict with ``loss``), on dict batches under dynamic padding; shape ``(batch, sequence)``.
- ``gpt2``: the same batches on a transformers GPT-2 (2 layers, hidden 32; random weights). About
  5x slower to profile on fake tensors than ``token``: the long run's, not the CI's.
- ``cnn``: a conv stem and three residual blocks with BatchNorm on ``(images, labels)``; the loss
  is computed outside the model. Shape ``(batch, height, width)``: channels fixed, the image grows.
- ``trunk``: one shared trunk run on two views of the tokens (as contrastive and siamese training
  do) under two heads; the model returns its loss. Shape ``(batch, sequence)``.
- ``dict``: dict batches whose keys vary: an optional ``extra`` float prefix (image features
  prepended to the sequence) and an optional ``mask``. Shape ``(batch, sequence, prefix, mask)``,
  ``prefix`` 0 without the key.
- ``moduledict``: blocks in an ``nn.ModuleDict`` that the model runs by name, planned with
  ``candidates=`` (a name pattern); the loss outside the model. Shape ``(batch, sequence)``.

Example:
    >>> spec = ZOO["cnn"]
    >>> model = spec.build(0)
    >>> images, labels = spec.batch((2, 8, 12), seed=0, step=0)
    >>> tuple(images.shape), float(spec.loss(model, (images, labels))) > 0
    ((2, 3, 8, 12), True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 64


class MLPBlock(nn.Module):
    """A pre-norm residual MLP block (a transformer block without attention)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class AttentionBlock(nn.Module):
    """A pre-norm causal self-attention block and an MLP (attention dropout: SDPA's math path on the CPU)."""

    def __init__(self, hidden: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.mlp = MLPBlock(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        return self.mlp(x + self.out(attended.transpose(1, 2).reshape(b, s, h)))


class TinyGPT(nn.Module):
    """A causal language model called as a Hugging Face one: ``model(input_ids=, attention_mask=,
    labels=)`` returns a dict with ``loss`` (labels -100 ignored) and ``logits``."""

    def __init__(self, hidden: int = 32, depth: int = 2, positions: int = 64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.position = nn.Embedding(positions, hidden)
        self.layers = nn.ModuleList([AttentionBlock(hidden) for _ in range(depth)])
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids) + self.position(torch.arange(input_ids.shape[1], device=input_ids.device))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return out


class ResBlock(nn.Module):
    """conv-BN-ReLU-conv-BN with an identity skip (BatchNorm: a recompute must not update it twice)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 16, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.Sequential(*[ResBlock(channels) for _ in range(3)])
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(images)).mean((2, 3)))


class TwoViews(nn.Module):
    """A trunk called twice per step: the tokens and their reverse, a language-model head on the
    first view and a regression head on the second; returns the summed loss."""

    def __init__(self, hidden: int = 32, depth: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.trunk = nn.Sequential(*[MLPBlock(hidden) for _ in range(depth)])
        self.lm_head = nn.Linear(hidden, VOCAB)
        self.aux_head = nn.Linear(hidden, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        first = self.trunk(self.embed(ids))
        second = self.trunk(self.embed(ids.flip(1)))
        lm = F.cross_entropy(self.lm_head(first[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        return lm + self.aux_head(second).square().mean()


class DictModel(nn.Module):
    """Reads a dict batch: ``ids`` and ``targets`` always; ``extra`` (float features, prepended to
    the sequence as a prefix) and ``mask`` (zeroes padded positions) when present. Returns the loss."""

    def __init__(self, hidden: int = 32, features: int = 16, depth: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.project = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList([MLPBlock(hidden) for _ in range(depth)])
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.embed(batch["ids"])
        if "mask" in batch:
            h = h * batch["mask"].unsqueeze(-1).to(h.dtype)
        prefix = 0
        if "extra" in batch:
            prefix = batch["extra"].shape[1]
            h = torch.cat([self.project(batch["extra"]), h], dim=1)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h[:, prefix:])
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


class Routed(nn.Module):
    """Blocks in an ``nn.ModuleDict``, run in the order ``ORDER`` names them (not found by the
    automatic candidate search: planned with ``candidates=``)."""

    ORDER = ("enc0", "enc1", "mid", "dec0")

    def __init__(self, hidden: int = 48):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleDict({name: MLPBlock(hidden) for name in self.ORDER})
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for name in self.ORDER:
            h = self.blocks[name](h)
        return self.head(h)


def _gpt2() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * seed + 7919 * step + 17)


def _padded_ids(batch_size: int, length: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded to ``length`` (the first row full length, as a dynamic-padding collator
    pads to the longest), and the attention mask."""
    ids = torch.randint(1, VOCAB, (batch_size, length), generator=g)
    lengths = torch.randint(max(1, length // 2), length + 1, (batch_size,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def _token_batch(shape: tuple, g: torch.Generator) -> dict[str, torch.Tensor]:
    ids, mask = _padded_ids(shape[0], shape[1], g)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _image_batch(shape: tuple, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    batch_size, height, width = shape
    return torch.randn(batch_size, 3, height, width, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def _ids_batch(shape: tuple, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (shape[0], shape[1]), generator=g)


def _dict_batch(shape: tuple, g: torch.Generator) -> dict[str, torch.Tensor]:
    batch_size, length, prefix, masked = shape
    ids, mask = _padded_ids(batch_size, length, g)
    batch = {"ids": ids, "targets": torch.randint(0, VOCAB, (batch_size, length), generator=g)}
    if prefix:
        batch["extra"] = torch.randn(batch_size, prefix, 16, generator=g)
    if masked:
        batch["mask"] = mask
    return batch


def _lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch)["loss"]


def _classification_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def _returned_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(batch)


def _next_token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@dataclass(frozen=True)
class ModelSpec:
    """One model of the zoo.

    Attributes:
        name: its key in ``ZOO``.
        make: builds the model (called under ``torch.manual_seed``).
        make_batch: ``make_batch(shape, generator)``.
        loss: ``loss(model, batch)``: the forward pass on ``batch`` and the loss.
        candidates: a name pattern relative to the model (``candidates=``), or None for automatic.
        fields: what each entry of a shape is (``describe``).
        lora: the modules PEFT LoRA adapters go on (the Hugging Face Trainer's ``lora`` variant).
    """

    name: str
    make: Callable[[], nn.Module]
    make_batch: Callable[[tuple, torch.Generator], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    candidates: str | None
    fields: tuple[str, ...]
    lora: tuple[str, ...] = ()

    def build(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return self.make().train()

    def batch(self, shape: tuple, seed: int, step: int) -> Any:
        return self.make_batch(tuple(shape), _generator(seed, step))

    def candidates_under(self, prefix: str) -> list[str] | None:
        """``candidates=`` for a root that holds the model at ``prefix`` (``"model."`` in a LightningModule)."""
        return None if self.candidates is None else [prefix + self.candidates]

    def describe(self, shape: tuple) -> str:
        return "x".join(str(int(v)) for v in shape) if len(self.fields) <= 3 else \
            f"{shape[0]}x{shape[1]}" + (f"+extra{shape[2]}" if shape[2] else "") + ("+mask" if shape[3] else "")


ZOO: dict[str, ModelSpec] = {
    "token": ModelSpec("token", TinyGPT, _token_batch, _lm_loss, None, ("batch", "sequence"), ("qkv",)),
    "gpt2": ModelSpec("gpt2", _gpt2, _token_batch, _lm_loss, None, ("batch", "sequence"), ("c_attn",)),
    "cnn": ModelSpec("cnn", SmallCNN, _image_batch, _classification_loss, None, ("batch", "height", "width")),
    "trunk": ModelSpec("trunk", TwoViews, lambda shape, g: _ids_batch(shape, g), _returned_loss, None,
                       ("batch", "sequence")),
    "dict": ModelSpec("dict", DictModel, _dict_batch, _returned_loss, None, ("batch", "sequence", "prefix", "mask")),
    "moduledict": ModelSpec("moduledict", Routed, lambda shape, g: _ids_batch(shape, g), _next_token_loss,
                            "blocks.*", ("batch", "sequence")),
}
