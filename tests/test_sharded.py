"""Sharded (FSDP2) planning for N GPUs in one process: the fake profile's per-GPU terms, its
prediction against a real 2-process gloo ``fully_shard`` run, and the errors."""

import pytest
import torch
import torch.distributed as dist

from lightning_remat import plan_remat
from lightning_remat.core.config import ProfileOptions
from lightning_remat.core.errors import RematError, ShardedBudgetTooSmallError, ShardingError
from lightning_remat.models import build
from lightning_remat.runtime.profiling.profile import profile_step

LLAMA = dict(layers=2, seq_len=64, batch_size=2)


def _llama():
    case = build("llama", **LLAMA)
    return case.model, case.step, torch.optim.AdamW(case.model.parameters())


def _fake_profile(world_size):
    model, step, optimizer = _llama()
    return profile_step(model, step, optimizer=optimizer, options=ProfileOptions(fake=True, world_size=world_size))


def test_sharded_static_terms_are_the_unsharded_ones_over_the_world_size():
    one, four = _fake_profile(1), _fake_profile(4)
    assert not dist.is_initialized()  # the fake process group is gone
    assert four.parameter_bytes * 4 == one.parameter_bytes
    assert four.gradient_bytes * 4 == one.gradient_bytes
    # AdamW: two moments per parameter, sharded, and one unsharded 4-byte step count per parameter.
    steps = one.optimizer_state_bytes - 2 * one.parameter_bytes
    assert steps == 4 * len(list(_llama()[0].parameters()))
    assert four.optimizer_state_bytes == 2 * four.parameter_bytes + steps
    model = _llama()[0]
    profile_step(model, _llama()[1], options=ProfileOptions(fake=True, world_size=2))
    layer = model.model.layers[0]  # the model given is left as it was
    assert type(layer).__name__ == "LlamaDecoderLayer" and not layer._forward_pre_hooks
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())
    assert four.sharding["world_size"] == 4 and four.sharding["units"] == LLAMA["layers"] + 1
    assert one.sharding == {}
    # Sharding moves static memory out of the peak; activations of the (same) local batch stay.
    assert four.baseline_peak_bytes < one.baseline_peak_bytes
    assert any("FSDP2 fully_shard over 4 GPUs" in note for note in four.notes)


def _rank(rank, plans):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_remat.runtime.installing.apply import apply_plan, remove_remat
    from lightning_remat.runtime.measuring.tracking import Tracker, snapshot_by_category

    model, step, optimizer = _llama()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())  # over the sharded parameters
    peaks = []
    for checkpointed in plans:
        apply_plan(model, checkpointed)
        steady = []
        for i in range(3):  # the first creates the optimizer state; the peak of the others counts
            tracker = Tracker()
            tracker.track_external(model, optimizer)
            with tracker:
                loss = step(model)
                loss.backward()
                del loss
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if i:
                steady.append(snapshot_by_category(tracker.get_tracker_snapshot("peak"), torch.device("cpu"))["Total"])
        peaks.append(max(steady))
        remove_remat(model)
    return peaks


@pytest.mark.distributed
def test_prediction_matches_a_real_two_process_fully_shard_run(tmp_path):
    model, step, optimizer = _llama()
    plan = plan_remat(model, step, "min", optimizer=optimizer, cost="flops", fake=True, world_size=2)
    assert plan.checkpointed and plan.sharding["world_size"] == 2
    from tests.gloo_ranks import spawn

    measured = spawn(_rank, tmp_path, [[], plan.checkpointed])
    for keep, planned in measured:
        assert keep == pytest.approx(plan.baseline_peak_bytes, rel=0.05)
        assert planned == pytest.approx(plan.predicted_peak_bytes, rel=0.05)
        assert planned < 0.95 * keep  # the plan matters at this size (-9% here)


def test_world_size_errors():
    model, step, _ = _llama()
    with pytest.raises(ShardingError, match="world_size must be an int >= 1"):
        plan_remat(model, step, "min", cost="flops", fake=True, world_size=0)
    with pytest.raises(ShardingError, match="needs fake=True.*plan inside the real sharded run"):
        plan_remat(model, step, "min", cost="flops", world_size=2)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ShardingError, match="already has a process group"):
            plan_remat(model, step, "min", cost="flops", fake=True, world_size=2)
    finally:
        dist.destroy_process_group()


def test_budget_below_the_sharded_peak_names_the_world_size_that_fits():
    model, step, optimizer = _llama()
    profile = _fake_profile(2)
    least = plan_remat(model, step, "min", optimizer=optimizer, cost="flops", fake=True, world_size=2)
    static = profile.parameter_bytes + profile.gradient_bytes + profile.optimizer_state_bytes
    budget = least.predicted_peak_bytes - static // 3  # fits only if the static part shrinks by a third
    with pytest.raises(ShardedBudgetTooSmallError) as caught:
        plan_remat(model, step, budget, optimizer=optimizer, cost="flops", fake=True, world_size=2)
    error = caught.value
    assert isinstance(error, RematError) and error.world_size == 2
    assert error.smallest_peak_bytes == least.predicted_peak_bytes
    assert error.smallest_world_size is not None and error.smallest_world_size > 2
    assert f"from world size {error.smallest_world_size} on" in str(error)
    # The estimate holds: at that world size a plan fits.
    fits = plan_remat(model, step, budget, optimizer=optimizer, cost="flops", fake=True,
                      world_size=error.smallest_world_size)
    assert fits.predicted_peak_bytes <= budget
    with pytest.raises(ShardedBudgetTooSmallError, match="no world size would fit"):
        plan_remat(model, step, 10_000, optimizer=optimizer, cost="flops", fake=True, world_size=2)


def test_the_command_line_plans_one_gpu_of_n(capsys):
    """``--world-size`` through the CLI: the per-GPU breakdown in --json, with the parameters of one
    GPU about a quarter of the unsharded ones (FSDP2 pads uneven shards), and the same figures as
    ``plan_remat(..., world_size=4)``."""
    import json
    from pathlib import Path

    from lightning_remat.integrations.cli import main

    target = f"{Path(__file__).resolve().parents[1] / 'examples' / 'factories.py'}:gpt2"
    common = ["plan", target, "--fake", "--cost", "flops", "--device", "cuda", "--budget", "min", "--json", "--no-plots"]
    assert main(common) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(common + ["--world-size", "4"]) == 0
    sharded = json.loads(capsys.readouterr().out)
    per_gpu = sharded["per_gpu"]
    assert per_gpu["world_size"] == 4 and per_gpu["unsharded_parameter_bytes"] > 0
    unsharded_parameters = whole["plan"]["parameter_bytes"]
    assert unsharded_parameters / 4 <= per_gpu["parameter_bytes"] <= unsharded_parameters / 4 * 1.05
    assert sharded["plan"]["predicted_peak_bytes"] < whole["plan"]["predicted_peak_bytes"]
