"""Selective-checkpointing policies under torch.compile: the decisions reach the compiled graph as
MUST_SAVE / MUST_RECOMPUTE and AOTAutograd's min-cut partitioner (inductor's) keeps them; gradients
equal eager's under inductor; recompute of pointwise ops is priced as fused (free) when the model is
compiled, and the solver then takes the policies that recompute them."""

import copy
import warnings

import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy

from lightning_remat import Plan, ProfileOptions, StageAction, apply_plan, profile_step
from lightning_remat.core.solve import least_peak, solve
from lightning_remat.runtime.installing.compiled import runs_compiled
from lightning_remat.runtime.measuring.roofline import TIE_SECONDS
from lightning_remat.runtime.profiling.profile import COMPILED_NOTE

warnings.filterwarnings("ignore", category=UserWarning)
aten = torch.ops.aten


class Block(nn.Module):
    """An MLP block whose recompute under "save_matmuls" is a pointwise chain (gelu, sigmoid, mul)."""

    def __init__(self, width=32):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        h = self.up(x)
        return x + self.down(nn.functional.gelu(h) * torch.sigmoid(h))


class ChainBlock(Block):
    """A block whose pointwise chain moves more bytes than its matmuls: eagerly, recomputing it is
    most of what recomputing the whole block costs; compiled, it is fused away."""

    def forward(self, x):
        h = self.up(x)
        g = nn.functional.gelu(h) * torch.sigmoid(h)
        return x + self.down(g * torch.tanh(g) + h.exp().neg() * 0.5)


def make_net(blocks=2, width=32, block=Block):
    torch.manual_seed(0)
    return nn.Sequential(*[block(width) for _ in range(blocks)])


def save_matmuls_everywhere(net):
    names = [str(i) for i in range(len(net))]
    return apply_plan(net, Plan([StageAction.recompute(n, policy="save_matmuls") for n in names], 0, 0, 0, 0.0))


def recording_backend(record):
    """AOTAutograd with inductor's partitioner (min-cut) and no code generation: records the joint
    graph's recompute tags and the forward's saved values (its outputs after the user's)."""

    def partition(joint, inputs, **kwargs):
        record["tags"] = {n.name: (n.target, n.meta["recompute"]) for n in joint.graph.nodes if "recompute" in n.meta}
        forward, backward = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        outputs = next(n for n in forward.graph.nodes if n.op == "output").args[0]
        record["saved"] = [n for n in outputs[kwargs["num_fwd_outputs"]:] if n.op == "call_function"]
        return forward, backward

    boxed = lambda graph, inputs: make_boxed_func(graph)  # noqa: E731
    return aot_autograd(fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition)


def test_policy_decisions_reach_the_compiled_graph_as_must_and_the_partitioner_keeps_them():
    net = save_matmuls_everywhere(make_net())
    record = {}
    compiled = torch.compile(net, backend=recording_backend(record))
    compiled(torch.randn(8, 32, requires_grad=True)).sum().backward()
    # Every op of the checkpointed regions that a policy decides (all but those SAC never caches,
    # which torch tags itself) carries our decision, and none is a PREFER_* hint.
    tags = {name: tag for name, tag in record["tags"].items() if tag[0] not in SAC_IGNORED_OPS}
    assert {policy for _, policy in tags.values()} == {CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE}
    saved_by_policy = {name for name, (target, policy) in tags.items() if policy == CheckpointPolicy.MUST_SAVE}
    assert {tags[name][0] for name in saved_by_policy} == {aten.addmm.default}
    # What the compiled forward keeps for backward: the up projections' outputs (MUST_SAVE, needed
    # by gelu's and sigmoid's backward) and the first block's output (the second region's input);
    # no op the policy recomputes, so none of the pointwise chain.
    saved = record["saved"]
    assert sorted(str(n.target) for n in saved) == ["aten.add.Tensor", "aten.addmm.default", "aten.addmm.default"]
    for node in saved:
        if node.target is aten.addmm.default:
            assert node.name in saved_by_policy and any(u.target is aten.gelu.default for u in node.users)
    assert not {aten.gelu.default, aten.sigmoid.default, aten.mul.Tensor} & {n.target for n in saved}


def test_policies_under_inductor_give_the_gradients_of_eager_training():
    reference, net = make_net(), save_matmuls_everywhere(make_net())
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    for model in (torch.compile(net), reference):
        model(x).square().mean().backward()
    for (name, p), q in zip(reference.named_parameters(), net.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_pricing_makes_pointwise_recompute_free_and_the_plan_takes_it():
    net = make_net(blocks=4, width=64, block=ChainBlock)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    step = lambda m: m(x).square().mean()  # noqa: E731
    options = ProfileOptions(policies=("save_matmuls",))
    eager = profile_step(net, step, options=options)
    compiled = profile_step(torch.compile(net), step, options=options)  # profiling compiles nothing
    assert COMPILED_NOTE in compiled.notes and COMPILED_NOTE not in eager.notes
    for mine, theirs in zip(compiled.stages, eager.stages):
        policy, whole = mine.option("sac:save_matmuls"), mine.option("whole")
        # The policy recomputes only the pointwise chain: fused into the backward, free (but for
        # the nanosecond that keeps a stage where memory allows).
        assert policy.costs.roofline == TIE_SECONDS < theirs.option("sac:save_matmuls").costs.roofline
        assert policy.costs.time == TIE_SECONDS < theirs.option("sac:save_matmuls").costs.time
        # A whole block keeps the price of its matmuls; FLOPs and memory are the same either way.
        assert 0.0 < whole.costs.roofline < theirs.option("whole").costs.roofline
        assert [(o.costs.flops, o.stored_bytes) for o in mine.options] == [
            (o.costs.flops, o.stored_bytes) for o in theirs.options]
    # Between the least peak and the baseline, the compiled profile's plans recompute the pointwise
    # chain (the policy) where the eager profile's recompute whole blocks or keep them.
    low, high = least_peak(eager), eager.baseline_peak_bytes
    counts = {"eager": [], "compiled": []}
    for k in range(1, 20):
        budget = int(low + (high - low) * k / 20)
        for label, profile in (("eager", eager), ("compiled", compiled)):
            plan = solve(profile, budget, cost="roofline")
            assert plan.predicted_peak_bytes <= budget
            counts[label].append(len(plan.policies))
    assert sum(counts["compiled"]) > sum(counts["eager"])
    assert sum(c > e for c, e in zip(counts["compiled"], counts["eager"])) >= 2
    # With memory to spare nothing is recomputed, compiled or not.
    assert not solve(compiled, high, cost="roofline").checkpointed


def test_a_step_compiled_in_place_or_by_lightning_is_priced_as_compiled():
    import lightning.pytorch as L
    from lightning.pytorch.utilities.compile import from_compiled

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net()

        def forward(self, x):
            return self.net(x)

    assert not runs_compiled(make_net()) and not runs_compiled(Lit())
    # Trainer.fit(torch.compile(lit)) unwraps it so: the module itself, its steps compiled.
    assert runs_compiled(from_compiled(torch.compile(Lit())))
    net = make_net()
    net.compile()  # in place: no wrapper in the module tree
    x = torch.randn(8, 32)
    profile = profile_step(net, lambda m: m(x).square().mean(), options=ProfileOptions(policies=("save_matmuls",)))
    assert COMPILED_NOTE in profile.notes
