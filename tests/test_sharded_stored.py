"""What a stage stores in a fake sharded (FSDP2) profile: the unsharded figure plus what sharding adds to the stage
whatever its option (the block's parameters gathered until FSDP2 reshards them after the stage's forward, and the
all-gather buffer FSDP2 keeps until the next block's), never a recomputed option's input counted again."""

import torch
from torch import nn

from lightning_remat.core.config import ProfileOptions
from lightning_remat.runtime.profiling.profile import profile_step

_FAKE = dict(fake=True, gpu="h100", device="cuda", host_memory="1TB", offload=True)


def _stored(world_size):
    with torch.device("meta"):
        net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(2)])
    # A frozen first layer does not save its input: FSDP2's view of the second block's input dies with its forward.
    net[1][0].requires_grad_(False)
    x = torch.randn(32, 16)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad])
    profile = profile_step(net, lambda m: m(x).square().mean(), optimizer=optimizer,
                           options=ProfileOptions(world_size=world_size, **_FAKE))
    return {s.name: {o.name: o.stored_bytes for o in s.options} for s in profile.stages}, net


def test_a_recomputed_sharded_stage_stores_what_it_stores_unsharded_plus_what_sharding_adds():
    (sharded, net), (unsharded, _) = _stored(2), _stored(1)
    added = {stage: {name: sharded[stage][name] - unsharded[stage][name] for name in options}
             for stage, options in unsharded.items()}
    # The second block's input is the first block's output, counted there. FSDP2 passes the block a view of it
    # (RegisterPostBackwardFunction); that view object dies with the forward, and was once taken for a dead input
    # the checkpoint keeps alive: "whole" and "whole+offload-input" stored a hidden state (2,048 B) more.
    gathered = sum(p.numel() * p.element_size() for p in net[1].parameters())
    assert added["1"] == dict.fromkeys(unsharded["1"], gathered)
    assert unsharded["1"]["whole"] < unsharded["1"]["keep"] and "whole+offload-input" in added["1"]
    # The first block also keeps FSDP2's all-gather buffer until the second's all-gather, under every option: an
    # offload run's stored bytes are taken net of what the gap after the stage frees, which once took FSDP2's
    # reshard of the gathered parameters off too (offload options +8,512 B against keep's +17,024 B).
    assert added["0"] == dict.fromkeys(unsharded["0"], 2 * gathered) and "offload" in added["0"]
