"""Op-level selective checkpointing (runtime/installing/sac.py) and the roofline cost (runtime/measuring/roofline.py):
bit-equal gradients under every policy, BatchNorm statistics updated once, torch.compile, exact
memory for uniform plans, attention FLOPs on the CPU's SDPA kernel, roofline ordered and stable."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_remat import Plan, ProfileOptions, StageAction, apply_plan, measure_step, profile_step, remove_remat
from lightning_remat.core.solve import plan_from_choices, solve
from lightning_remat.models import build
from lightning_remat.runtime.installing import installer, sac
from lightning_remat.runtime.measuring.observe import observe_step
from lightning_remat.runtime.measuring.roofline import OpRecorder, Peaks, device_peaks, option_costs, sac_seconds_per_op

warnings.filterwarnings("ignore", category=UserWarning)


class Block(nn.Module):
    """Attention (the CPU flash SDPA kernel), an MLP with BatchNorm and dropout."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.norm = nn.Linear(width, 2 * width), nn.BatchNorm1d(2 * width)
        self.drop, self.down = nn.Dropout(0.2), nn.Linear(2 * width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, w))
        h = self.norm(self.up(x).reshape(b * s, -1)).reshape(b, s, -1)
        return x + self.down(self.drop(nn.functional.gelu(h)))


def make_net(blocks=3):
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(blocks)]).train()


def batch():
    return torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))


def run_steps(model, steps=2):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = batch()
    grads, losses = [], []
    torch.manual_seed(7)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return losses, grads


@pytest.mark.parametrize("policy", sac.POLICIES)
def test_gradients_and_batchnorm_statistics_bit_equal_under_every_policy(policy):
    reference, wrapped = make_net(), make_net()
    apply_plan(wrapped, Plan([StageAction.recompute(n, policy=policy) for n in ("0", "2")], 0, 0, 0, 0.0))
    assert installer.recomputed(wrapped) == {"0": policy, "2": policy}
    (ref_losses, ref_grads), (losses, grads) = run_steps(reference), run_steps(wrapped)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    for a, b in zip(ref_grads, grads):
        assert all(torch.equal(ga, gb) for ga, gb in zip(a, b))
    for (name, value), other in zip(reference.named_buffers(), wrapped.buffers()):
        assert torch.equal(value, other), name
    assert int(wrapped[0].norm.num_batches_tracked) == 2  # once per step, not again on recompute


def test_gradients_bit_equal_on_gpt2_with_dropout_under_a_mixed_plan():
    case = build("gpt2", layers=4, hidden=64, seq_len=32, batch_size=2)
    reference, wrapped = case.model, copy.deepcopy(case.model)
    plan = Plan([StageAction.recompute("transformer.h.0", policy="save_matmuls"),
                 StageAction.recompute("transformer.h.1", policy="save_alternate_matmuls"),
                 StageAction.recompute("transformer.h.2", policy="save_projections"),
                 StageAction.recompute("transformer.h.3.mlp")], 0, 0, 0, 0.0)
    apply_plan(wrapped, plan)
    assert reference.config.attn_pdrop > 0
    losses = []
    for model in (reference, wrapped):
        torch.manual_seed(5)
        loss = case.step(model)
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(*losses)
    for (name, p), q in zip(reference.named_parameters(), wrapped.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_save_projections_is_offered_where_attention_runs_as_batched_matmuls():
    """GPT-2 with attention dropout takes SDPA's math path on the CPU: recomputing its batched
    matmuls (the score matrix) stores less than save_matmuls for a few FLOPs, and the prediction
    holds. Llama's attention is a fused kernel: the policy equals save_matmuls and is not offered."""
    case = build("gpt2", layers=2, hidden=64, seq_len=64, batch_size=2)
    optimizer = torch.optim.Adam(case.model.parameters())
    profile = profile_step(case.model, case.step, optimizer=optimizer,
                           options=ProfileOptions(policies=("save_matmuls", "save_projections")))
    stage = profile.stages[0]
    matmuls, projections = stage.option("sac:save_matmuls"), stage.option("sac:save_projections")
    scores = 2 * 4 * 64 * 64 * 4  # batch x heads x seq x seq, float32: one score matrix
    assert projections.stored_bytes <= matmuls.stored_bytes - scores
    assert matmuls.costs.flops < projections.costs.flops < stage.option("whole").costs.flops
    plan = plan_from_choices(profile, [[o.name for o in s.options].index("sac:save_projections") for s in profile.stages],
                             0, cost="roofline")
    apply_plan(case.model, plan)
    measure_step(case.model, case.step, optimizer)
    measured = measure_step(case.model, case.step, optimizer).peak_bytes
    assert measured <= plan.predicted_peak_bytes <= 1.05 * measured
    llama = build("llama", layers=1, hidden=64, seq_len=32, batch_size=2)
    fused = profile_step(llama.model, llama.step, options=ProfileOptions(policies=("save_matmuls", "save_projections")))
    assert [o.name for o in fused.stages[0].options if o.action.policy] == ["sac:save_matmuls"]


def test_a_policy_runs_under_torch_compile():
    reference, model = make_net(2), make_net(2)
    apply_plan(model, Plan([StageAction.recompute("0", policy="save_matmuls"),
                                StageAction.recompute("1", policy="save_attention")], 0, 0, 0, 0.0))
    for net in (model, reference):
        net.eval()  # no dropout: the compiled graph draws its random numbers differently
        for block in net:
            block.norm.train()
    compiled = torch.compile(model, backend="aot_eager")
    x = batch()
    for m in (compiled, reference):
        m(x).square().mean().backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    for value, other in zip(reference.buffers(), model.buffers()):
        torch.testing.assert_close(value, other, rtol=1e-6, atol=1e-7)
    assert int(model[0].norm.num_batches_tracked) == 1


def test_apply_rejects_unknown_policies_and_policies_of_modules_not_recomputed():
    net = make_net(2)
    with pytest.raises(ValueError, match="unknown selective-checkpointing policy"):
        apply_plan(net, Plan([StageAction.recompute("0", policy="save_everything")]))
    with pytest.raises(ValueError, match="only a recomputed stage has a policy"):
        apply_plan(net, Plan([StageAction.recompute("0"), StageAction("1", policy="save_matmuls")]))
    apply_plan(net, Plan([StageAction.recompute("0", policy="save_matmuls")]))
    remove_remat(net)
    assert installer.recomputed(net) == {} and "forward" not in net[0].__dict__


def test_attention_flops_count_on_the_cpu_sdpa_kernel():
    q = k = v = torch.randn(2, 4, 16, 8, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        out = nn.functional.scaled_dot_product_attention(q, k, v)
    ops = {str(op) for op in counter.get_flop_counts()["Global"]}
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in ops
    assert counter.get_total_flops() == 2 * (2 * 2 * 4 * 16 * 16 * 8)  # scores and output: two batched matmuls
    with FlopCounterMode(display=False) as backward:
        out.sum().backward()
    # Backward: the scores again, and the gradients of the scores, values, queries and keys.
    assert backward.get_total_flops() == 5 * counter.get_total_flops() // 2


def test_llama_attention_flops_are_counted():
    case = build("llama", layers=1, hidden=64, seq_len=32, batch_size=2)
    with FlopCounterMode(display=False) as counter:
        case.step(case.model)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert counts["aten._scaled_dot_product_flash_attention_for_cpu"] > 0


def test_roofline_is_deterministic_and_ordered_for_a_transformer_block():
    net = make_net(1)
    x = batch()
    observed = [observe_step(net, lambda m: m(x).square().mean(), ["0"]) for _ in range(2)]
    peaks = Peaks(1e11, 1e10)
    costs = [{o: (c.flops, c.roofline)  # not the measured seconds
              for o in ("whole", "sac:save_matmuls", "sac:save_alternate_matmuls", "sac:save_attention")
              for c in [option_costs("0", sac.policy_of(o), ("0",), seen.stats, peaks)]}
             for seen in observed]
    assert costs[0] == costs[1]
    roof = {o: c[1] for o, c in costs[0].items()}
    flops = {o: c[0] for o, c in costs[0].items()}
    assert roof["whole"] > roof["sac:save_attention"] > roof["sac:save_alternate_matmuls"] > roof["sac:save_matmuls"] > 0
    # Only elementwise ops recomputed: 0 FLOPs, plus the one that breaks the tie with keeping the stage.
    assert flops["sac:save_matmuls"] == 1 < flops["sac:save_alternate_matmuls"] < flops["whole"]
    assert device_peaks("cpu") == device_peaks("cpu")  # fixed (core.hardware.CPU_FLOPS): the same in every process
    # Eager SAC's own per-op cost is added to a policy's seconds, for every op of the module.
    base, extra = (option_costs("0", "save_matmuls", ("0",), observed[0].stats, peaks, per_op).time
                   for per_op in (0.0, 1.0))
    assert extra - base == pytest.approx(len(observed[0].stats["0"].ops))
    assert 0.0 <= sac_seconds_per_op() < 1e-2


def test_op_recorder_bytes_skip_views_and_count_inputs_and_outputs():
    x = torch.randn(64, 32)
    with OpRecorder() as rec:
        y = x.t()
        _ = (y * 2).sum()
    by_op = {str(op.func): op for op in rec.ops}
    assert by_op["aten.t.default"].bytes == 0
    assert by_op["aten.mul.Tensor"].bytes == 2 * x.nbytes  # read once, written once
    assert by_op["aten.mul.Tensor"].flops == 0

def test_op_recorder_prices_aliases_and_allocations_at_zero_and_in_place_ops_at_their_traffic():
    x, w = torch.randn(2, 3, 16), torch.randn(16, 8)
    with OpRecorder() as rec:
        y = torch.matmul(x, w)  # view, mm, then aten._unsafe_view back to 3-d: an alias, no copy
        mask = torch.empty_like(y)
        mask.bernoulli_(0.5)
        y.add_(1.0)
    by_op = {str(op.func): op for op in rec.ops}
    assert by_op["aten._unsafe_view.default"].bytes == 0
    assert by_op["aten.empty_like.default"].bytes == 0
    assert by_op["aten.bernoulli_.float"].bytes == y.nbytes  # written in place: one tensor
    assert by_op["aten.add_.Tensor"].bytes == y.nbytes
    assert by_op["aten.mm.default"].bytes == x.nbytes + w.nbytes + y.nbytes



@pytest.fixture(scope="module")
def profiled():
    net = make_net(3)
    x = batch()
    step = lambda m: m(x).square().mean()  # noqa: E731
    optimizer = torch.optim.Adam(net.parameters())
    measure_step(net, step, optimizer)  # Adam's state exists, as in every later step
    return net, step, optimizer, profile_step(net, step, optimizer=optimizer, options=ProfileOptions(policies=None))


def test_profile_offers_policies_and_prices_them(profiled):
    _, _, _, profile = profiled
    names = [o.name for o in profile.stages[0].options]
    assert {"keep", "whole", "sac:save_matmuls", "sac:save_alternate_matmuls", "sac:save_attention"} <= set(names)
    stage = profile.stages[0]
    keep, whole, matmuls = stage.option("keep"), stage.option("whole"), stage.option("sac:save_matmuls")
    assert matmuls.action.policy == "save_matmuls" and whole.action.policy is None
    assert whole.stored_bytes < matmuls.stored_bytes < keep.stored_bytes
    assert 0 < matmuls.costs.roofline < whole.costs.roofline and matmuls.costs.flops == 1
    assert profile.baseline_costs["roofline"] > sum(s.option("whole").costs.roofline for s in profile.stages)


@pytest.mark.parametrize("mixed", [False, True])
def test_predicted_peak_within_5_percent_of_measured_for_plans_with_policies(profiled, mixed):
    net, step, optimizer, profile = profiled
    names = [o.name for o in profile.stages[0].options]
    if mixed:
        picks = ["sac:save_matmuls", "sac:save_attention", "whole"]
    else:
        picks = ["sac:save_alternate_matmuls"] * 3
    plan = plan_from_choices(profile, [names.index(p) for p in picks], 0, cost="roofline")
    assert set(plan.policies.values()) == {sac.policy_of(p) for p in picks} - {""}
    apply_plan(net, plan)
    try:
        measured = measure_step(net, step, optimizer).peak_bytes
    finally:
        remove_remat(net)
    # Conservative and close: the segments between stages take the highest of all measured runs.
    assert measured <= plan.predicted_peak_bytes <= 1.05 * measured


def test_roofline_plan_uses_policies_where_they_are_cheapest(profiled):
    _, _, _, profile = profiled
    uniform = [[o.name for o in s.options].index("sac:save_matmuls") for s in profile.stages]
    reference = plan_from_choices(profile, uniform, 0, cost="roofline")
    plan = solve(profile, reference.predicted_peak_bytes, cost="roofline")
    assert plan.predicted_peak_bytes <= reference.predicted_peak_bytes
    assert plan.predicted_overhead <= reference.predicted_overhead
    assert plan.policies and set(plan.policies) <= set(plan.checkpointed)
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "selective checkpointing" in plan.summary()
