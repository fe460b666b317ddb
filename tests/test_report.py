"""The memory report against torch's MemTracker, and the plots as real PNG files."""

import io
import json
import math

import matplotlib.image
import pytest
import torch
from rich.console import Console
from torch import nn

from lightning_remat.runtime.measuring.measure import measure_step
from lightning_remat.runtime.profiling.profile import profile_step
from lightning_remat.report.breakdown import memory_breakdown
from lightning_remat.report.plots import pareto_figure, pareto_sweep, save_figure, timeline_figure
from lightning_remat.report.breakdown import MemoryTimeline, memory_timeline
from lightning_remat.core.solve import least_peak, solve
from lightning_remat.core.plan import Plan, StageAction


def _chain(depth=4, width=32, batch=256):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                            for _ in range(depth)]).train()
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    return model, (lambda m: nn.functional.mse_loss(m(x), y))


def _png_shape(path):
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(str(path)).shape


def test_breakdown_matches_memtracker_of_a_real_second_step():
    model, step = _chain()
    optimizer = torch.optim.Adam(model.parameters())
    out = io.StringIO()
    report = memory_breakdown(model, step, optimizer, console=Console(file=out, width=120))
    # Nothing was changed: no optimizer state, no gradients.
    assert not optimizer.state and all(p.grad is None for p in model.parameters())

    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report.parameter_bytes == param_bytes
    assert report.gradient_bytes == param_bytes
    assert report.optimizer_state_counted_ahead
    # The state Adam will create: two tensors per parameter (plus its step counters).
    assert 2 * param_bytes <= report.optimizer_state_bytes <= 2 * param_bytes + 1024

    # A real training step creates the state; the second step is the steady state the report describes.
    measure_step(model, step, optimizer)
    measured = measure_step(model, step, optimizer)
    assert report.parameter_bytes == measured.parameter_bytes
    assert report.optimizer_state_bytes == measured.optimizer_bytes
    assert measured.gradient_bytes <= report.gradient_bytes
    assert report.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.03)
    assert report.static_bytes == 4 * param_bytes + report.optimizer_state_bytes - 2 * param_bytes

    # Activations: what forward keeps for backward dominates this step; the blocks are ranked by it.
    assert report.activation_bytes > 0 and report.temporary_bytes >= 0
    assert report.saved_activation_bytes > 0
    assert [m.name for m in report.top_modules] == ["0", "1", "2", "3"]
    assert report.top_modules[0].saved_bytes >= report.top_modules[-1].saved_bytes
    assert sum(m.share for m in report.top_modules) == pytest.approx(1.0)
    # The split at the forward/backward peak adds up to that peak.
    at_peak = report.at_peak
    parts = sum(v for k, v in at_peak.items() if k != "Total")
    assert parts == report.forward_backward_peak_bytes
    assert report.forward_backward_peak_bytes <= report.peak_bytes

    text = out.getvalue()
    assert "optimizer state (created by the first step)" in text and "saved for backward" in text
    json.dumps(report.to_dict())


def test_a_fake_profiles_breakdown_shows_the_activations_it_planned_and_they_match_a_real_one():
    from lightning_remat.report.breakdown import breakdown_from_profile

    model, step = _chain()
    optimizer = torch.optim.Adam(model.parameters())
    fake = breakdown_from_profile(profile_step(model, step, optimizer=optimizer, fake=True), None, True)
    real = memory_breakdown(model, step, optimizer, show=False)
    # Nothing ran, yet the split is the memory model's: activations stored, adding up to the peak it explains.
    # (The model counts as stored what earlier stages keep; the binding stage's own is with its temporaries.)
    assert 0.5 * real.activation_bytes <= fake.activation_bytes <= real.activation_bytes
    assert sum(fake.at_peak.values()) == fake.forward_backward_peak_bytes <= fake.peak_bytes
    assert fake.forward_backward_peak_bytes == pytest.approx(real.forward_backward_peak_bytes, rel=0.05)
    assert fake.at_peak["Optstate"] == fake.optimizer_state_bytes and any("memory model" in n for n in fake.notes)


def test_breakdown_without_optimizer_has_no_state():
    model, step = _chain()
    report = memory_breakdown(model, step, show=False)
    assert report.optimizer_state_bytes == 0 and not report.optimizer_state_counted_ahead
    assert report.peak_bytes == pytest.approx(measure_step(model, step).peak_bytes, rel=0.05)


def test_timeline_rises_in_forward_falls_in_backward_and_the_plan_lowers_it(tmp_path):
    model, step = _chain()
    before = memory_timeline(model, step)
    after = memory_timeline(model, step, Plan([StageAction.recompute(n) for n in ("0", "1", "2", "3")]))
    for t in (before, after):
        assert t.backward_start is not None and 0 < t.backward_start < len(t.bytes_after_op)
        forward = t.bytes_after_op[:t.backward_start]
        assert forward[-1] > forward[0]  # activations accumulate
        assert t.bytes_after_op[-1] < t.peak_bytes  # and are freed in backward
    assert after.peak_bytes < before.peak_bytes
    assert len(after.bytes_after_op) > len(before.bytes_after_op)  # the recomputed operators
    # The recorded series peaks where MemTracker's own peak is.
    assert before.peak_bytes == measure_step(model, step).peak_bytes

    png = save_figure(timeline_figure([before, after], "chain"), tmp_path / "timeline.png")
    height, width, _ = _png_shape(png)
    assert width >= 600 and height >= 300


def test_timeline_counts_the_optimizer_state_ahead():
    model, step = _chain(depth=2, batch=64)
    optimizer = torch.optim.Adam(model.parameters())
    with_state = memory_timeline(model, step, optimizer=optimizer)
    without = memory_timeline(model, step)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert with_state.peak_bytes - without.peak_bytes >= 2 * param_bytes
    assert not optimizer.state


def test_a_peak_no_plan_lowers_is_one_budget_row_not_ten_equal_ones():
    from lightning_remat.core.memory_model import Costs, Profile, Segment, StageOption, StageProfile

    keep = StageOption("keep", StageAction("a"), 100, 150)
    whole = StageOption("whole", StageAction.recompute("a"), 10, 160, Costs(1.0, 5))
    bound_by_optimizer = Profile((StageProfile("a", (keep, whole)),) * 2, (Segment("optimizer step", 0, 900),),
                                 baseline_peak_bytes=900, baseline_costs=Costs(flops=100))
    assert [(p.budget_bytes, p.predicted_peak_bytes, p.modules) for p in pareto_sweep(bound_by_optimizer, 10)] == [
        (900, 900, 0)]


def test_the_pareto_picture_draws_the_predicted_plans_where_they_are_and_no_line_above_them():
    from lightning_remat.core.memory_model import Costs, Profile, Segment, StageOption, StageProfile

    keep = StageOption("keep", StageAction("a"), 100 * 2**20, 150 * 2**20)
    whole = StageOption("whole", StageAction.recompute("a"), 10 * 2**20, 160 * 2**20, Costs(1.0, 5))
    profile = Profile((StageProfile("a", (keep, whole)),) * 3, (Segment("head", 3, 50 * 2**20),),
                      baseline_peak_bytes=350 * 2**20, baseline_costs=Costs(flops=100))
    figure = pareto_figure(pareto_sweep(profile, 10, "flops"), profile.baseline_peak_bytes, "flops",
                           solve(profile, 300 * 2**20, cost="flops"), measured_peak_bytes=290 * 2**20)
    ax = figure.axes[0]
    sweep = {(round(p.predicted_peak_bytes / 2**20, 6), round(100 * p.predicted_overhead, 6))
             for p in pareto_sweep(profile, 10) if p.feasible}
    swept = next(c for c in ax.collections if "budget sweep" in c.get_label())
    assert {(round(x, 6), round(y, 6)) for x, y in swept.get_offsets()} == sweep
    # The only lines are the budget, the baseline and the measured plans joined: none spans the sweep.
    assert all(len(set(line.get_xdata())) <= 1 or line.get_label().startswith("_") for line in ax.lines)


def test_pareto_sweep_and_plot(tmp_path):
    model, step = _chain()
    profile = profile_step(model, step)
    sweep = pareto_sweep(profile, points=6, cost="flops")
    assert len(sweep) == 6 and all(p.feasible for p in sweep)
    assert sweep[0].predicted_peak_bytes == least_peak(profile)
    assert sweep[-1].predicted_overhead == 0.0 and sweep[-1].modules == 0
    overheads = [p.predicted_overhead for p in sweep]
    assert overheads == sorted(overheads, reverse=True)  # more memory never costs more
    assert all(p.predicted_peak_bytes <= p.budget_bytes for p in sweep)
    least = solve(profile, sweep[0].budget_bytes, cost="flops")
    png = save_figure(pareto_figure(sweep, profile.baseline_peak_bytes, "flops", least, least.predicted_peak_bytes),
                      tmp_path / "pareto.png")
    height, width, _ = _png_shape(png)
    assert width >= 500 and height >= 300
    assert not math.isnan(sweep[0].predicted_overhead)


def test_the_breakdown_table_shares_add_up_to_100_and_its_parts_to_their_total():
    from lightning_remat.report.render import breakdown_table, percent_shares, to_text

    model, step = _chain()
    report = memory_breakdown(model, step, torch.optim.Adam(model.parameters()), show=False)
    assert "Total" not in report.at_peak and sum(report.at_peak.values()) == report.forward_backward_peak_bytes
    cells = [line.split("│")[4].strip() for line in to_text([breakdown_table(report)]).splitlines()
             if line.count("│") == 5]
    rows = [cell for cell in cells if cell.endswith("%")]
    shares = [int(cell[:-1]) for cell in rows]
    # One row per kind of memory, then the forward/backward peak at 100%: the kinds add up to it.
    assert shares[-1] == 100 and sum(shares[:-1]) == 100, rows
    assert percent_shares([1, 1, 1]) == ["34%", "33%", "33%"] and percent_shares([0, 0]) == ["-", "-"]
    assert all(sum(int(s[:-1]) for s in percent_shares(parts)) == 100
               for parts in ([5, 5, 5, 5, 5, 5, 1], [999, 1, 1], [3, 7, 11, 13]))


def test_timeline_plot_draws_the_budget_and_marks_the_measured_peak():
    from lightning_remat.report.plots import pyplot

    plt = pyplot()
    timelines = [MemoryTimeline("no recomputation", [2**20, 5 * 2**20, 2**20], 2),
                 MemoryTimeline("plan", [2**20, 3 * 2**20, 2**20], 2)]
    fig = timeline_figure(timelines, "one training step", budget_bytes=4 * 2**20)
    ax = fig.axes[0]
    budget = [line for line in ax.get_lines() if list(line.get_ydata()) == [4.0, 4.0]]
    assert budget and "budget 4.00 MiB" in budget[0].get_label()
    texts = [t.get_text() for t in ax.texts]
    assert "measured peak 5.00 MiB" in texts and "measured peak 3.00 MiB" in texts
    assert ax.get_title() == "one training step"
    plt.close(fig)


def test_pareto_labels_of_plans_on_the_same_point_are_one_label():
    from benchmarks.pareto_plot import draw_with_peers
    from lightning_remat.report.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots()
    same = (32 * 2**20, 0.275)
    draw_with_peers(ax, [(30 * 2**20, 0.3), (40 * 2**20, 0.1)], [], [("min", *same), ("@ HF peak", *same),
                                                                      ("50%", 36 * 2**20, 0.2)], None, "FLOP overhead (%)")
    assert sorted(t.get_text() for t in ax.texts) == ["50%", "min, @ HF peak"]
    plt.close(fig)
