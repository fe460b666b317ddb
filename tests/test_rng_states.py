"""The random-generator states checkpoints keep are planned memory on the CPU (runtime/measuring/host_rng.py)."""

import torch
from torch import nn

from lightning_remat import apply_plan, plan_remat, remove_remat
from lightning_remat.runtime.measuring.tracking import rng_states_count
from lightning_remat.runtime.measuring.tracking import Tracker
from tests.torch_meter import TorchPeak


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 32))
                           for _ in range(6)])


def test_a_min_plan_on_the_cpu_is_predicted_to_the_byte_by_the_allocator():
    # Before: every recomputed block measured 5,056 bytes (the CPU generator's state) above the plan.
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(512, 32)
    plan = plan_remat(net, lambda m: m(x).square().mean(), budget="min", optimizer=optimizer, cost="flops")
    assert plan.checkpointed
    apply_plan(net, plan)
    for _ in range(2):  # the second step: the momentum buffers exist, as the plan counts them
        optimizer.zero_grad(set_to_none=True)
        meter = TorchPeak(net, optimizer).start()
        net(x).square().mean().backward()
        optimizer.step()
        peak = meter.stop()
    remove_remat(net)
    assert peak == plan.predicted_peak_bytes


def test_the_states_count_on_the_cpu_only():
    state_bytes = torch.get_rng_state().nbytes
    x = torch.randn(4, 4, requires_grad=True)
    block = nn.Linear(4, 4)

    def checkpointed_forward(tracker: Tracker) -> int:
        with tracker:
            out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            return tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"], out

    on_cpu, _ = checkpointed_forward(Tracker())
    with rng_states_count("cuda"):
        for_gpu, _ = checkpointed_forward(Tracker())
    assert on_cpu - for_gpu == state_bytes
