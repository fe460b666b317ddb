"""Applying a plan changes nothing the user can see: gradients, statistics, names, objects."""

import copy

import pytest
import torch
from torch import nn

from lightning_remat import AlreadyCheckpointedError, apply_plan, remove_remat
from lightning_remat.runtime.installing.apply import checkpointed_modules, existing_checkpointing
from lightning_remat.models import build


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.conv = nn.Conv1d(width, width, 3, padding=1)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(torch.relu(self.norm(self.conv(x))))


def make_net():
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(4)], nn.Flatten(), nn.Linear(8 * 16, 1)).train()


def run_steps(model, steps=3, seed=1):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(seed)
    grads = []
    for _ in range(steps):
        x = torch.randn(6, 8, 16)
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return grads


@pytest.mark.parametrize("names", [["0", "1", "2", "3"], ["1", "3"], ["0.norm", "2"]])
def test_gradients_and_batchnorm_statistics_equal_the_unwrapped_model(names):
    reference, wrapped = make_net(), make_net()
    apply_plan(wrapped, names)
    assert checkpointed_modules(wrapped) == names
    ref_grads, grads = run_steps(reference), run_steps(wrapped)
    for a, b in zip(ref_grads, grads):
        for ga, gb in zip(a, b):
            torch.testing.assert_close(ga, gb, rtol=0, atol=0)
    ref_buffers, buffers = dict(reference.named_buffers()), dict(wrapped.named_buffers())
    for name, value in ref_buffers.items():
        torch.testing.assert_close(value, buffers[name], rtol=0, atol=0)
    assert int(buffers["0.norm.num_batches_tracked"]) == 3


def test_gradients_equal_on_a_transformers_model_with_dropout():
    case = build("gpt2", layers=3, hidden=64, seq_len=32, batch_size=2)
    reference = case.model
    wrapped = copy.deepcopy(reference)
    apply_plan(wrapped, ["transformer.h.0", "transformer.h.1.attn", "transformer.h.2.mlp"])
    assert reference.config.attn_pdrop > 0 and reference.training
    losses = []
    for model in (reference, wrapped):
        torch.manual_seed(5)
        loss = case.step(model)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    for (name, p), q in zip(reference.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_names_objects_and_state_dict_keys_do_not_change():
    net = make_net()
    params_before = [id(p) for p in net.parameters()]
    names_before = [n for n, _ in net.named_parameters()]
    keys_before = list(net.state_dict().keys())
    apply_plan(net, ["0", "2"])
    assert [id(p) for p in net.parameters()] == params_before
    assert [n for n, _ in net.named_parameters()] == names_before
    assert list(net.state_dict().keys()) == keys_before
    # A state dict saved with recomputation loads without it, and the reverse.
    plain = make_net()
    plain.load_state_dict(net.state_dict())
    net.load_state_dict(plain.state_dict())


def test_remove_restores_the_original_forward_exactly():
    net = make_net()
    custom = net[1].forward  # a bound method stored on the instance, as some libraries do
    net[1].forward = custom
    apply_plan(net, ["0", "1"])
    assert "forward" in net[0].__dict__
    remove_remat(net)
    assert "forward" not in net[0].__dict__
    assert net[1].__dict__["forward"] is custom
    assert checkpointed_modules(net) == []
    # Applying a new plan replaces the old one rather than wrapping twice.
    apply_plan(net, ["0"])
    apply_plan(net, ["2"])
    assert checkpointed_modules(net) == ["2"]


class KwargsAndTuples(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.other = nn.Linear(4, 4)

    def forward(self, x, *, scale=1.0, extra=None):
        y = torch.relu(self.inner(x)) * scale
        return {"y": y, "pair": (y.sum(), "label"), "extra": extra}


def test_kwargs_tuples_dicts_and_non_tensor_outputs_pass_through_and_hooks_rerun():
    torch.manual_seed(0)
    module = KwargsAndTuples()
    reference = copy.deepcopy(module)
    calls = []
    module.inner.register_forward_hook(lambda m, i, o: calls.append("inner"))
    module.register_forward_hook(lambda m, i, o: calls.append("outer"))
    apply_plan(module, [])  # an empty plan is valid and wraps nothing
    holder = nn.ModuleDict({"block": module})
    apply_plan(holder, ["block"])
    x = torch.randn(3, 4, requires_grad=True)
    out = holder["block"](x, scale=2.0, extra="kept")
    assert out["extra"] == "kept" and out["pair"][1] == "label"
    (out["y"].sum() + out["pair"][0]).backward()
    # The child's hook runs again when the block is recomputed; the block's own hook runs once.
    assert calls == ["inner", "outer", "inner"]
    x_ref = x.detach().clone().requires_grad_()
    out_ref = reference(x_ref, scale=2.0)
    (out_ref["y"].sum() + out_ref["pair"][0]).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)


def test_no_recompute_without_autograd(monkeypatch):
    from lightning_remat.runtime.installing import recompute

    checkpoints, checkpoint = [], recompute.checkpoint
    monkeypatch.setattr(recompute, "checkpoint", lambda *a, **k: checkpoints.append(1) or checkpoint(*a, **k))
    net, reference = make_net().eval(), make_net().eval()
    apply_plan(net, ["0"])
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        out = net(x)
    with torch.inference_mode():
        inferred = net(x)
    # The plain forward ran (nothing saved for a recompute that can never come), with its outputs.
    assert checkpoints == []
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    torch.testing.assert_close(inferred, out, rtol=0, atol=0)
    net(x).sum().backward()  # with autograd, the same block is checkpointed
    assert checkpoints == [1]


def test_errors_leave_the_model_untouched():
    net = make_net()
    with pytest.raises(ValueError, match="does not have"):
        apply_plan(net, ["0", "nope"])
    assert checkpointed_modules(net) == []
    with pytest.raises(ValueError, match="'0.conv' inside '0'"):
        apply_plan(net, ["0", "0.conv"])
    assert checkpointed_modules(net) == []


def test_hugging_face_checkpointing_is_detected_and_not_doubled():
    case = build("gpt2", layers=2, hidden=32, seq_len=16, batch_size=1)
    case.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert existing_checkpointing(case.model)
    with pytest.raises(AlreadyCheckpointedError, match="Hugging Face"):
        apply_plan(case.model, ["transformer.h.0"])
    assert checkpointed_modules(case.model) == []


def test_torch_checkpoint_wrapper_is_detected_and_not_doubled():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    net = make_net()
    net[0] = checkpoint_wrapper(net[0])
    with pytest.raises(AlreadyCheckpointedError, match="checkpoint_wrapper"):
        apply_plan(net, ["1"])
    assert checkpointed_modules(net) == []
