"""A session lives as long as its model: nothing global holds a model given to ``prepare_remat``,
``RematAccelerator.prepare`` or ``RematTrainerCallback``, nor its optimizer. Before: the session registry (a
``WeakKeyDictionary`` whose value, the session, held its key) and the session's global optimizer pre-hook kept
every such model and optimizer alive to the end of the process."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_pre_hooks

from lightning_remat.accelerate import RematAccelerator, RematPlugin, prepare_remat, remat_session


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)])


def _train(model: nn.Module, optimizer, backward=None, steps: int = 3) -> None:
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        backward(loss) if backward is not None else loss.backward()
        optimizer.step()


def _freed(*refs: weakref.ref) -> list[bool]:
    gc.collect()
    return [ref() is None for ref in refs]


def test_a_model_prepared_by_remat_accelerator_and_its_optimizer_are_freed_when_the_user_drops_them():
    from accelerate.state import AcceleratorState

    def run():
        model = _blocks()
        accelerator = RematAccelerator(cpu=True, remat_plugin=RematPlugin(budget="min", cost="flops"))
        model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters()))
        _train(model, optimizer, accelerator.backward)
        session = remat_session(model)  # after the run, while the user holds the model
        assert session.phase == "done" and session.plan.checkpointed and accelerator.remat_plan is session.plan
        return weakref.ref(model), weakref.ref(optimizer.optimizer), weakref.ref(session), weakref.ref(accelerator)

    def hooks_after_a_session_starts() -> int:  # the global hooks of sessions gone go then (not during a step)
        held = _blocks()
        prepare_remat(held, RematPlugin(budget="1GB"))
        remat_session(held).remove()
        return len(_global_optimizer_pre_hooks)

    gc.collect()  # sessions of earlier tests in this process, gone before this one's
    hooks = hooks_after_a_session_starts()
    try:
        refs = run()
    finally:
        AcceleratorState._reset_state(True)
    assert _freed(*refs) == [True] * 4
    assert hooks_after_a_session_starts() == hooks


def test_a_session_whose_optimizer_came_later_and_a_removed_one_let_go_too():
    def run(remove: bool):
        model = prepare_remat(_blocks(), RematPlugin(budget="min", cost="flops"))
        optimizer = torch.optim.Adam(model.parameters())  # found by the session's global hook at its first step
        _train(model, optimizer)
        session = remat_session(model)
        assert session.phase == "done" and session._optimizer is optimizer
        if remove:
            session.remove()
            assert remat_session(model) is None  # the model's hold on its session was the hook removed
        return weakref.ref(model), weakref.ref(optimizer), weakref.ref(session)

    assert _freed(*run(remove=False)) == [True] * 3
    assert _freed(*run(remove=True)) == [True] * 3


def test_a_model_trained_by_the_trainer_with_the_callback_is_freed():
    transformers = pytest.importorskip("transformers")
    from lightning_remat import RematTrainerCallback

    def run(tmp):
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64)
        ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
        args = transformers.TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=4, max_steps=3, report_to=[], use_cpu=True,
            save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)
        callback = RematTrainerCallback(budget="min", cost="flops")
        trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args,
                                       train_dataset=[{"input_ids": x, "labels": x} for x in ids], callbacks=[callback])
        trainer.train()
        assert callback.plan is not None and remat_session(trainer.model) is callback.session
        return weakref.ref(trainer.model), weakref.ref(trainer.optimizer), weakref.ref(callback.session)

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        refs = run(tmp)
    assert _freed(*refs) == [True] * 3, [sys.getrefcount(r()) for r in refs if r() is not None]


def test_prepare_remat_does_not_import_deepspeed_before_an_engine_can_exist(monkeypatch):
    """Accelerate's ``extract_model_from_parallel`` imports DeepSpeed where installed (2-7 s) to look for its engine;
    none exists before DeepSpeed is imported, so it is not called then (a wrapper is still looked through)."""
    import accelerate.utils

    calls = []
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    monkeypatch.setattr(accelerate.utils, "extract_model_from_parallel", lambda *args, **kwargs: calls.append(args))
    model = _blocks()
    wrapped = prepare_remat(nn.DataParallel(model), RematPlugin(budget="min", cost="flops"))
    _train(wrapped, torch.optim.Adam(model.parameters()))
    session = remat_session(wrapped)
    assert session is remat_session(model) and session.model is model and session.phase == "done"
    assert calls == [] and "deepspeed" not in sys.modules
    session.remove()


def test_a_prepared_model_pickles_and_copies_without_its_session_and_the_copy_trains_as_the_model():
    """``torch.save(model)`` and ``copy.deepcopy(model)`` reach the session through the model's hooks: the copy's
    hooks do nothing (a session holds an optimizer, an accelerator and closures that do not pickle)."""
    import copy
    import io

    model = prepare_remat(_blocks(), RematPlugin(budget="min", cost="flops"))
    _train(model, torch.optim.Adam(model.parameters()))
    session = remat_session(model)
    assert session.phase == "done"
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))  # the planned shape: no new plan
    for twin in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert remat_session(twin) is None and remat_session(model) is session
        twin.zero_grad(set_to_none=True)
        twin(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
    session.remove()
