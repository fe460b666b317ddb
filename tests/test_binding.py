"""What binds (core/binding.py) named in the summary, the metrics and --json; the optimizer step's
advice; the knobs of a BudgetTooSmallError (service/knobs.py), each equal to planning with it."""

import json
import re

import pytest
import torch
from torch import nn

from lightning_remat import plan_remat
from lightning_remat.core.errors import BudgetTooSmallError
from lightning_remat.service.run import plan_metrics


class _HugeHead(nn.Module):
    """Four small blocks and a 20,000-word head: the head's logits and the loss's backward dwarf the rest."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)])
        self.head = nn.Linear(16, 20_000)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(self.blocks(x)), y)


def test_the_head_and_loss_bind_a_huge_vocabulary():
    torch.manual_seed(0)
    model = _HugeHead()
    x, y = torch.randn(64, 16), torch.randint(0, 20_000, (64,))
    plan = plan_remat(model, lambda m: m(x, y), "min", cost="flops")
    binding = plan.binding
    assert binding["term"] == "head and loss" and binding["peak_bytes"] == plan.predicted_peak_bytes
    # The logits (64 x 20,000 floats, 4.9 MiB) and their gradient: the term's own bytes are most of it.
    assert binding["own_bytes"] >= 2 * 64 * 20_000 * 4 and binding["largest"] == "own"
    assert binding["static_bytes"] + binding["stored_bytes"] + binding["own_bytes"] == binding["peak_bytes"]
    assert "what binds: the head and loss (after the last stage)" in plan.summary()
    metrics = plan_metrics(plan)
    assert metrics["remat/binds/head_and_loss"] == 1.0 and metrics["remat/binds/own_bytes"] == binding["own_bytes"]


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    # Wide and shallow, one short sequence: parameters, and AdamW's state and foreach step, dominate.
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=32000, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, 32000, (1, 64))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


_FAKE = dict(fake=True, gpu="h100", device="cuda", precision="bf16-true", cost="flops")


def _least_peak(model, step, **optimizer_settings):
    optimizer = torch.optim.AdamW(model.parameters(), **optimizer_settings)
    return plan_remat(model, step, "min", optimizer=optimizer, **_FAKE).predicted_peak_bytes


@pytest.fixture(scope="module")
def planned():
    """The least peak planned with AdamW as given, fused=True and foreach=False."""
    model, step = _llama()
    return {name: _least_peak(model, step, **settings) for name, settings in
            (("default", {}), ("fused=True", {"fused": True}), ("foreach=False", {"foreach": False}))}


def test_the_optimizer_step_binds_and_its_advice_equals_planning_with_each_setting(planned):
    model, step = _llama()
    plan = plan_remat(model, step, "min", optimizer=torch.optim.AdamW(model.parameters()), **_FAKE)
    binding = plan.binding
    assert binding["term"] == "optimizer step" and binding["largest"] == "static"
    advice = binding["advice"]
    assert set(advice) == {"fused=True", "foreach=False"}
    assert plan.predicted_peak_bytes == planned["default"]
    assert advice["fused=True"] == planned["fused=True"] < plan.predicted_peak_bytes
    assert advice["foreach=False"] == planned["foreach=False"] < plan.predicted_peak_bytes
    assert "the optimizer's step would reach" in plan.summary() and "with fused=True" in plan.summary()
    assert plan_metrics(plan)["remat/binds/optimizer_fused_true_peak_bytes"] == advice["fused=True"]


def test_budget_too_small_names_each_knob_with_the_peak_planning_with_it_gives(planned):
    model, step = _llama()
    least = planned["default"]
    with pytest.raises(BudgetTooSmallError) as caught:
        plan_remat(model, step, least - 2**20, optimizer=torch.optim.AdamW(model.parameters()), **_FAKE)
    error = caught.value
    knobs = {k["knob"]: k for k in error.knobs}
    assert {"fused optimizer", "optimizer without foreach"} <= set(knobs), error.knobs
    assert knobs["fused optimizer"]["fits"] and knobs["fused optimizer"]["peak_bytes"] == planned["fused=True"]
    assert knobs["optimizer without foreach"]["peak_bytes"] == planned["foreach=False"]
    assert "fused optimizer (AdamW(fused=True)) reaches" in str(error)
    # More GPUs: the per-GPU least peak of planning that model sharded over that many (FSDP2, fake).
    assert "more GPUs (FSDP2)" in knobs, error.knobs
    world_size = int(re.search(r"world_size=(\d+)", knobs["more GPUs (FSDP2)"]["setting"]).group(1))
    sharded = plan_remat(model, step, "min", optimizer=torch.optim.AdamW(model.parameters()), world_size=world_size,
                         **_FAKE)
    assert knobs["more GPUs (FSDP2)"]["peak_bytes"] == sharded.predicted_peak_bytes
    assert all(k["peak_bytes"] is None or k["peak_bytes"] < least for k in error.knobs)  # each lowers the peak


def test_cli_json_names_what_binds(capsys, tmp_path):
    from lightning_remat.integrations.cli import main

    path = tmp_path / "factories.py"
    path.write_text("import torch\nfrom torch import nn\n\ndef tiny():\n    torch.manual_seed(0)\n"
                    "    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) "
                    "for _ in range(4)])\n    x = torch.randn(128, 32)\n"
                    "    return model, (lambda m: m(x).square().mean()), torch.optim.Adam(model.parameters())\n")
    code = main(["plan", f"{path}:tiny", "--budget", "min", "--cost", "flops", "--json", "--no-plots"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["binding"] == result["plan"]["binding"]
    assert result["binding"]["term"] in ("stage", "head and loss", "embeddings", "between stages", "optimizer step")
    assert result["binding"]["peak_bytes"] == result["plan"]["predicted_peak_bytes"]
    # A budget no plan meets: the error's knobs (each lowering the least peak) are in the JSON too.
    code = main(["plan", f"{path}:tiny", "--budget", "100kB", "--cost", "flops", "--json", "--no-plots"])
    result = json.loads(capsys.readouterr().out)
    assert code == 1 and isinstance(result["knobs"], list)
    assert all(k["peak_bytes"] is None or k["peak_bytes"] < result["smallest_peak_bytes"] for k in result["knobs"])


def test_a_plan_limited_by_host_memory_says_so():
    from lightning_remat.core.memory_model import Costs, Profile, Segment, StageAction, StageOption, StageProfile
    from lightning_remat.core.offload_model import solve_within_host
    from lightning_remat.core.solve import solve

    keep = StageOption("keep", StageAction("a"), 100, 100)
    off = StageOption("offload", StageAction.offload("a"), 0, 100, Costs(0.1, 1), host_bytes=100)
    whole = StageOption("whole", StageAction.recompute("a"), 10, 120, Costs(1.0, 10))
    profile = Profile((StageProfile("a", (keep, off, whole)),), (Segment("head", 1, 50),))
    assert solve_within_host(profile, 10**9, lambda q: solve(q, 130)).binding["host_limit_bytes"] is None
    limited = solve_within_host(profile, 50, lambda q: solve(q, 130))
    assert limited.checkpointed == ["a"] and limited.binding["host_limit_bytes"] == 50
    assert "offloading limited by host memory (50 B)" in limited.summary()
