"""Planning called from threads: one planning at a time per process (runtime.measuring.exclusive), the
same plans as one after the other, and a thread training a plain model beside it undisturbed."""

import threading

import torch
from torch import nn

from lightning_remat import plan_remat
from lightning_remat.core.errors import RematError

SHAPES = {"narrow": (128, 4), "wide": (256, 6)}  # hidden width, blocks: different plans under "min"


def _mlp(width: int, blocks: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, 32)) for _ in range(blocks)])


def _plan(name: str) -> tuple:
    width, blocks = SHAPES[name]
    model = _mlp(width, blocks)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    plan = plan_remat(model, lambda m: m(x).square().mean(), "min", cost="flops")
    return tuple(plan.checkpointed), plan.predicted_peak_bytes


def _in_threads(jobs: dict) -> tuple[dict, dict]:
    results, errors = {}, {}

    def run(name):
        try:
            results[name] = jobs[name]()
        except BaseException as error:  # noqa: BLE001 - the test reports what each thread raised
            errors[name] = error

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a planning thread hung"
    return results, errors


def test_concurrent_planning_returns_the_sequential_plans():
    sequential = {name: _plan(name) for name in SHAPES}
    assert sequential["narrow"][0] != sequential["wide"][0]  # a swapped or mixed-up profile would show
    for _ in range(8):  # rounds of racing threads (each of the 436 calls of the original report raced too)
        results, errors = _in_threads({name: (lambda name=name: _plan(name)) for name in SHAPES})
        assert all(isinstance(e, RematError) for e in errors.values()), errors  # never a crash of MemTracker
        assert {name: results[name] for name in results} == {name: sequential[name] for name in results}
        assert results, "every thread failed"


def _train(steps: int, losses: list, started: threading.Event | None = None, until: threading.Event | None = None,
           during: list | None = None) -> None:
    """A plain model trained on its own generator's batches: its losses depend on nothing global."""
    model = _mlp(64, 2, seed=3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    batches = torch.Generator().manual_seed(5)
    while len(losses) < steps or (until is not None and not until.is_set()):
        loss = model(torch.randn(16, 32, generator=batches)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if started is not None:
            started.set()
        if during is not None and until is not None and not until.is_set():
            during.append(len(losses))


def test_a_thread_training_beside_planning_keeps_its_losses():
    side, during, started, planned, died = [], [], threading.Event(), threading.Event(), []

    def side_thread():
        try:
            _train(300, side, started, planned, during)
        except BaseException as error:  # noqa: BLE001 - reported below
            died.append(error)
            started.set()

    trainer = threading.Thread(target=side_thread)
    trainer.start()
    started.wait(timeout=60)
    plans = [_plan("narrow") for _ in range(3)]
    planned.set()
    trainer.join(timeout=120)
    assert not died, died  # planning's trackers never see the side thread's modules
    assert during and len(side) >= 300, "the side thread trained no step while planning ran"
    alone = []
    _train(len(side), alone)
    assert side == alone  # every loss, bit for bit: MemTracker's global hooks skip the side thread's model
    assert plans[0] == plans[1] == plans[2] == _plan("narrow")


def test_planning_a_model_another_thread_runs_inference_on():
    """Before: planning's module hooks (the profile's observer, the chained-call probe) ran on the other
    thread's forwards too: ``KeyError`` in the observer, a profile counting its calls. Now they act on
    the planning's own forwards only: that thread's outputs are unchanged and the plan is the one made alone."""
    width, blocks = SHAPES["narrow"]
    model = _mlp(width, blocks)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    stop, outputs, died = threading.Event(), [], []

    def infer():
        try:
            while not stop.is_set() or not outputs:
                with torch.no_grad():
                    outputs.append(torch.equal(model(x), expected))
        except BaseException as error:  # noqa: BLE001 - reported below
            died.append(error)

    thread = threading.Thread(target=infer)
    thread.start()
    try:
        plans = [plan_remat(model, lambda m: m(x).square().mean(), "min", cost="flops") for _ in range(2)]
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not died, died
    assert outputs and all(outputs)
    alone = _plan("narrow")
    assert all((tuple(p.checkpointed), p.predicted_peak_bytes) == alone for p in plans)
