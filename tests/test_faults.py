"""Faults and wrong inputs (issue 25): spellings the docs use are accepted, wrong ones refused with
what is accepted, a user's exceptions surface as themselves, and after any failure the model is
exactly as it was (parameters, names, state_dict keys, forwards, classes)."""

import warnings

import pytest
import torch
from torch import nn

from lightning_remat import ProfileOptions, plan_remat
from lightning_remat.integrations.accelerate import RematPlugin
from lightning_remat.integrations.lightning.callback import AutoRemat

warnings.filterwarnings("ignore", category=UserWarning)


def chain(blocks=3, width=16):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                           for _ in range(blocks)])


def step_of(width=16):
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(1))
    return lambda model: model(x).square().mean()


def snapshot(model):
    """Everything a failure must leave as it was: names and values of parameters and buffers,
    state_dict keys, each module's class and forward."""
    return ([(n, p.detach().clone()) for n, p in model.named_parameters()],
            [(n, b.clone()) for n, b in model.named_buffers()], list(model.state_dict()),
            [(n, type(m), m.__dict__.get("forward"), type(m).forward) for n, m in model.named_modules()])


def assert_unchanged(model, before):
    after = snapshot(model)
    for (n0, v0), (n1, v1) in zip(before[0] + before[1], after[0] + after[1]):
        assert n0 == n1 and torch.equal(v0, v1), n0
    assert [len(x) for x in before[:2]] == [len(x) for x in after[:2]]
    assert before[2:] == after[2:]


def test_policies_spelled_as_the_docs_spell_them_are_accepted_everywhere():
    names = ("sac:save_matmuls", "save_attention")
    assert ProfileOptions(policies=names).policies == ("save_matmuls", "save_attention")
    assert AutoRemat(budget="1GB", policies=names).config.profile.policies == ("save_matmuls", "save_attention")
    assert RematPlugin(budget="1GB", policies="sac:save_matmuls").config().profile.policies == ("save_matmuls",)
    model = chain()
    plan = plan_remat(model, step_of(), budget="min", policies=("sac:save_matmuls",))
    assert plan.budget_bytes > 0


@pytest.mark.parametrize("bad", [True, 1, 2.5, object(), [True], ["save_matmuls", None]])
def test_policies_that_are_not_names_are_refused_naming_what_is_accepted(bad):
    for make in (lambda: ProfileOptions(policies=bad), lambda: AutoRemat(budget="1GB", policies=bad),
                 lambda: RematPlugin(budget="1GB", policies=bad)):
        with pytest.raises(ValueError, match="save_matmuls") as caught:
            make()
        assert "not iterable" not in str(caught.value)
    model = chain()
    before = snapshot(model)
    with pytest.raises(ValueError, match="policies must be None"):
        plan_remat(model, step_of(), budget="min", policies=True)
    assert_unchanged(model, before)
