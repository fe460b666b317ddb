"""What a recomputed stage keeps alive of its inputs (runtime/profiling/held_inputs.py): counted once, where it
would otherwise be missed (an input made outside every stage and freed early), and not again where
an earlier stage's stored bytes hold it already (a frozen chain). Mixed plans are then predicted
at their measured peak."""

import random
import warnings

import pytest
import torch
from torch import nn

from lightning_remat import ProfileOptions, apply_plan, measure_step, profile_step, remove_remat
from lightning_remat.core.solve import plan_from_choices
from lightning_remat.runtime.profiling.held_inputs import DeadInputs, HeldInputs

warnings.filterwarnings("ignore", category=UserWarning)


class Block(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x, scale):
        return x + self.down(nn.functional.gelu(self.up(x))) + scale  # an add saves neither input


class FrozenEmbeddingNet(nn.Module):
    """As a LoRA model: a frozen embedding whose output no kept block saves, and a tensor every
    block receives and none saves (made in forward, freed at its end)."""

    def __init__(self, blocks=4, width=64):
        super().__init__()
        self.embed = nn.Embedding(32, width).requires_grad_(False)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        for p in self.blocks[0].up.parameters():
            p.requires_grad_(False)  # block 0's input: only its frozen first linear reads it

    def forward(self, ids):
        h = self.embed(ids)
        scale = torch.full((ids.shape[-1], 1), 0.01)
        for block in self.blocks:
            h = block(h, scale)
        return h


def _frozen_chain():
    net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(5)])
    for block in net[:2]:
        block.requires_grad_(False)
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
    return net, lambda m: m(x).square().mean()


def _embedding_net():
    net = FrozenEmbeddingNet()
    ids = torch.randint(0, 32, (8, 64), generator=torch.Generator().manual_seed(1))
    return net, lambda m: m(ids).square().mean()


def test_dead_inputs_are_those_made_outside_the_stages_and_freed_early():
    torch.manual_seed(0)
    net, step = _embedding_net()
    names = [f"blocks.{i}" for i in range(4)]
    with DeadInputs(net, names) as finder:
        loss = step(net)
        finder.check()
    assert finder.dead == {"blocks.0": {"0", "1"}, **{n: {"1"} for n in names[1:]}}
    del loss
    chain, chain_step = _frozen_chain()
    with DeadInputs(chain, [str(i) for i in range(5)]) as finder:
        loss = chain_step(chain)
        finder.check()
    del loss
    assert all(not keys for keys in finder.dead.values())  # earlier stages' outputs: stored there already
    with HeldInputs(net, names, {"blocks.0": {"0", "1"}, "blocks.2": {"1"}}, ["blocks.0", "blocks.2"]) as held:
        step(net)
    # Block 0 holds the embedding's output (8 x 64 x 64 floats) and the shared offset (64 floats),
    # block 2 the offset too: shared, so not exclusive to either.
    assert held.bytes == [8 * 64 * 64 * 4 + 64 * 4, 0, 64 * 4, 0]
    assert held.exclusive == [8 * 64 * 64 * 4, 0, 0, 0]


@pytest.mark.parametrize("build", [_embedding_net, _frozen_chain])
def test_mixed_plans_are_predicted_at_their_measured_peak(build):
    torch.manual_seed(0)
    net, step = build()
    optimizer = torch.optim.Adam([p for p in net.parameters() if p.requires_grad])
    measure_step(net, step, optimizer)  # Adam's state exists, as in every later step
    profile = profile_step(net, step, optimizer=optimizer, options=ProfileOptions(policies=None))
    rng = random.Random(0)
    plans = [[0] + [1] * (len(profile.stages) - 1), [1] + [0] * (len(profile.stages) - 1)]
    plans += [[rng.randrange(len(s.options)) for s in profile.stages] for _ in range(6)]
    for choices in plans:
        plan = plan_from_choices(profile, choices, 0, cost="flops")
        apply_plan(net, plan)
        try:
            measured = measure_step(net, step, optimizer).peak_bytes
        finally:
            remove_remat(net)
        names = [s.options[c].name for s, c in zip(profile.stages, choices)]
        # Never below; above only by a shared input counted for each stage that holds it.
        assert measured <= plan.predicted_peak_bytes <= measured + 1024, names
