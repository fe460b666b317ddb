"""The one step runner and the one peak meter: every caller runs a step the same way, and the same
step is measured the same way whoever measures it."""

import pytest
import torch
from torch import nn

from lightning_remat.runtime.measuring.measure import PeakWindow, measure_step
from lightning_remat.core.plan import Plan
from lightning_remat.runtime.measuring.meter import PeakMeter
from lightning_remat.runtime.measuring.runner import StepWatch, run_step
from lightning_remat.runtime.measuring.trial import run_trial


def _net():
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)) for _ in range(3)])


def test_a_trial_a_measured_step_and_a_hook_window_give_the_same_peak():
    net, x = _net(), torch.randn(16, 32)
    optimizer = torch.optim.Adam(net.parameters())
    step = lambda m: m(x.clone()).square().mean()  # the batch made inside the step: every meter counts it
    measure_step(net, step, optimizer)  # Adam's state exists, as in every later step
    measured = measure_step(net, step, optimizer).peak_bytes
    trial = run_trial(net, step, optimizer, 16, Plan(), 2, measured, 0)
    net.zero_grad(set_to_none=True)
    window = PeakWindow(net, optimizer)  # as the Lightning callback and the Accelerate session open it
    loss = step(net)
    loss.backward()
    optimizer.step()
    del loss
    assert trial.fits and trial.measured_peak_bytes == measured == window.close()


def test_the_runner_calls_the_watch_around_each_pass_in_order():
    seen = []

    class Recorder(StepWatch):
        def watching(self):
            return _noting(seen, "step")

        def forward(self):
            return _noting(seen, "forward")

        def backward(self):
            return _noting(seen, "backward")

        def backward_done(self):
            seen.append("backward done")

    net = nn.Linear(4, 4)
    net.weight.grad = torch.ones_like(net.weight)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    optimizer.register_step_pre_hook(lambda *args: seen.append("optimizer"))
    loss = run_step(net, lambda m: m(torch.ones(2, 4)).sum(), optimizer, watch=Recorder(), zero_grad="before",
                    read_loss=True)
    assert seen == ["step", "forward", "/forward", "backward", "/backward", "backward done", "optimizer", "/step"]
    assert isinstance(loss, float) and net.weight.grad is not None
    run_step(net, lambda m: m(torch.ones(2, 4)).sum(), zero_grad="after")
    assert net.weight.grad is None
    with pytest.raises(TypeError, match="must return the scalar loss tensor, got Tensor of shape"):
        run_step(net, lambda m: m(torch.ones(2, 4)), check=True)


def test_a_failed_step_leaves_no_tracker_behind():
    stance = lambda: torch._dynamo.eval_frame._stance.stance
    net = nn.Linear(4, 4)
    meter = PeakMeter(net)

    def fails(m):
        m(torch.ones(2, 4))
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        run_step(net, fails, watch=meter)
    assert stance() == "default"  # the tracker was left: compiled code compiles again
    assert meter.peak_bytes > 0 and meter.reserved_bytes is None


class _noting:
    def __init__(self, seen, name):
        self.seen, self.name = seen, name

    def __enter__(self):
        self.seen.append(self.name)

    def __exit__(self, *exc):
        self.seen.append("/" + self.name)


def test_on_cuda_every_measured_peak_is_the_allocators(monkeypatch):
    """The budget means ``max_memory_allocated`` on CUDA: the measured step (and so every trial) and
    the window the integrations open read it, with ``max_memory_reserved`` beside it."""
    from lightning_remat.runtime.measuring import meter as meter_module

    resets = []
    monkeypatch.setattr(meter_module, "model_device", lambda model: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2048)
    net = nn.Linear(4, 4)
    window = PeakWindow(net, None)
    assert (window.close(), window.reserved_bytes, window.tracker) == (1000, 2048, None)
    measured = measure_step(net, lambda m: m(torch.ones(2, 4)).sum())
    assert (measured.peak_bytes, measured.reserved_bytes) == (1000, 2048)
    assert resets == [torch.device("cuda", 0)] * 2
