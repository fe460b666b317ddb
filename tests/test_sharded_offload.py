"""Offloading in a fake sharded (FSDP2) profile: the host copies of saved tensors are metadata, not device
bytes, so a sharded plan with offload holds per GPU no more outside the stages than without it, and a
refusal of an offload plan names the world size that fits (the "more GPUs" knob, service/knobs.py)."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from lightning_remat import plan_remat
from lightning_remat.core.config import ProfileOptions
from lightning_remat.core.errors import BudgetTooSmallError
from lightning_remat.core.solve import least_peak
from lightning_remat.runtime.profiling.profile import profile_step
from lightning_remat.service import knobs

_FAKE = dict(fake=True, gpu="h100", device="cuda", host_memory="1TB")


def _outside(profile):
    return next(s.peak_bytes for s in profile.segments if s.name == "outside stages")


def _mlp():
    with torch.device("meta"):
        net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(2)])
    x = torch.randn(32, 16)
    return net, (lambda m: m(x).square().mean()), torch.optim.AdamW(net.parameters())


def _mlp_profile(world_size, offload):
    net, step, optimizer = _mlp()
    return profile_step(net, step, optimizer=optimizer,
                        options=ProfileOptions(world_size=world_size, offload=offload, **_FAKE))


def test_sharded_offload_profile_holds_no_more_outside_the_stages_than_without():
    # The sharded model's parameters are DTensors over fake shards: its offloader once took them for
    # real tensors and copied each saved tensor to a "host" on the same (fake CPU) device.
    sharded, offloaded, unsharded = _mlp_profile(2, False), _mlp_profile(2, True), _mlp_profile(1, True)
    assert _outside(offloaded) <= _outside(sharded) <= _outside(unsharded)
    assert least_peak(offloaded) <= least_peak(sharded)

    def host(profile):
        return {(s.name, o.name): o.host_bytes for s in profile.stages for o in s.options}
    # Each rank sends its own batch's activations: the bytes the unsharded step sends.
    assert host(offloaded) == host(unsharded) and max(host(offloaded).values()) > 0


def test_refused_offload_plan_names_the_world_size_whose_sharded_offload_plan_fits(monkeypatch):
    net, step, optimizer = _mlp()
    planned = dict(offload=True, cost="flops", verbose=False, **_FAKE)
    contexts = []
    found = knobs.knob_figures
    monkeypatch.setattr(knobs, "knob_figures", lambda context: contexts.append(context) or [])
    with pytest.raises(BudgetTooSmallError) as caught:
        plan_remat(net, step, 2**10, optimizer=optimizer, **planned)
    least = caught.value.smallest_peak_bytes
    # Just below the least peak on one GPU: two GPUs, each with half the parameters, gradients and
    # AdamW's state, fit; offloading's phantom host copies once made the sharded plan need more.
    monkeypatch.setattr(knobs, "KNOBS", {"more GPUs (FSDP2)": knobs._more_gpus})
    [knob] = found(replace(contexts[0], budget_bytes=least - 1))
    assert knob["setting"].startswith("fake=True, world_size=2 ") and knob["fits"] and knob["peak_bytes"] < least
