"""chunk_loss's fused kind (issue 31): a causal LM's head and loss over sequence chunks, each chunk's gradients
computed in forward, nothing recomputed in backward.

Every parameter's gradient equals the model's own loss's (plain, tied embeddings, a frozen head, label smoothing,
``num_items_in_batch``, ``shift_labels``, a loss scaled before backward, bf16 autocast); a fused plan's measured
peak (torch's allocator events) is its prediction within 1%; the planner prices the fused kind without recompute
FLOPs and picks it over the recomputed one at an equal peak, and keeps the head whole where recomputing a layer
is cheaper; Gemma-2's logit soft-capping is computed in the chunks of either kind; a model whose loss neither kind
computes (Granite's logit scaling, a masked LM) is not offered either, with a note.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_remat import CausalLMLoss, apply_plan, profile_step, remove_remat, solve
from lightning_remat.core.actions import StageAction
from lightning_remat.core.head_cost import HeadShape
from lightning_remat.core.memory_model import Costs, Profile, Segment, StageOption, StageProfile
from lightning_remat.core.plan import Plan
from lightning_remat.models import build
from lightning_remat.runtime.profiling.loss_stage import HeadFigures, with_head_stage
from tests.torch_meter import steady_peak

SIZES = dict(batch_size=2, seq_len=48, layers=2, hidden=32, vocab=512)


def _fused(chunks: int = 3) -> Plan:
    return Plan(actions=[StageAction.fuse("lm_head", chunks)])


def _loss_and_grads(model, ids, labels, scale=1.0, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kwargs)
    (out.loss * scale).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(model, ids, labels, scale=1.0, rtol=1e-5, atol=1e-7, **kwargs):
    plain, expected = _loss_and_grads(model, ids, labels, scale, **kwargs)
    apply_plan(model, _fused())
    try:
        out, grads = _loss_and_grads(model, ids, labels, scale, **kwargs)
    finally:
        remove_remat(model)
    assert out.logits is None and plain.logits is not None
    torch.testing.assert_close(out.loss, plain.loss, rtol=rtol, atol=atol)
    assert grads.keys() == expected.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], expected[n], rtol=rtol, atol=atol, msg=n)
    return grads


def _batch(vocab=SIZES["vocab"]):
    ids = torch.randint(0, vocab, (2, SIZES["seq_len"]), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :10] = -100  # padding: no loss there
    return ids, labels


@pytest.mark.parametrize("name", ["gpt2", "llama"])  # GPT-2 ties its head to its embeddings
@pytest.mark.parametrize("num_items, scale", [(None, 1.0), (77, 0.5)])
def test_fused_loss_and_gradients_equal_the_models_own(name, num_items, scale):
    """``scale``: a loss multiplied before backward (gradient accumulation): the kept gradients are scaled by it."""
    model = build(name, **SIZES).model.eval()  # no dropout: both runs the same
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    grads = _compare(model, *_batch(), scale, **kwargs)
    if name == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight and "transformer.wte.weight" in grads


def test_a_frozen_head_gets_no_gradient_and_the_rest_the_models_own():
    """A LoRA-like head (requires_grad False): only the hidden's gradient is kept."""
    model = build("llama", **SIZES).model.eval()
    model.lm_head.weight.requires_grad_(False)
    grads = _compare(model, *_batch())
    assert "lm_head.weight" not in grads and "model.norm.weight" in grads


def test_label_smoothing_and_shift_labels_are_the_models_own():
    model = build("llama", **SIZES).model.eval()
    model.loss_function = CausalLMLoss(label_smoothing=0.1)
    ids, labels = _batch()
    _compare(model, ids, labels)
    shifted = torch.roll(labels, -1, dims=-1)  # given shifted: the loss uses them as they are
    shifted[:, -1] = -100
    _compare(model, ids, labels, shift_labels=shifted)


def test_under_bf16_autocast_the_gradients_are_the_models_own_computed_alike():
    model = build("llama", **SIZES).model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _compare(model, *_batch(), rtol=2e-2, atol=2e-3)


def test_a_second_backward_and_evaluation_see_what_the_model_computes():
    model = build("gpt2", **SIZES).model.eval()
    ids, labels = _batch()
    _, expected = _loss_and_grads(model, ids, labels)
    apply_plan(model, _fused(4))
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss.backward()  # the kept gradients are scaled out of place: the second adds the same again
    for n, p in model.named_parameters():
        torch.testing.assert_close(first[n], expected[n], rtol=1e-5, atol=1e-6, msg=n)
        assert torch.equal(p.grad, 2 * first[n]), n
    with torch.no_grad():  # evaluation: the model's own loss over full logits
        evaluated = model(input_ids=ids, labels=labels)
    remove_remat(model)
    assert evaluated.logits is not None and evaluated.loss is not None



def test_a_fused_plan_is_measured_in_the_profile_and_predicted_within_one_percent():
    case = build("llama", batch_size=2, seq_len=64, layers=2, hidden=32, vocab=2048)
    model, optimizer = case.model, torch.optim.AdamW(case.model.parameters())
    profile = profile_step(model, case.step, optimizer=optimizer, chunk_loss=True, warmup=0)
    head = profile.stages[-1]
    assert [o.name for o in head.options] == ["keep", *(f"chunks:{k}" for k in (2, 4, 8, 16, 32)),
                                              *(f"fused:{k}" for k in (2, 4, 8, 16, 32))]
    fused = [o for o in head.options if o.action.action == "fuse"]
    assert all(o.costs.flops == o.action.chunks for o in fused)  # no recompute FLOPs, one per chunk to rank them
    assert min(o.local_peak_bytes for o in fused) < head.options[0].local_peak_bytes
    # Fused options only: the least peak planned with them, applied and measured.
    only = replace(profile, stages=(*profile.stages[:-1], replace(head, options=(head.options[0], *fused))))
    plan = solve(only, "min", cost="flops")
    assert plan.fused_loss and plan.chunked_loss == plan.fused_loss
    assert "fused over sequence chunks" in plan.summary()
    apply_plan(model, plan)
    measured = steady_peak(model, case.step, optimizer)
    remove_remat(model)
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * measured


def _priced(head_peaks: dict[str, int], layer_cost: float) -> Profile:
    """A layer (recomputed: stores 100 B, costs ``layer_cost`` s) and a Llama-3-8B-wide frozen head at 4K tokens."""
    keep = StageOption("keep", StageAction("h.0"), 1000, 1000)
    whole = StageOption("whole", StageAction.recompute("h.0"), 100, 1100, Costs(layer_cost, 10**12, layer_cost))
    profile = Profile((StageProfile("h.0", (keep, whole)),), (Segment("between stages (1 stored)", 1, 5000),),
                      baseline_costs=Costs(time=1.0, flops=10**15))
    shape = HeadShape(tokens=4096, hidden=4096, vocab=128256, compute_bytes=2, param_bytes=2, trains=False)
    figures = HeadFigures("lm_head", 1, shape, 5000, {8: head_peaks["chunks"]}, {8: head_peaks["fused"]})
    return with_head_stage(profile, figures, 989e12, 3.35e12)  # an H100's dense bf16 FLOP/s and bandwidth


@pytest.mark.parametrize("cost", ["flops", "roofline"])
def test_the_planner_picks_fused_over_recomputed_chunks_at_an_equal_peak(cost):
    profile = _priced({"chunks": 2000, "fused": 2000}, layer_cost=1e-3)
    options = {o.name: o for o in profile.stages[-1].options}
    # Recomputed: the projection's 4.3 TFLOP and the loss's logits-sized work again; fused: its gradients' copies.
    assert options["chunks:8"].costs.roofline > 100 * options["fused:8"].costs.roofline > 0
    plan = solve(profile, 3000, cost=cost)  # only a chunked head reaches it
    assert plan.fused_loss == {"lm_head": 8} and plan.predicted_peak_bytes == 3000


def test_the_head_is_kept_whole_where_recomputing_a_layer_is_cheaper_and_suffices():
    # Recomputing the layer costs 0.01 ms; the fused head 0.04 ms on the roofline (its 512-token chunks are
    # compute-bound, so re-reading the weight per chunk is hidden: only its gradients' copy and scaling cost).
    profile = _priced({"chunks": 2000, "fused": 2000}, layer_cost=1e-5)
    plan = solve(profile, 5100, cost="roofline")
    assert not plan.chunked_loss and plan.checkpointed == ["h.0"]
    # Where the layer costs more than the fused head, the head is fused instead.
    plan = solve(_priced({"chunks": 2000, "fused": 2000}, layer_cost=1e-2), 5100, cost="roofline")
    assert plan.fused_loss and not plan.checkpointed


@pytest.mark.parametrize("kind", [StageAction.chunk, StageAction.fuse])
def test_gemma2s_logit_soft_capping_is_computed_in_the_chunks(kind):
    import transformers

    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_hidden_layers=2, vocab_size=256, final_logit_softcapping=3.0, use_cache=False)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # logits at the cap: capped or not, the losses differ
    ids, labels = _batch(vocab=256)
    plain, expected = _loss_and_grads(model, ids, labels)
    with torch.no_grad():  # the head's own output passes the cap: the model's loss is over capped logits
        assert plain.logits.abs().max() < 3.0 < model.lm_head(model.model(input_ids=ids).last_hidden_state).abs().max()
    apply_plan(model, Plan(actions=[kind("lm_head", 3)]))
    out, grads = _loss_and_grads(model, ids, labels)
    remove_remat(model)
    torch.testing.assert_close(out.loss, plain.loss, rtol=1e-6, atol=1e-6)
    for n in expected:
        torch.testing.assert_close(grads[n], expected[n], rtol=1e-5, atol=1e-6, msg=n)


def test_a_loss_neither_kind_computes_is_not_offered_and_the_profile_says_why():
    import transformers

    granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
        vocab_size=256, logits_scaling=4.0, use_cache=False)).train()
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2, vocab_size=256)).train()
    ids = torch.randint(0, 256, (1, 16))
    for model, why in ((granite, "logits_scaling=4.0"), (bert, "masked LM")):
        with pytest.warns(UserWarning, match=why):
            profile = profile_step(model, lambda m: m(input_ids=ids, labels=ids).loss, chunk_loss=True, warmup=0)
        assert not any(o.action.chunks for s in profile.stages for o in s.options)
        assert any(why in note and "kept whole" in note for note in profile.notes)


def test_a_fused_plan_under_inductor_gives_the_models_own_loss_and_gradients():
    """``chunk_loss=True`` at the least peak chooses the fused head; the planned model compiled with inductor (on
    the CPU) computes the plain model's loss and every parameter's gradient, twice (the second call compiled)."""
    case = build("llama", batch_size=2, seq_len=64, layers=2, hidden=32, vocab=2048)
    model = case.model
    ids, labels = _batch(2048)
    ids, labels = ids[:, :48], labels[:, :48]
    plain, expected = _loss_and_grads(model, ids, labels)
    profile = profile_step(model, case.step, chunk_loss=True, warmup=0)
    plan = solve(profile, "min", cost="flops")
    assert plan.fused_loss, plan.summary()
    apply_plan(model, plan)
    try:
        compiled = torch.compile(model, backend="inductor")
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            out = compiled(input_ids=ids, labels=labels)
            out.loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            torch.testing.assert_close(out.loss, plain.loss, rtol=1e-5, atol=1e-6)
            assert grads.keys() == expected.keys()
            for n in grads:
                torch.testing.assert_close(grads[n], expected[n], rtol=1e-4, atol=1e-6, msg=n)
    finally:
        remove_remat(model)
        torch._dynamo.reset()
