"""profile_step's contract: what it records, and that it leaves training state as it found it."""

import pytest
import torch
from torch import nn

from lightning_remat import NoCandidateError, plan_remat, profile_step, solve
from lightning_remat.models import build
from tests.tiny_hf import shallow_resnet


def tiny_gpt2(**kwargs):
    return build("gpt2", layers=2, hidden=32, seq_len=32, batch_size=2, vocab=128, **kwargs)


def test_profiling_leaves_parameters_gradients_buffers_rng_and_optimizer_as_found():
    case = shallow_resnet(width=8)  # BatchNorm buffers (ResNet-50's 16 bottlenecks took 14-46 s)
    model = case.model
    optimizer = torch.optim.Adam(model.parameters())
    case.step(model).backward()
    optimizer.step()  # the optimizer holds state
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    state = {k: v.clone() for k, v in optimizer.state[next(iter(model.parameters()))].items()}
    rng = torch.get_rng_state()
    profile = profile_step(model, case.step, optimizer=optimizer)
    assert profile.optimizer_state_bytes > 0
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]) and torch.equal(p.grad, grads[n]), n
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    for k, v in optimizer.state[next(iter(model.parameters()))].items():
        assert torch.equal(v, state[k])
    assert torch.equal(torch.get_rng_state(), rng)


def test_stages_are_blocks_in_execution_order_with_heavy_children_as_options():
    case = tiny_gpt2()
    profile = profile_step(case.model, case.step)
    assert [s.name for s in profile.stages] == ["transformer.h.0", "transformer.h.1"]
    stage = profile.stages[0]
    assert [o.name for o in stage.options][:2] == ["keep", "whole"]
    assert {"attn", "mlp"} <= {o.name for o in stage.options}
    keep, whole = stage.option("keep"), stage.option("whole")
    assert whole.stored_bytes < keep.stored_bytes and keep.costs.flops == 0 < whole.costs.flops
    assert stage.saved_bytes > 0 and stage.input_bytes > 0 and stage.output_bytes > 0
    assert stage.forward_flops == whole.costs.flops and stage.forward_seconds > 0
    assert profile.baseline_costs.flops > 2 * sum(s.forward_flops for s in profile.stages)


def test_candidates_by_class_name_or_pattern_and_unknown_ones():
    case = tiny_gpt2()
    by_class = profile_step(case.model, case.step, candidates=["GPT2MLP"])
    assert [s.name for s in by_class.stages] == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    by_pattern = profile_step(case.model, case.step, candidates="transformer.h.*.attn")
    assert [s.name for s in by_pattern.stages] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    with pytest.raises(NoCandidateError, match="GPT2Block"):
        profile_step(case.model, case.step, candidates=["NoSuchBlock"])


def test_a_model_without_candidates_is_a_clear_error():
    model = nn.Linear(4, 4)
    with pytest.raises(NoCandidateError, match="no candidate module.*candidates="):
        plan_remat(model, lambda m: m(torch.randn(2, 4)).sum(), "1GB")


def test_the_step_must_return_the_scalar_loss():
    case = tiny_gpt2()
    with pytest.raises(TypeError, match="scalar loss"):
        profile_step(case.model, lambda m: m(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits)


def test_use_cache_in_training_is_named_in_the_plan():
    case = tiny_gpt2()
    case.model.config.use_cache = True
    plan = solve(profile_step(case.model, case.step), "min", cost="flops")
    assert "use_cache=True" in plan.summary()


def test_a_plan_already_applied_is_lifted_for_the_profile_and_put_back():
    net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)) for _ in range(3)])
    x = torch.randn(16, 8)
    plain = profile_step(net, lambda m: m(x).sum())
    from lightning_remat import apply_plan
    from lightning_remat.runtime.installing.apply import checkpointed_modules

    apply_plan(net, ["1"])
    wrapped = profile_step(net, lambda m: m(x).sum())
    assert checkpointed_modules(net) == ["1"]
    assert [o.stored_bytes for s in wrapped.stages for o in s.options] == \
        [o.stored_bytes for s in plain.stages for o in s.options]


def test_identical_layers_share_their_measured_seconds_and_the_rest_stays_measured():
    """Timing noise does not choose between identical layers: every GPT-2 block gets, per option,
    the median of the blocks' measured seconds; FLOPs and bytes stay as measured."""
    case = build("gpt2", layers=4, hidden=64, seq_len=32, batch_size=2)
    profile = profile_step(case.model, case.step)
    seconds = [tuple(o.costs.time for o in s.options) for s in profile.stages]
    assert len(set(seconds)) == 1 and seconds[0][0] == 0.0 and all(t > 0 for t in seconds[0][1:])
    assert len({s.forward_seconds for s in profile.stages}) == 1
    assert len({tuple(o.costs.flops for o in s.options) for s in profile.stages}) == 1
