"""One argument vocabulary: every entry point takes a setting under the same name, with the same
default, described once (the fields of ``RematConfig`` and ``ProfileOptions``); refusals are ``RematError``s."""

import inspect
import json
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_remat import (AutoRemat, ConflictingArgumentsError, ProfileOptions, RematBatchSizeFinder, RematConfig,
                             RematError, StepError, UnsupportedSetupError, UnsupportedShardingError,
                             find_remat_batch_size, plan_remat, profile_step)
from lightning_remat.accelerate import RematPlugin, prepare_remat, remat_session
from lightning_remat.core.config import DEFAULT_COST
from lightning_remat.integrations.cli import _parser as build_parser

ROOT = Path(__file__).resolve().parents[1]


def _default(function, name):
    return inspect.signature(function).parameters[name].default


def _mlp(depth=3, width=16):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width))
                           for _ in range(depth)])


def _make_step(batch_size):
    x = torch.randn(batch_size, 16, generator=torch.Generator().manual_seed(batch_size))
    return lambda model: model(x).square().mean()


def _plan_flags():
    parser = build_parser()
    plan = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("plan"))
    return {action.dest: action for action in plan._actions}


# ------------------------------------------------------------------------------ one vocabulary


def test_one_default_cost_everywhere():
    # Unset: the target's (tests/test_default_cost.py): counted FLOPs on the CPU, the roofline on a known GPU.
    assert DEFAULT_COST is None
    assert RematConfig("1GB").cost == DEFAULT_COST
    for function in (plan_remat, find_remat_batch_size, AutoRemat.__init__, RematBatchSizeFinder.__init__):
        assert _default(function, "cost") == DEFAULT_COST, function
    from lightning_remat.service.shape_plans import ShapePlans

    assert _default(ShapePlans.__init__, "cost") == DEFAULT_COST
    assert RematPlugin(budget="1GB").cost == DEFAULT_COST
    assert _plan_flags()["cost"].default == DEFAULT_COST


def test_one_default_margin_and_profile_steps():
    assert _default(find_remat_batch_size, "margin") == _default(RematBatchSizeFinder.__init__, "margin") == 0.0
    assert _default(AutoRemat.__init__, "profile_steps") == RematPlugin(budget="1GB").profile_steps == 1


def test_the_batch_search_takes_lightnings_names():
    search = set(inspect.signature(find_remat_batch_size).parameters)
    finder = set(inspect.signature(RematBatchSizeFinder.__init__).parameters)
    shared = {"init_val", "max_val", "mode", "steps_per_trial", "max_trials", "margin", "max_overhead", "cost",
              "candidates", "policies", "offload"}
    assert shared <= search and shared <= finder
    for name in shared - {"max_val"}:
        assert _default(find_remat_batch_size, name) == _default(RematBatchSizeFinder.__init__, name), name
    assert list(inspect.signature(find_remat_batch_size).parameters)[:3] == ["model", "make_step", "budget"]


def test_every_entry_point_takes_the_planning_settings():
    settings = {"cost", "candidates", "policies", "offload"}
    for function in (plan_remat, find_remat_batch_size, AutoRemat.__init__, RematBatchSizeFinder.__init__):
        assert settings <= set(inspect.signature(function).parameters), function
        assert _default(function, "policies") == () and _default(function, "candidates") is None, function
    assert settings <= {f.name for f in fields(RematPlugin)}
    assert settings <= set(_plan_flags())
    # plan_remat and profile_step take every profile setting under its field's name and default.
    profile_fields = {f.name: f.default for f in fields(ProfileOptions)}
    for function, skip in ((profile_step, ()), (plan_remat, ("gradient_buckets",))):
        for name, default in profile_fields.items():
            if name not in skip:
                assert _default(function, name) == default, (function, name)


def test_the_command_line_has_a_flag_per_setting_with_the_fields_help():
    flags = _plan_flags()
    for cls in (RematConfig, ProfileOptions):
        for name, text in ((f.name, f.metadata["help"]) for f in fields(cls) if "help" in f.metadata):
            if name == "profile":
                continue
            assert name in flags, name
            assert flags[name].help.replace("%%", "%").startswith(text), name
    args = build_parser().parse_args(["plan", "f.py:make", "--candidates", "GPT2Block,h.*", "--policies", "all",
                                      "--cost", "roofline", "--no-repeated-blocks", "--warmup", "2"])
    assert (args.candidates, args.policies, args.cost, args.repeated_blocks, args.warmup) == (
        "GPT2Block,h.*", "all", "roofline", False, 2)


def test_accelerate_reads_policies_from_the_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_REMAT_POLICIES", "save_matmuls, save_attention")
    assert RematPlugin(budget="1GB").config().profile.policies == ("save_matmuls", "save_attention")
    monkeypatch.setenv("ACCELERATE_REMAT_POLICIES", "all")
    assert RematPlugin(budget="1GB").config().profile.policies is None
    monkeypatch.setenv("ACCELERATE_REMAT_POLICIES", "save_everything")
    with pytest.raises(ValueError, match="ACCELERATE_REMAT_POLICIES='save_everything'"):
        RematPlugin(budget="1GB")


def test_callbacks_pass_policies_and_candidates_to_the_planner():
    assert AutoRemat(budget="1GB", policies=["save_matmuls"]).config.profile.policies == ("save_matmuls",)
    finder = RematBatchSizeFinder(budget="1GB", candidates=["GPT2Block"], policies=None)
    assert finder.config.profile.candidates == ("GPT2Block",) and finder.config.profile.policies is None


# --------------------------------------------------------------------------- no silent choice


def test_profile_step_refuses_keywords_next_to_options():
    net = _mlp()
    with pytest.raises(ConflictingArgumentsError, match=r"warmup=3.*options=") as info:
        profile_step(net, _make_step(4), options=ProfileOptions(fake=False), warmup=3)
    assert isinstance(info.value, TypeError) and isinstance(info.value, RematError)
    with pytest.raises(TypeError, match="policies=None"):
        profile_step(net, _make_step(4), options=ProfileOptions(), policies=None)


def test_prepare_remat_takes_remat_plugin_as_remat_accelerator_does():
    other = _mlp()
    prepare_remat(other, remat_plugin=RematPlugin(budget="2GB"))
    assert remat_session(other).plugin.budget == "2GB"
    remat_session(other).remove()


# --------------------------------------------------------------------- refusals are RematError


@pytest.mark.parametrize("kind", ["DEEPSPEED", "MEGATRON_LM", "XLA"])
def test_unsupported_accelerate_modes_are_remat_errors(kind):
    from lightning_remat.integrations.accelerate.accelerator import _check_supported

    accelerator = SimpleNamespace(distributed_type=kind, state=SimpleNamespace(dynamo_plugin=None))
    # DeepSpeed without a ZeRO stage the package plans is refused naming the stages it does plan.
    with pytest.raises(UnsupportedSetupError, match="does not support|plans DeepSpeed ZeRO") as info:
        _check_supported(accelerator)
    assert isinstance(info.value, NotImplementedError) and isinstance(info.value, RematError)
    assert issubclass(UnsupportedShardingError, UnsupportedSetupError)


def test_a_step_that_runs_no_candidate_is_a_remat_error():
    net = _mlp()
    with pytest.raises(StepError, match="none of the candidate stages") as info:
        profile_step(net, lambda m: m[0][0].weight.square().sum(), candidates=["1"])
    assert isinstance(info.value, RuntimeError)


# ---------------------------------------------------------------- the CLI plans through the service


def test_the_command_line_plans_through_the_planning_service(monkeypatch, capsys):
    """The plan is ``Planner.solve_profile``'s, as ``plan_remat``'s: with ``--offload`` it is solved
    within the host's free memory (the command line used to call the solver itself, without that limit)."""
    from lightning_remat.integrations.cli import main
    from lightning_remat.service.planning import Planner

    target = f"{ROOT / 'examples' / 'factories.py'}:gpt2"
    solved, host_asked = [], []
    real = Planner.solve_profile
    monkeypatch.setattr(Planner, "solve_profile", lambda self, *a: solved.append(self.config) or real(self, *a))
    monkeypatch.setattr("lightning_remat.runtime.targets.offload_link.host_limit_bytes",
                        lambda options: host_asked.append(1) or 2**40)
    assert main(["plan", target, "--fake", "--gpu", "h100", "--device", "cuda", "--offload", "--budget", "min",
                 "--candidates", "GPT2Block", "--json", "--no-plots"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["plan"]["checkpointed"] and host_asked
    (config,) = solved
    # No --cost, a fake H100: the target's default, the roofline with the H100's figures.
    assert config.cost == "roofline" and config.profile.offload and config.profile.candidates == ("GPT2Block",)
    assert result["cost"] == "roofline" and any("h100" in note for note in result["plan"]["notes"])
