"""Planning without the hardware: fake-tensor profiles agree with real ones and plan a 7B model here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_remat import BudgetTooSmallError, plan_remat, profile_step, solve
from lightning_remat import FakeProfileError
from lightning_remat.core.memory_model import predict_peak
from lightning_remat.models import build
from tests.tiny_hf import shallow_resnet

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "gpt2": dict(layers=3, hidden=64, seq_len=64, batch_size=4),
    "bert": dict(layers=3, hidden=64, seq_len=64, batch_size=4),
    "vit": dict(layers=3, hidden=64, image_size=32, batch_size=8),
    # ResNet-50's layout with 2 + 2 bottlenecks (BatchNorm, convolutions, the stem): its 16 took 8-20 s
    "resnet": dict(depths=(2, 2), batch_size=2, image_size=32, width=4),
    "llama": dict(layers=3, hidden=64, seq_len=64, batch_size=4),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_fake_profile_equals_the_real_one_and_plans_the_same(name):
    case = shallow_resnet(**MODELS[name]) if name == "resnet" else build(name, **MODELS[name])
    optimizer = torch.optim.Adam(case.model.parameters())
    real = profile_step(case.model, case.step, optimizer=optimizer)
    fake = profile_step(case.model, case.step, optimizer=optimizer, fake=True)
    # The real model is untouched by the fake profile.
    assert all(type(p) is nn.Parameter and p.device.type == "cpu" for p in case.model.parameters())
    assert [s.name for s in fake.stages] == [s.name for s in real.stages]
    for real_stage, fake_stage in zip(real.stages, fake.stages):
        assert real_stage.saved_bytes == pytest.approx(fake_stage.saved_bytes, rel=0.01)
        for a, b in zip(real_stage.options, fake_stage.options):
            assert (a.name, a.action, a.costs.flops) == (b.name, b.action, b.costs.flops)
            assert a.stored_bytes == pytest.approx(b.stored_bytes, rel=0.01, abs=1024)
            assert a.local_peak_bytes == pytest.approx(b.local_peak_bytes, rel=0.01)
    assert fake.baseline_peak_bytes == pytest.approx(real.baseline_peak_bytes, rel=0.01)
    assert fake.static_bytes == real.static_bytes
    for fraction in (0.3, 0.5, 0.7):
        budget = int(real.static_bytes + fraction * real.baseline_activation_bytes)
        try:
            expected = solve(real, budget, cost="flops")
        except BudgetTooSmallError:
            with pytest.raises(BudgetTooSmallError):
                solve(fake, budget, cost="flops")
            continue
        got = solve(fake, budget, cost="flops")
        assert got.checkpointed == expected.checkpointed
        assert got.predicted_peak_bytes == pytest.approx(expected.predicted_peak_bytes, rel=0.01)
    expected_min = solve(real, "min", cost="flops")
    assert predict_peak(fake, [0] * len(fake.stages)) == fake.baseline_peak_bytes
    assert solve(fake, "min", cost="flops").predicted_peak_bytes == pytest.approx(expected_min.predicted_peak_bytes, rel=0.01)


def test_a_7b_llama_is_planned_for_an_80gb_gpu_without_allocating_it():
    # Llama-2-7B's published sizes, fewer layers to keep the suite quick (the benchmark runs all 32).
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "plan_llama7b.py"), "--layers", "2", "--json"],
                         capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["max_resident_bytes"] < 2 * 2**30
    plan = result["plan"]
    # 2 layers of 7B sizes (202 M parameters each) plus embeddings and head (131 M each): 667 M
    # parameters of 2 bytes in bf16.
    assert plan["parameter_bytes"] == 2 * (2 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 32000 * 4096 + 4096)
    # AdamW: two tensors a parameter, and a 4-byte step counter for each of the 21 parameter tensors.
    assert plan["optimizer_state_bytes"] == 2 * plan["parameter_bytes"] + 21 * 4
    assert plan["budget_bytes"] == int(0.9 * 80e9)
    summary = result["summary"]
    for word in ("parameters", "gradients", "optimizer state", "activations", "GiB"):
        assert word in summary


def test_a_budget_larger_than_the_device_is_an_error():
    case = build("mlp", depth=2, width=16, batch_size=4)
    with pytest.raises(ValueError, match="larger than the device's memory"):
        plan_remat(case.model, case.step, "100GB", fake=True, device="cuda", device_memory="80GB", cost="flops")


def test_an_unknown_gpu_is_an_error_that_lists_the_known_ones():
    case = build("mlp", depth=2, width=16, batch_size=4)
    with pytest.raises(ValueError, match="unknown GPU 'h1000'.*h100"):
        profile_step(case.model, case.step, fake=True, gpu="h1000")
    with pytest.raises(ValueError, match="fake"):
        profile_step(case.model, case.step, gpu="h100")


class ReadsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])

    def forward(self, x):
        if x.abs().max().item() > 1e6:  # data-dependent Python control flow
            x = x / 2
        return self.blocks(x)


def test_code_that_needs_real_values_is_named():
    model = ReadsValues()
    x = torch.randn(4, 8)
    with pytest.raises(FakeProfileError, match="_local_scalar_dense") as raised:
        profile_step(model, lambda m: m(x).sum(), fake=True)
    # ...and so is the line that needs them (the model's forward here), as a user looks for it.
    line = ReadsValues.forward.__code__.co_firstlineno + 1
    assert f"test_fake.py:{line} in forward" in str(raised.value)


def test_the_command_line_plans_on_fake_tensors(capsys):
    from lightning_remat.integrations.cli import main

    target = f"{ROOT / 'examples' / 'factories.py'}:gpt2"
    code = main(["plan", target, "--fake", "--cost", "flops", "--device", "cuda", "--device-memory", "16GB",
                 "--budget", "min", "--json", "--no-plots"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device"] == "cuda" and result["plan"]["checkpointed"]
    assert main(["plan", target, "--gpu", "h100", "--json"]) == 2
    assert main(["plan", target, "--fake", "--device-memory", "1GB", "--budget", "2GB", "--cost", "flops"]) == 2


def test_a_cuda_target_prices_the_batched_optimizer_step_cuda_runs():
    # torch's Adam takes its foreach step on CUDA (a copy of all parameters in temporaries) and a
    # per-tensor loop on the CPU; a plan for CUDA must count the former.
    case = build("gpt2", layers=2, hidden=64, seq_len=32, batch_size=2)
    optimizer = torch.optim.AdamW(case.model.parameters())
    on_cpu = profile_step(case.model, case.step, optimizer=optimizer, fake=True)
    on_cuda = profile_step(case.model, case.step, optimizer=optimizer, fake=True, device="cuda")
    step_segment = {p.device: next(s for s in p.segments if s.name == "optimizer step") for p in (on_cpu, on_cuda)}
    extra = step_segment["cuda"].peak_bytes - step_segment["cpu"].peak_bytes
    parameters = sum(p.numel() * p.element_size() for p in case.model.parameters())
    # At least the foreach temporaries' copy of the parameters, less the loop's copy of the largest one.
    largest = max(p.numel() * p.element_size() for p in case.model.parameters())
    assert extra >= parameters - 2 * largest > 0
    assert on_cuda.optimizer_state_bytes == on_cpu.optimizer_state_bytes


def test_fake_planning_models_the_precision_and_says_which():
    case = build("gpt2", layers=2, hidden=64, seq_len=32, batch_size=2)
    optimizer = torch.optim.AdamW(case.model.parameters())
    plans = {precision: plan_remat(case.model, case.step, "min", optimizer=optimizer, cost="flops", fake=True,
                                   precision=precision) for precision in ("32-true", "bf16-mixed", "bf16-true")}
    full, mixed, pure = plans["32-true"], plans["bf16-mixed"], plans["bf16-true"]
    # Mixed precision keeps float32 parameters, gradients and AdamW moments: 16 bytes per parameter.
    assert (mixed.parameter_bytes, mixed.gradient_bytes, mixed.optimizer_state_bytes) == \
        (full.parameter_bytes, full.gradient_bytes, full.optimizer_state_bytes)
    assert pure.parameter_bytes * 2 == full.parameter_bytes and pure.gradient_bytes * 2 == full.gradient_bytes
    assert "precision bf16-mixed: parameters, gradients and optimizer state in float32, the step under bfloat16 autocast" \
        in mixed.summary()
    assert "precision bf16-true" in pure.summary()
    with pytest.raises(ValueError, match="precision must be one of"):
        plan_remat(case.model, case.step, "min", cost="flops", fake=True, precision="bf16")
    with pytest.raises(ValueError, match="apply to fake profiles"):
        plan_remat(case.model, case.step, "min", precision="bf16-mixed")


def test_a_gpu_target_runs_attention_dropout_in_the_fused_kernel_the_gpu_uses():
    """On the CPU, SDPA with dropout takes its math path and saves the score and probability
    matrices; a GPU's fused kernels run the dropout and save only the output and its log-sum-exp.
    Planned for a GPU, GPT-2 with attention dropout stores what it stores without dropout (plus the
    kernel's random seed and offset), and the quadratic matrices only when planned for the CPU."""
    from lightning_remat import ProfileOptions

    original = torch.nn.functional.scaled_dot_product_attention

    def keep_bytes(dropout, **options):
        case = build("gpt2", layers=1, hidden=64, seq_len=256, batch_size=2)
        case.model.config.attn_pdrop = dropout
        for module in case.model.modules():
            if hasattr(module, "attn_dropout"):
                module.attn_dropout.p = dropout
        profile = profile_step(case.model, case.step, options=ProfileOptions(fake=True, **options))
        return profile.stages[0].option("keep").stored_bytes

    scores = 2 * 4 * 256 * 256 * 4  # batch x heads x seq x seq, float32
    on_gpu, without_dropout = keep_bytes(0.1, device="cuda"), keep_bytes(0.0, device="cuda")
    assert without_dropout <= on_gpu <= without_dropout + 1024
    assert keep_bytes(0.1, gpu="h100") == on_gpu
    assert keep_bytes(0.1) >= on_gpu + 2 * scores  # the CPU's math path: scores and probabilities
    assert torch.nn.functional.scaled_dot_product_attention is original  # put back after profiling


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_fake_planning_leaves_the_model_and_optimizer_as_they_were_and_plans_again(device):
    """A fake plan works on a twin: the model keeps its parameter objects (a meta model's were
    once replaced by fake ones, and the optimizer then held parameters the model no longer had)."""
    with torch.device(device):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)) for _ in range(3)],
                              nn.LayerNorm(32))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 32)
    before = {name: (id(p), type(p), p.device.type) for name, p in model.named_parameters()}
    buffers = {name: id(b) for name, b in model.named_buffers()}
    held = [id(p) for group in optimizer.param_groups for p in group["params"]]

    def plan():
        return plan_remat(model, lambda m: m(x).square().mean(), "min", optimizer=optimizer, cost="flops",
                          fake=True, verbose=False)

    first = plan()
    assert {name: (id(p), type(p), p.device.type) for name, p in model.named_parameters()} == before
    assert {name: id(b) for name, b in model.named_buffers()} == buffers
    assert [id(p) for group in optimizer.param_groups for p in group["params"]] == held and not optimizer.state
    second = plan()
    assert second.to_dict() == first.to_dict()
