"""A chunked or fused head (``chunk_loss``) under data parallelism: DDP and FSDP2, 2 processes, gloo, CPU.

The fused kind computes the head's gradients inside the forward and hands them to autograd in backward; DDP's
bucketed all-reduce and FSDP2's reduce-scatter both hook the parameters' gradients, so each rank's gradients (after
the collective) must equal those of the same wrapper around the plain model, on every rank's own batch, for both
kinds and GPT-2's head tied to its embeddings.
"""

import pytest
import torch
from tests.gloo_ranks import small_gpt2, spawn

pytestmark = pytest.mark.xdist_group("fsdp-multiprocess")

KINDS = ("chunk", "fuse")


def _gradients(model, ids) -> dict:
    """Loss and every parameter's gradient as full tensors (an FSDP2 shard gathered), from one step on ``ids``."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.removeprefix("module.")] = grad.detach().clone()
    return {"loss": loss.detach().clone(), **grads}


def _wrapped(kind: str | None, wrapper: str):
    """A fresh GPT-2 (same weights on every rank), with a head planned as ``kind`` (None: the model's own), wrapped."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from lightning_remat import Plan, StageAction, apply_plan

    model = small_gpt2(seq_len=24).model.eval()  # no dropout: the runs compare exactly
    if kind is not None:
        apply_plan(model, Plan(actions=[getattr(StageAction, kind)("lm_head", 3)]))
    if wrapper == "ddp":
        return DistributedDataParallel(model)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def _rank(rank: int) -> dict:
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(10 + rank))  # each rank its batch
    result = {}
    for wrapper in ("ddp", "fsdp2"):
        expected = _gradients(_wrapped(None, wrapper), ids)
        for kind in KINDS:
            got = _gradients(_wrapped(kind, wrapper), ids)
            assert got.keys() == expected.keys()
            result[f"{wrapper}/{kind}"] = {
                name: float((got[name] - expected[name]).abs().max()) for name in got}
            result[f"{wrapper}/{kind}/scale"] = float(max(t.abs().max() for t in expected.values()))
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(_rank, tmp_path_factory.mktemp("head_ranks"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_chunked_or_fused_head_gives_every_rank_the_wrappers_own_gradients(ranks, wrapper, kind):
    for result in ranks:
        differences = result[f"{wrapper}/{kind}"]
        scale = result[f"{wrapper}/{kind}/scale"]
        assert "loss" in differences and "transformer.wte.weight" in differences  # the tied head's weight
        worst = max(differences, key=differences.get)
        assert differences[worst] <= 1e-5 * max(scale, 1.0), (worst, differences[worst])
