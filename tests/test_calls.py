"""A module that runs several times in one step (a trunk under two heads, two views through one
encoder) is profiled, priced and predicted as that many runs: one place in the chain per run, one
option for all its places (``core.calls``)."""

import copy
import itertools
import random
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_remat import BudgetTooSmallError, StageAction, apply_plan, measure_step, profile_step, remove_remat, solve
from lightning_remat.core.calls import owners, tied_dp
from lightning_remat.core.memory_model import Costs, Profile, Segment, StageOption, StageProfile, predict_peak
from lightning_remat.core.predict import predict
from lightning_remat.core.solve import solve_segmentation
from lightning_remat.core.spans import plan_cost_spans
from tests.torch_meter import TorchPeak


class Block(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TrunkTwice(nn.Module):
    """An embedding and 4 blocks run on two inputs of different lengths, a head on each run."""

    def __init__(self, width=32, vocab=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(4))
        self.head = nn.Linear(width, vocab)
        self.aux = nn.Linear(width, 2)

    def trunk(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, ids, other):
        return self.head(self.trunk(ids)).logsumexp(-1).mean() + self.aux(self.trunk(other)).square().mean()


BLOCKS = [f"blocks.{i}" for i in range(4)]


@pytest.fixture(scope="module")
def trunk_twice():
    torch.manual_seed(0)
    model = TrunkTwice()
    ids, other = torch.randint(0, 64, (8, 32)), torch.randint(0, 64, (8, 24))
    step = lambda m: m(ids, other)  # noqa: E731
    optimizer = torch.optim.Adam(model.parameters())
    step(model).backward()
    optimizer.step()  # steady state: the optimizer holds its state
    optimizer.zero_grad(set_to_none=True)
    return model, step, optimizer, profile_step(model, step, optimizer=optimizer)


def test_each_run_of_the_trunk_is_a_place_and_costs_its_recompute(trunk_twice):
    model, step, optimizer, profile = trunk_twice
    assert [(s.name, s.call) for s in profile.stages] == [(n, 0) for n in BLOCKS] + [(n, 1) for n in BLOCKS]
    first, second = profile.stages[0], profile.stages[4]
    # The second run is on 24 tokens, the first on 32: it stores three quarters of the first's bytes.
    assert second.option("keep").stored_bytes == 3 * first.option("keep").stored_bytes // 4
    # Recomputing a block recomputes both of its runs: the places' FLOPs sum to both forwards'.
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.blocks[0](torch.zeros(8, 32, 32))
        model.blocks[0](torch.zeros(8, 24, 32))
    assert first.option("whole").costs.flops + second.option("whole").costs.flops == counter.get_total_flops()
    plan = solve(profile, "min", cost="flops")
    assert [a.stage for a in plan.actions] == BLOCKS and [c.stage for c in plan.choices] == BLOCKS
    # On fake tensors: the same places, the same bytes.
    fake = profile_step(model, step, optimizer=optimizer, fake=True)
    assert [(s.name, s.call, [(o.name, o.stored_bytes, o.local_peak_bytes) for o in s.options]) for s in fake.stages] \
        == [(s.name, s.call, [(o.name, o.stored_bytes, o.local_peak_bytes) for o in s.options]) for s in profile.stages]


def test_every_plan_predicted_to_the_byte_and_solved_plans_within_the_budget(trunk_twice):
    model, step, optimizer, profile = trunk_twice
    # Main predicted all but the first two 67-1,077 KB off (mixed plans read one run's figures for both).
    for recomputed in [(), ("blocks.3",), ("blocks.1", "blocks.2"), ("blocks.0", "blocks.2", "blocks.3"), BLOCKS]:
        actions = [StageAction.recompute(n) if n in recomputed else StageAction(n) for n in BLOCKS]
        apply_plan(model, list(recomputed))
        measured = measure_step(model, step, optimizer).peak_bytes
        remove_remat(model)
        assert predict(profile, actions, "flops").peak_bytes == measured, recomputed
    least, plain = solve(profile, "min", cost="flops").predicted_peak_bytes, profile.baseline_peak_bytes
    reference = copy.deepcopy(model)
    for fraction in (0.3, 0.6):
        budget = int(least + fraction * (plain - least))
        plan = solve(profile, budget, cost="flops")
        apply_plan(model, plan)
        meter = TorchPeak(model, optimizer).start()
        optimizer.zero_grad(set_to_none=True)
        step(model).backward()
        optimizer.step()
        independent = meter.stop()
        remove_remat(model)
        assert plan.checkpointed and independent <= budget, (plan.checkpointed, independent, budget)
        model.load_state_dict(reference.state_dict())
    # Same gradients as without the plan.
    apply_plan(model, plan)
    model.zero_grad(set_to_none=True)
    step(model).backward()
    step(reference).backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)
    remove_remat(model)


def _tied_profile(rng: random.Random) -> Profile:
    """Random places of 2-3 modules over 1-3 rounds (each round the modules in order, some left out);
    in half of them one place is ``fresh`` (a backward pass ran before it)."""
    modules = [f"m{i}" for i in range(rng.randint(2, 3))]
    options = {m: rng.randint(1, 3) for m in modules}
    rounds = [modules] + [[m for m in modules if rng.random() < 0.7] or modules[:1] for _ in range(rng.randint(0, 2))]
    seen: dict[str, int] = {}
    stages = []
    for run in rounds:
        for m in run:
            stages.append(StageProfile(m, tuple(
                StageOption(f"o{j}", StageAction.recompute(m, (f"{m}.c{j}",)) if j else StageAction(m),
                            rng.randint(-5, 100) if j else rng.randint(60, 120),
                            rng.randint(0, 200), Costs(float(rng.randint(0, 9) * j), rng.randint(0, 9) * j))
                for j in range(options[m])), call=seen.get(m, 0)))
            seen[m] = seen.get(m, 0) + 1
    segments = tuple(Segment(f"s{k}", k, rng.randint(0, 150)) for k in rng.sample(range(len(stages) + 1), 2))
    if rng.random() < 0.5:
        k = rng.randrange(1, len(stages)) if len(stages) > 1 else 0
        stages[k] = replace(stages[k], fresh=True)
    return Profile(tuple(stages), segments)


def _tied_plans(profile: Profile):
    owner = owners(profile)
    firsts = sorted(set(owner))
    for picked in itertools.product(*[range(len(profile.stages[m].options)) for m in firsts]):
        by_first = dict(zip(firsts, picked))
        yield [by_first[o] for o in owner]


def test_tied_solver_equals_exhaustive_search_over_tied_plans_with_and_without_fresh_places():
    rng = random.Random(7)
    for _ in range(150):
        profile = _tied_profile(rng)
        plans = list(_tied_plans(profile))
        peaks = [predict_peak(profile, c) for c in plans]
        least = min(peaks)
        assert predict_peak(profile, tied_dp(profile, None, "flops")) == least
        budget = rng.randint(least - 5, max(peaks) + 5)
        fitting = [plan_cost_spans(profile, c, "flops") for c, p in zip(plans, peaks) if p <= budget]
        found = tied_dp(profile, budget, "flops")
        if not fitting:
            assert found is None
            with pytest.raises(BudgetTooSmallError):
                solve(profile, budget, cost="flops")
            continue
        assert predict_peak(profile, found) <= budget
        assert plan_cost_spans(profile, found, "flops") == min(fitting)
        assert solve(profile, budget, cost="flops").predicted_peak_bytes <= budget
        # The same through the solver's entry, which takes the chain DP where no module is tied.
        assert plan_cost_spans(profile, solve_segmentation(profile, budget, "flops").choices, "flops") == min(fitting)
