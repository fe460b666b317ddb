"""A batch with padding after plans made from one without (issue 33, found under TRL's GRPO): Hugging Face builds
no attention mask for a batch without padding (SDPA runs causal), and a padded batch of the same sizes needs more,
so its plan is made again, from it, before its forward. A 2-layer Llama in a plain loop, ``prepare_remat``."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_remat.accelerate import ENV_BUDGET, RematPlugin, prepare_remat, remat_session
from tests.torch_meter import TorchPeak

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 64


def tiny_llama():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, use_cache=False)
    return transformers.LlamaForCausalLM(config).train()


def batches():
    """Two batches of 4 x 48 tokens: the first without padding, the second left-padded (half of each row)."""
    ids = torch.randint(2, VOCAB, (4, 48), generator=torch.Generator().manual_seed(1))
    padded = torch.ones(4, 48, dtype=torch.long)
    padded[:, :24] = 0
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids},
            {"input_ids": ids, "attention_mask": padded, "labels": ids.masked_fill(padded == 0, -100)}]


def run(budget=None, steps=(0, 1, 1)):
    """(each step's peak, the losses, the session) of SGD steps on ``batches()[i]`` for i in ``steps``."""
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    session = remat_session(prepare_remat(model, RematPlugin(budget=budget, cost="flops"))) if budget else None
    return (*train(model, optimizer, steps), session)


def train(model, optimizer, steps, before=lambda batch: None):
    """(each step's peak, the losses) of SGD steps on ``batches()[i]`` for i in ``steps``; ``before(batch)`` first."""
    peaks, losses, data = [], [], batches()
    for i in steps:
        meter = TorchPeak(model, optimizer).start()
        before(data[i])
        loss = model(**data[i]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peaks.append(meter.stop())
        losses.append(loss.item())
    return peaks, losses


def test_the_first_padded_batch_after_unpadded_plans_is_planned_again_and_every_step_holds(monkeypatch, caplog):
    monkeypatch.delenv(ENV_BUDGET, raising=False)
    plain, plain_losses, _ = run()
    budget = int(plain[2] * 0.97)  # a steady padded step's peak
    with caplog.at_level(logging.INFO, logger="lightning_remat"):
        peaks, losses, session = run(budget)
    assert max(peaks) <= budget, (budget, peaks, plain)
    assert losses == plain_losses
    assert any("the first with padding: every shape planned again" in r.getMessage() for r in caplog.records)
    assert session.metrics["remat/measured_peak_bytes"] <= session.plan.predicted_peak_bytes <= budget


def test_shape_plans_plan_a_padded_batch_again_after_an_unpadded_first(monkeypatch):
    """The same through ``ShapePlans`` on the real batches (as Lightning's ``AutoRemat`` and Fabric use it)."""
    from lightning_remat import ShapePlans

    plain, plain_losses, _ = run()
    budget = int(plain[2] * 0.97)
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plans = ShapePlans(model, lambda m, batch: m(**batch).loss, budget, optimizer=optimizer, cost="flops", verbose=False)
    peaks, losses = train(model, optimizer, (0, 1, 1), before=plans.use)
    assert max(peaks) <= budget, (budget, peaks, plain)
    assert losses == plain_losses and not plans.unpadded and plans.counts.solves == 2
