"""chunk_loss: a causal LM's head and loss over sequence chunks, each recomputed in backward, as a
planned stage (issue 24).

On small Hugging Face causal LMs on the CPU: the chunked loss and every parameter's gradient equal the
model's own (labels shifted, -100 ignored, the mean over valid tokens or the sum over
``num_items_in_batch``); the plan's steady peak, measured by torch's allocator events
(``TorchPeak``), holds the budget and is within 5% of the prediction; a budget reachable only by
chunking is met with ``chunk_loss=True`` and refused without; ``remove_remat`` gives back the exact
model.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_remat import apply_plan, plan_remat, profile_step, remove_remat, solve
from lightning_remat.core.actions import StageAction
from lightning_remat.core.errors import BudgetTooSmallError, UnsupportedSetupError
from lightning_remat.core.plan import Plan
from lightning_remat.core.shared_held import without_shared
from lightning_remat.models import build
from lightning_remat.runtime.installing.chunked_loss import find_head_loss
from tests.torch_meter import steady_peak

# A vocabulary large beside the hidden size: the head and its loss bind the step's peak, as at long context.
SIZES = dict(batch_size=2, seq_len=128, layers=2, hidden=64, vocab=4096)


def _chunked(head: str, chunks: int) -> Plan:
    return Plan(actions=[StageAction.chunk(head, chunks)])


def _loss_and_grads(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks in both runs
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("chunks", [3, 8])
@pytest.mark.parametrize("num_items", [None, 150])
def test_chunked_loss_and_gradients_equal_the_models_own(name, chunks, num_items):
    model = build(name, **SIZES).model
    ids = torch.randint(0, SIZES["vocab"], (2, SIZES["seq_len"]), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :40] = -100  # padding: no loss there
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    plain, expected = _loss_and_grads(model, ids, labels, **kwargs)
    head = find_head_loss(model)
    apply_plan(model, _chunked(head, chunks))
    out, grads = _loss_and_grads(model, ids, labels, **kwargs)
    remove_remat(model)
    assert out.logits is None and plain.logits is not None
    torch.testing.assert_close(out.loss, plain.loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == expected.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], expected[n], rtol=1e-5, atol=1e-7, msg=n)


def test_remove_remat_gives_back_the_exact_model_and_evaluation_keeps_its_logits():
    model = build("llama", **SIZES).model
    keys = list(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    ids = torch.randint(0, SIZES["vocab"], (1, 32))
    apply_plan(model, _chunked("lm_head", 4))
    assert "forward" in model.__dict__ and "forward" in model.lm_head.__dict__
    with torch.no_grad():  # evaluation: the model's own loss over full logits, logits returned
        evaluated = model(input_ids=ids, labels=ids)
    assert evaluated.logits.shape == (1, 32, SIZES["vocab"]) and evaluated.loss is not None
    assert model(input_ids=ids).logits.shape == (1, 32, SIZES["vocab"])  # no labels: logits as before
    remove_remat(model)
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())


def test_a_plan_with_a_chunked_head_survives_its_dict_and_refuses_what_is_not_a_head():
    plan = _chunked("lm_head", 8)
    assert Plan.from_dict(plan.to_dict()) == plan and plan.chunked_loss == {"lm_head": 8}
    with pytest.raises(ValueError, match="lm_head"):
        apply_plan(build("llama", **SIZES).model, _chunked("model.norm", 8))
    with pytest.raises(ValueError, match="chunks"):
        StageAction("lm_head", "chunk", chunks=0)



def test_a_budget_only_chunking_reaches_is_met_with_chunk_loss_and_refused_without():
    case = build("llama", **SIZES)
    model, optimizer = case.model, torch.optim.AdamW(case.model.parameters())
    plain = solve(profile_step(model, case.step, optimizer=optimizer), "min", cost="flops")
    chunked = profile_step(model, case.step, optimizer=optimizer, chunk_loss=True)
    assert [o.name for o in chunked.stages[-1].options] == ["keep", *(f"{kind}:{k}" for kind in ("chunks", "fused")
                                                                      for k in (2, 4, 8, 16, 32))]
    least = solve(chunked, "min", cost="flops").predicted_peak_bytes
    # The head's "keep" is the gap it ran in: without its chunked options the profile plans as one made without them.
    unchunked = replace(chunked, stages=tuple(replace(s, options=tuple(o for o in s.options if not o.action.chunks))
                                              for s in chunked.stages))
    assert solve(unchunked, "min", cost="flops").predicted_peak_bytes == plain.predicted_peak_bytes
    assert least < 0.8 * plain.predicted_peak_bytes  # the head and loss bound the least peak
    budget = (least + plain.predicted_peak_bytes) // 2
    with pytest.raises(BudgetTooSmallError) as refused:
        plan_remat(model, case.step, budget, optimizer=optimizer)
    # The error names the knob that reaches the budget, with the least peak planning with it gives.
    knob = {k["knob"]: k for k in refused.value.knobs}["chunked loss"]
    assert knob["setting"] == "chunk_loss=True" and knob["fits"] and knob["peak_bytes"] == least
    plan = plan_remat(model, case.step, budget, optimizer=optimizer, chunk_loss=True)
    assert plan.chunked_loss and plan.predicted_peak_bytes <= budget
    apply_plan(model, plan)
    measured = steady_peak(model, case.step, optimizer)
    remove_remat(model)
    assert measured <= budget
    assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * measured


def test_without_a_causal_lm_head_chunk_loss_changes_nothing():
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)])
    x = torch.randn(8, 16)
    with pytest.warns(UserWarning, match="Sequential has no causal LM head"):
        with_it = profile_step(net, lambda m: m(x).square().mean(), chunk_loss=True, warmup=0)
    assert [s.name for s in with_it.stages] == ["0", "1", "2"]
    assert any("nothing is chunked" in n for n in with_it.notes)  # said, as for a masked LM


def test_fake_planning_chunks_the_head_of_a_model_on_the_meta_device():
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=4096, use_cache=False)
    ids = torch.randint(0, 4096, (1, 512))

    def least_peak(chunk_loss):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config).train()
        return plan_remat(model, lambda m: m(input_ids=ids, labels=ids).loss, "min",
                          optimizer=torch.optim.AdamW(model.parameters()), cost="flops", fake=True, device="cuda",
                          gpu="h100", precision="bf16-true", device_memory="80GB", chunk_loss=chunk_loss)

    plain, plan = least_peak(False), least_peak(True)
    assert plan.chunked_loss and plan.predicted_peak_bytes < plain.predicted_peak_bytes


def test_a_model_that_changes_its_logits_after_the_head_is_refused():
    import transformers

    # Granite divides its logits after the head (Gemma-2's soft-capping is computed in the chunks: test_fused_loss).
    config = transformers.GraniteConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                        num_key_value_heads=1, num_hidden_layers=1, vocab_size=256,
                                        logits_scaling=4.0, use_cache=False)
    model = transformers.GraniteForCausalLM(config).train()
    ids = torch.randint(0, 256, (1, 16))
    apply_plan(model, _chunked("lm_head", 2))
    with pytest.raises(UnsupportedSetupError, match="changes them"):
        model(input_ids=ids, labels=ids)
    remove_remat(model)


def test_every_entry_point_takes_chunk_loss(monkeypatch):
    from lightning_remat import AutoRemat, RematTrainerCallback
    from lightning_remat.accelerate import RematPlugin
    from lightning_remat.integrations.cli import _parser

    assert AutoRemat(budget="min", chunk_loss=True).config.profile.chunk_loss
    assert RematTrainerCallback(budget="1GB", chunk_loss=True).remat_plugin.config().profile.chunk_loss
    monkeypatch.setenv("ACCELERATE_REMAT_CHUNK_LOSS", "yes")
    assert RematPlugin(budget="1GB").config().profile.chunk_loss
    monkeypatch.setenv("ACCELERATE_REMAT_CHUNK_LOSS", "maybe")
    with pytest.raises(ValueError, match="ACCELERATE_REMAT_CHUNK_LOSS"):
        RematPlugin(budget="1GB")
    assert _parser().parse_args(["plan", "f.py:g", "--chunk-loss"]).chunk_loss


def test_the_hf_trainer_chunks_the_loss_with_the_same_losses_under_accumulation(tmp_path, monkeypatch):
    import transformers

    from lightning_remat import RematTrainerCallback
    from lightning_remat.accelerate import ENV_BUDGET
    from tests.test_hf_trainer import _train

    def model():  # a vocabulary large beside the hidden size: the head and loss bind
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64,
                                                                    vocab_size=4096))

    monkeypatch.delenv(ENV_BUDGET, raising=False)
    # The Trainer passes num_items_in_batch under accumulation: the chunked loss divides by it too.
    _, plain, plain_losses = _train(tmp_path, accumulation=2, model=model())
    callback = RematTrainerCallback(budget="min", chunk_loss=True)
    _, peaks, losses = _train(tmp_path, callback, accumulation=2, model=model())
    assert callback.plan.chunked_loss
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    assert max(peaks.peaks) < 0.8 * max(plain.peaks)
    assert abs(max(peaks.peaks) - callback.plan.predicted_peak_bytes) <= 0.05 * max(peaks.peaks)


def test_the_summary_says_the_head_is_chunked():
    plan = Plan(actions=[StageAction("h.0"), StageAction.chunk("lm_head", 8)], predicted_peak_bytes=2**20,
                baseline_peak_bytes=2**21, budget_bytes=2**20, predicted_overhead=0.01)
    assert "lm_head in 8 chunks" in plan.summary()


def test_the_head_stage_of_a_deep_fake_profile_is_extrapolated_exactly(monkeypatch):
    import transformers

    from lightning_remat.runtime.profiling import repeated

    # Extrapolated from 4 and 5 layers to 6: one layer past the fit already shows a figure off its line.
    monkeypatch.setattr(repeated, "MIN_LAYERS", 6)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=1, num_hidden_layers=6, vocab_size=1024, use_cache=False)
    ids = torch.randint(0, 1024, (1, 64))
    profiles = []
    for repeated in (True, False):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config).train()
        profiles.append(profile_step(model, lambda m: m(input_ids=ids, labels=ids).loss, fake=True, device="cuda",
                                     gpu="h100", precision="bf16-true", chunk_loss=True, repeated_blocks=repeated,
                                     optimizer=torch.optim.AdamW(model.parameters())))
    extrapolated, full = profiles
    assert any("extrapolated" in note for note in extrapolated.notes)
    # The extrapolation counts an input every layer holds in each holder (core.shared_held): compared so.
    additive = without_shared(full)
    assert extrapolated.stages[-1].name == "lm_head" and extrapolated.stages == additive.stages
    assert extrapolated.segments == additive.segments


class _TinyLM(torch.nn.Module):
    """A language model of its own (not Hugging Face's): it names its head and loss with head_loss."""

    def __init__(self, vocab=4096, hidden=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
                                                              torch.nn.Linear(2 * hidden, hidden)) for _ in range(2))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, labels):
        from lightning_remat import head_loss

        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return head_loss(self.head, x, labels)


def test_a_model_of_its_own_names_its_head_and_loss_with_head_loss():
    torch.manual_seed(0)
    model = _TinyLM()
    ids = torch.randint(0, 4096, (2, 256), generator=torch.Generator().manual_seed(1))
    step = lambda m: m(ids, ids)  # noqa: E731
    expected_loss = step(model)
    expected_loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters())
    plan = plan_remat(model, step, "min", optimizer=optimizer, chunk_loss=True)
    assert set(plan.chunked_loss) == {"head"}
    apply_plan(model, plan)
    model.zero_grad(set_to_none=True)
    loss = step(model)
    loss.backward()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-7, msg=n)
    measured = steady_peak(model, step, optimizer)
    remove_remat(model)
    assert "forward" not in model.head.__dict__
    assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * measured


@pytest.mark.slow  # dynamo traces a forward and a backward (aot_eager): 6-18 s on a busy 2-core CPU
def test_under_torch_compile_the_head_is_not_planned_in_chunks_and_a_chunked_head_traces_in_one_graph():
    """A step that runs compiled gets no chunk options (inductor fuses the chunks back: their eager
    figures do not hold), with a warning and a note; a chunked head applied by hand traces into the
    model's graph (no graph break: the labels reach the head without a ContextVar there) and gives
    eager's gradients."""
    from torch._dynamo.utils import counters

    case = build("llama", **SIZES)
    model, optimizer = case.model, torch.optim.AdamW(case.model.parameters())
    with pytest.warns(UserWarning, match="torch.compile"):
        profile = profile_step(torch.compile(model), case.step, optimizer=optimizer, chunk_loss=True)
    assert not any(o.action.chunks for s in profile.stages for o in s.options)
    assert any("chunk_loss" in note for note in profile.notes)
    ids = torch.randint(0, SIZES["vocab"], (2, SIZES["seq_len"]), generator=torch.Generator().manual_seed(1))
    _, expected = _loss_and_grads(model, ids, ids)
    apply_plan(model, _chunked(find_head_loss(model), 4))
    torch._dynamo.reset()
    counters["graph_break"].clear()
    # Graph breaks are dynamo's (the backend does not change them); "aot_eager" traces forward and
    # backward as inductor would get them, without inductor's minutes of code generation.
    compiled = torch.compile(model, backend="aot_eager")
    _, grads = _loss_and_grads(compiled, ids, ids)
    grads = {n.removeprefix("_orig_mod."): g for n, g in grads.items()}
    remove_remat(model)
    assert sum(counters["graph_break"].values()) == 0
    for n in expected:
        torch.testing.assert_close(grads[n], expected[n], rtol=1e-4, atol=1e-6, msg=n)



# Issue 29: the chunked loss is the model's loss as called at run time, or refused; nothing of ours stays.
SMALL = dict(batch_size=2, seq_len=32, layers=2, hidden=32, vocab=256)


def _smoothed(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **_):
    """A loss_function of the user's own (label smoothing): no chunked loss computes it."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab_size), shifted.reshape(-1),
                                             ignore_index=ignore_index, label_smoothing=0.1)


@pytest.mark.parametrize("num_items", [None, 40])
def test_label_smoothing_through_causal_lm_loss_is_chunked_exactly(num_items):
    from lightning_remat import CausalLMLoss

    model = build("gpt2", **SMALL).model
    model.loss_function = CausalLMLoss(label_smoothing=0.1)
    assert find_head_loss(model) is not None
    ids = torch.randint(0, SMALL["vocab"], (2, SMALL["seq_len"]), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    plain, expected = _loss_and_grads(model, ids, labels, **kwargs)
    model.loss_function = _smoothed  # CausalLMLoss is that loss: the same figures
    own, _ = _loss_and_grads(model, ids, labels)
    if num_items is None:
        torch.testing.assert_close(own.loss, plain.loss)
    model.loss_function = CausalLMLoss(label_smoothing=0.1)
    apply_plan(model, _chunked("lm_head", 4))
    out, grads = _loss_and_grads(model, ids, labels, **kwargs)
    remove_remat(model)
    assert out.logits is None
    torch.testing.assert_close(out.loss, plain.loss, rtol=1e-6, atol=1e-6)
    for n in expected:
        torch.testing.assert_close(grads[n], expected[n], rtol=1e-5, atol=1e-7, msg=n)


def test_a_loss_function_set_after_planning_is_refused_at_its_first_chunked_step():
    """Before: the chunked head computed the plain cross-entropy in place of the model's label-smoothed
    loss (gradients off by up to 1e-1 here). Now the step raises, naming the loss; evaluation still runs."""
    model = build("gpt2", **SMALL).model
    ids = torch.randint(0, SMALL["vocab"], (2, SMALL["seq_len"]))
    apply_plan(model, _chunked("lm_head", 4))
    model.loss_function = _smoothed
    with pytest.raises(UnsupportedSetupError, match="_smoothed.*CausalLMLoss"):
        model(input_ids=ids, labels=ids)
    with torch.no_grad():  # evaluation: the model's own loss over full logits
        model.eval()
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, _smoothed(model(input_ids=ids).logits, ids, 256))
    remove_remat(model)


def test_a_model_with_a_loss_of_its_own_is_not_chunked_and_the_profile_says_why():
    case = build("gpt2", **SMALL)
    case.model.loss_function = _smoothed
    assert find_head_loss(case.model) is None
    with pytest.warns(UserWarning, match="_smoothed.*kept whole"):
        profile = profile_step(case.model, case.step, chunk_loss=True, warmup=0)
    assert not any(o.action.chunks for s in profile.stages for o in s.options)
    assert any("_smoothed" in note for note in profile.notes)


def test_head_loss_takes_label_smoothing_and_chunks_it_exactly():
    torch.manual_seed(0)
    model = _TinyLM(vocab=256)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    from lightning_remat import head_loss

    step = lambda m: head_loss(m.head, m.embed(ids), ids, shift=False, label_smoothing=0.2)  # noqa: E731
    expected_loss = step(model)
    plain = torch.nn.functional.cross_entropy(model.head(model.embed(ids)).reshape(-1, 256), ids.reshape(-1),
                                              label_smoothing=0.2)
    torch.testing.assert_close(expected_loss, plain)
    expected_loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    apply_plan(model, _chunked("head", 4))
    loss = step(model)
    loss.backward()
    remove_remat(model)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    for n in expected:
        torch.testing.assert_close(model.get_parameter(n).grad, expected[n], rtol=1e-5, atol=1e-7, msg=n)


def test_remove_remat_leaves_every_module_exactly_as_it_was_after_planning_and_training():
    """Before: the head kept ``_remat_pending_loss`` (None) in its ``__dict__`` after a chunked step."""
    case = build("gpt2", **SMALL)
    model, optimizer = case.model, torch.optim.SGD(case.model.parameters(), lr=0.01)
    before = {n: sorted(m.__dict__) for n, m in model.named_modules()}
    hooks = {n: [len(getattr(m, h)) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")]
             for n, m in model.named_modules()}
    plan = plan_remat(model, case.step, "min", optimizer=optimizer)
    # The head and loss do not bind this small model: chunked by hand, beside the planned recompute.
    apply_plan(model, Plan(actions=[*(a for a in plan.actions if a.stage != "lm_head"), StageAction.chunk("lm_head", 4)]))
    assert plan.checkpointed and "forward" in model.lm_head.__dict__
    for _ in range(2):
        optimizer.zero_grad()
        case.step(model).backward()
        optimizer.step()
    remove_remat(model)
    assert {n: sorted(m.__dict__) for n, m in model.named_modules()} == before
    assert {n: [len(getattr(m, h)) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")]
            for n, m in model.named_modules()} == hooks
