"""Settings out of every plausible range fail where they are read, naming the limit (issue 25,
item 9): device memory below 1 MiB, a device that does not exist, whole numbers (profile steps,
world size, warm-up, accumulation, batch-search sizes) far above any real use, budgets beyond 64
bits. The model is left as it was."""

import pytest
import torch
from torch import nn

from lightning_remat import AutoRemat, ProfileOptions, RematConfig, plan_remat
from lightning_remat.core.batch_fit import validate_search
from lightning_remat.core.errors import BudgetTooSmallError, ShardingError
from lightning_remat.integrations.accelerate.plugin import RematPlugin
from lightning_remat.integrations.cli import main


@pytest.mark.parametrize("memory", [0, "0", "1KB", 1024, "80%", "min", "lots"])
def test_a_device_memory_below_one_mib_or_not_a_size_is_refused(memory):
    with pytest.raises(ValueError, match=r"device_memory must be a size of at least 1 MiB"):
        ProfileOptions(device_memory=memory)
    assert ProfileOptions(device_memory="80GB").device_memory == "80GB"


@pytest.mark.parametrize("flags", [["--device-memory", "0"], ["--device-memory", "1KB"], ["--device", "banana"],
                                   ["--world-size", str(10**30), "--fake"]])
def test_the_command_line_refuses_them_as_bad_input_before_loading_anything(flags, capsys):
    # The factory does not exist: a setting checked first fails before it is looked for.
    assert main(["plan", "missing.py:factory", "--budget", "min", *flags]) == 2
    error = capsys.readouterr().err
    assert ("at least 1 MiB" in error or "device type" in error or "<= 65536" in error) and "missing.py" not in error


def test_a_device_that_does_not_exist_is_a_setting_error():
    with pytest.raises(ValueError, match="device must be a device type .* got 'banana'"):
        ProfileOptions(device="banana")
    assert ProfileOptions(device=torch.device("cuda", 1)).device == "cuda:1"


@pytest.mark.parametrize("world_size", [10**6, 10**30])
def test_world_size_is_bounded_and_says_the_bound(world_size):
    with pytest.raises(ShardingError, match=r"world_size must be an int >= 1 and <= 65536"):
        ProfileOptions(fake=True, world_size=world_size)


def test_every_whole_number_setting_names_its_limit(monkeypatch):
    with pytest.raises(ValueError, match=r"warmup must be an int >= 0 and <= 1000"):
        ProfileOptions(warmup=10**9)
    with pytest.raises(ValueError, match=r"accumulation_steps must be an int >= 1 and <= 100000"):
        ProfileOptions(accumulation_steps=10**20)
    with pytest.raises(ValueError, match=r"profile_steps must be an int >= 1 and <= 100000"):
        AutoRemat("1GB", profile_steps=10**20)
    monkeypatch.setenv("ACCELERATE_REMAT_BUDGET", "1GB")
    monkeypatch.setenv("ACCELERATE_REMAT_PROFILE_STEPS", str(10**20))
    with pytest.raises(ValueError, match=r"ACCELERATE_REMAT_PROFILE_STEPS=.*at most 100000"):
        RematPlugin()
    with pytest.raises(ValueError, match=r"max_val must be an int >= 1 and <= 16777216"):
        validate_search(0.35, 0.05, 3, 2, 10**12, "power", 20)
    with pytest.raises(ValueError, match=r"steps_per_trial must be an int >= 1 and <= 1000"):
        validate_search(0.35, 0.05, 10**9, 2, 64, "power", 20)


@pytest.mark.parametrize("budget", [10**400, 2**63, "10000000000TB", float(2**64)])
def test_a_budget_beyond_64_bits_is_refused(budget):
    with pytest.raises(ValueError, match="2\\*\\*63 - 1"):
        RematConfig(budget)


def test_plan_remat_refuses_them_before_profiling_and_leaves_the_model_as_it_was():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    calls = []

    def step(m):
        calls.append(1)
        return m(torch.randn(2, 4)).sum()

    for bad in ({"device_memory": "1KB"}, {"fake": True, "world_size": 10**6, "cost": "flops"}, {"warmup": 10**6},
                {"device": "banana"}):
        with pytest.raises(ValueError):
            plan_remat(net, step, "min", **bad)
    assert calls == [] and all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all("forward" not in m.__dict__ for m in net.modules())


def test_a_device_memory_below_the_least_peak_is_refused_even_for_the_least_peak_plan():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # 2 MiB of parameters, 4 MiB with gradients
    x = torch.randn(8, 512)
    with pytest.raises(BudgetTooSmallError, match=r"fits the target device's memory, device_memory='2MiB' "
                                                  r"\(2097152 bytes\): the least peak is") as caught:
        plan_remat(net, lambda m: m(x).square().mean(), "min", device_memory="2MiB")
    assert caught.value.smallest_peak_bytes > caught.value.static_bytes > 2**21
    assert "At the least peak, what binds: " in str(caught.value)  # the term a shorter step would have to lower
    assert plan_remat(net, lambda m: m(x).square().mean(), "min", device_memory="1GB").predicted_peak_bytes < 2**30
