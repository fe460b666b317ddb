"""A plan is bound to the model it was made for (issue 25, items 6 and 8): it records the shapes of
the modules it names and the model's size, ``apply_plan`` refuses a model with other shapes or more
stages (the model left as it was), AutoRemat plans a resumed run into such a model again, and a
saved plan or checkpoint state that holds a value no plan can have fails on load, naming the field."""

import dataclasses
import json
import math
import warnings

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_remat import AutoRemat, apply_plan, plan_remat
from lightning_remat.core.errors import PlanFormatError, PlanMismatchError, RematError
from lightning_remat.core.plan import Plan, StageAction
from lightning_remat.integrations.lightning.batch_size_finder import RematBatchSizeFinder
from lightning_remat.runtime.installing.apply import checkpointed_modules
from tests.torch_meter import TorchPeak

WIDTH, BATCH = 32, 64


def chain(n=4, hidden=4 * WIDTH):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, hidden), nn.GELU(), nn.Linear(hidden, WIDTH))
                           for _ in range(n)])


def step(model):
    torch.manual_seed(1)
    return model(torch.randn(BATCH, WIDTH)).square().mean()


def as_found(model):
    """What a refused plan must leave as it was: names, state_dict keys, parameter objects, forwards, classes."""
    return ([(n, type(m), "forward" in m.__dict__) for n, m in model.named_modules()], list(model.state_dict()),
            [id(p) for p in model.parameters()])


def half_of_the_activations():
    """A budget that binds on chain(4): static memory plus half of what the step saves."""
    plan = plan_remat(chain(), step, "min", cost="flops")
    return (plan.baseline_peak_bytes + plan.predicted_peak_bytes) // 2


# ---------------------------------------------------------------------------------- item 6


def test_a_plan_records_the_shapes_it_was_made_for_and_refuses_wider_blocks_leaving_the_model_as_it_was():
    budget = half_of_the_activations()
    plan = plan_remat(chain(), step, budget, cost="flops")
    assert plan.checkpointed and plan.fingerprint["module_parameters"]["0"]["0.weight"] == [[4 * WIDTH, WIDTH],
                                                                                            "float32"]
    assert set(plan.fingerprint["module_parameters"]) == {"0", "1", "2", "3"}  # every stage, kept ones too
    wide = chain(hidden=16 * WIDTH)
    before = as_found(wide)
    with pytest.raises(PlanMismatchError, match=r"module '0' parameter '0.weight' has shape \(512, 32\) float32 in "
                                                r"this model; the plan was made for \(128, 32\) float32"):
        apply_plan(wide, plan)
    assert as_found(wide) == before and checkpointed_modules(wide) == []
    # Why it is refused: the same actions on the wider blocks break the budget they were solved for.
    apply_plan(wide, dataclasses.replace(plan, fingerprint={}))  # what a plan that records nothing does
    meter = TorchPeak(wide).start()
    step(wide).backward()
    assert meter.stop() > 3 * budget
    # The model it was made for (an identical one) takes it, and stays within the budget (1%: a few
    # scalars torch's profiler sees that the plan's meter does not).
    same = chain()
    apply_plan(same, plan)
    meter = TorchPeak(same).start()
    step(same).backward()
    assert meter.stop() <= 1.01 * budget


def test_a_plan_for_four_stages_is_refused_on_six_naming_the_stages_it_does_not_know():
    plan = plan_remat(chain(4), step, "min", cost="flops")
    six = chain(6)
    before = as_found(six)
    with pytest.raises(PlanMismatchError, match=r"module\(s\) \['4', '5'\] are stages the plan does not know"):
        apply_plan(six, plan)
    assert as_found(six) == before
    # And the other way: a stage the plan names that the model lacks.
    with pytest.raises(PlanMismatchError, match="module '3', which the plan names, is not in this model"):
        apply_plan(chain(3), plan)


def test_the_binding_survives_json_other_dtypes_apply_and_plans_that_record_nothing_still_apply():
    plan = plan_remat(chain(), step, "min", cost="flops")
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    with pytest.raises(PlanMismatchError):
        apply_plan(chain(hidden=2 * WIDTH), again)
    # Dtypes are recorded, not compared: a precision conversion after planning is legitimate.
    assert plan.checkpointed
    assert checkpointed_modules(apply_plan(chain().to(torch.bfloat16), again)) == plan.checkpointed
    # Plans saved by earlier versions (no shapes recorded) and plans given as names apply unchecked.
    old = {k: v for k, v in plan.to_dict().items() if k != "fingerprint"}
    assert checkpointed_modules(apply_plan(chain(hidden=2 * WIDTH), Plan.from_dict(old))) == plan.checkpointed
    assert checkpointed_modules(apply_plan(chain(hidden=2 * WIDTH), ["0"])) == ["0"]


def test_a_fake_plan_records_the_real_model_it_was_made_for():
    model = chain()
    plan = plan_remat(model, step, "min", cost="flops", fake=True)
    assert plan.fingerprint["parameter_count"] == sum(p.numel() for p in model.parameters())
    with pytest.raises(PlanMismatchError):
        apply_plan(chain(hidden=2 * WIDTH), plan)


class ChainModule(L.LightningModule):
    def __init__(self, hidden):
        super().__init__()
        self.net = chain(hidden=hidden)

    def training_step(self, batch, batch_idx):
        return self.net(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(tmp_path, module, callback, ckpt_path=None):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=(2 if ckpt_path is None else 4), callbacks=[callback],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path)
    data = DataLoader(torch.randn(8 * BATCH, WIDTH), batch_size=BATCH)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


def test_autoremat_resumed_into_a_model_with_other_shapes_plans_again(tmp_path):
    first = AutoRemat(budget="min", verbose=False)
    _fit(tmp_path, ChainModule(4 * WIDTH), first).save_checkpoint(tmp_path / "narrow.ckpt")
    assert first.run.profiles == 1
    wide = ChainModule(16 * WIDTH)
    checkpoint = torch.load(tmp_path / "narrow.ckpt", weights_only=False)
    # The callback's state only: the wider model starts from its own weights (Lightning would refuse
    # the narrow ones), as a run resumed from a foreign or hand-made checkpoint would.
    checkpoint["state_dict"] = wide.state_dict()
    checkpoint["optimizer_states"] = []
    torch.save(checkpoint, tmp_path / "foreign.ckpt")
    resumed = AutoRemat(budget="min", verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path, wide, resumed, ckpt_path=tmp_path / "foreign.ckpt")
    # Planned again: neither the narrow model's plan nor its plans per batch shape reused.
    assert resumed.run.profiles == 1
    assert resumed.plan.fingerprint["module_parameters"]["net.0"]["0.weight"] == [[16 * WIDTH, WIDTH], "float32"]
    assert any("made for another model (module 'net.0' parameter '0.weight' has shape (512, 32)" in str(w.message)
               for w in caught)


# ---------------------------------------------------------------------------------- item 8

GOOD = Plan([StageAction.recompute("h.0")], budget_bytes=2**30, baseline_peak_bytes=2**31, predicted_peak_bytes=2**30 - 1,
            predicted_overhead=0.1, notes=["ok"]).to_dict()


@pytest.mark.parametrize("field, value", [
    ("budget_bytes", "10GB"), ("budget_bytes", 10**400), ("budget_bytes", -1), ("budget_bytes", 1.5),
    ("predicted_peak_bytes", float("inf")), ("parameter_bytes", None), ("host_bytes", True),
    ("predicted_overhead", "10%"), ("predicted_overhead", math.inf),
    ("notes", "abc"), ("notes", [1, 2]), ("requested_budget", 10), ("cost_kind", 3), ("fallback", "no"),
    ("fingerprint", [1]), ("sharding", "x"), ("choices", "x"), ("actions", "h.0"), ("actions", [1]),
    ("fingerprint", {"module_parameters": {"h.0": {"weight": [[-4], "float32"]}}}),
    ("offload_limits", {"h.0": "1GB"}), ("fingerprint", {"batch_elements": "many"}),
])
def test_a_saved_plan_with_a_value_no_plan_can_have_fails_on_load_naming_the_field(field, value):
    with pytest.raises(PlanFormatError, match=f"'{field}.*' must be .*got") as caught:
        Plan.from_dict({**GOOD, field: value})
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, RematError)


def test_a_choice_for_a_stage_without_an_action_fails_on_load():
    bad = {**GOOD, "choices": [{"stage": "h.9", "option": "whole", "baseline_stored_bytes": 1, "stored_bytes": 0,
                                "cost": 1.0}]}
    with pytest.raises(PlanFormatError, match=r"'choices\[0\].stage' must be a stage of the plan's actions"):
        Plan.from_dict(bad)


@pytest.mark.parametrize("state", [{"plan": "h.0"}, {"plan": ["h.0"]}, "plan", {"plan": None, "plans": [[0, 1, {}]]},
                                   {"plan": {**GOOD, "notes": "abc"}}, {"plan": {**GOOD, "checkpointed": 3}}])
def test_a_foreign_checkpoint_state_fails_on_load_and_changes_nothing(state):
    callback = AutoRemat(budget="min", verbose=False)
    callback.load_state_dict({"plan": GOOD, "plans": []})
    with pytest.raises(PlanFormatError, match="checkpoint state"):
        callback.load_state_dict(state)
    assert callback.plan == Plan.from_dict(GOOD)
    finder = RematBatchSizeFinder(budget="1GB")
    with pytest.raises(PlanFormatError, match="RematBatchSizeFinder's checkpoint state"):
        finder.load_state_dict(state if not isinstance(state, dict) or "plans" not in state else
                               {"plan": None, "batch_size": 0})
    assert finder.plan is None


def test_a_plan_with_its_actions_overridden_is_still_checked():
    plan = plan_remat(chain(), step, "min", cost="flops")
    wide = chain(hidden=2 * WIDTH)
    with pytest.raises(PlanMismatchError):
        apply_plan(wide, dataclasses.replace(plan, actions=()))
    assert checkpointed_modules(wide) == []
