"""The trackers keep MemTracker's overall figures while skipping its per-module peak scan."""

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_remat.models import build
from lightning_remat.runtime.measuring.tracking import PeakOnlyTracker, SegmentTracker, Tracker, snapshot_by_category


def _peak_and_current(tracker_class, case):
    case.model.zero_grad(set_to_none=True)
    tracker = tracker_class()
    tracker.track_external(case.model)
    with tracker:
        loss = case.step(case.model)
        loss.backward()
        del loss
    cpu = torch.device("cpu")
    return (snapshot_by_category(tracker.get_tracker_snapshot("peak"), cpu),
            snapshot_by_category(tracker.get_tracker_snapshot("current"), cpu), tracker)


def test_overall_peak_split_equals_memtrackers():
    case = build("gpt2", layers=2, batch_size=2, seq_len=32)
    peak, current, _ = _peak_and_current(MemTracker, case)
    ours_peak, ours_current, _ = _peak_and_current(Tracker, case)
    assert peak == ours_peak and current == ours_current
    assert peak["Total"] > peak["Parameter"] > 0


def test_segment_tracker_still_records_segment_peaks():
    case = build("mlp", depth=3, batch_size=16, width=16)
    modules = dict(case.model.named_modules())
    tracker = SegmentTracker({id(modules[str(i)]): i for i in range(3)}, torch.device("cpu"))
    tracker.track_external(case.model)
    with tracker:
        case.step(case.model).backward()
    peak = snapshot_by_category(tracker.get_tracker_snapshot("peak"), torch.device("cpu"))["Total"]
    assert max(tracker.segment_peaks.values()) == peak
    assert {kind for kind, _ in tracker.segment_peaks} == {"fw", "bw", "gap"}


def test_a_step_may_call_its_top_level_module_twice():
    """MemTracker refuses a top-level module's second forward in one block; a step that runs the
    model twice (two backward passes under manual optimization, a discriminator on two batches) is
    counted like two calls of a submodule: the same peak as the tracker without module bookkeeping."""
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
    x = torch.randn(8, 16)
    peaks = []
    for tracker in (Tracker(), PeakOnlyTracker()):
        net.zero_grad(set_to_none=True)
        tracker.track_external(net)
        with tracker:
            net(x).sum().backward()
            net(x * 2).sum().backward()
        peaks.append(snapshot_by_category(tracker.get_tracker_snapshot("peak"), torch.device("cpu"))["Total"])
    assert peaks[0] == peaks[1] > 0


def _steady_peaks_of_a_sharded_step(rank: int, steps: int) -> dict:
    import threading

    from lightning_remat.runtime.measuring import tracking
    from lightning_remat.runtime.measuring.measure import measure_step
    from tests.gloo_ranks import after_case, shard_gpt2, small_gpt2

    elsewhere, this_thread, update = [], threading.get_ident(), tracking.Tracker._update_snap

    def noted(self, kind, winfo, *args, **kwargs):  # a storage counted or freed outside the step's thread
        if threading.get_ident() != this_thread:
            elsewhere.append([str(kind), winfo.mem_consumed])
        return update(self, kind, winfo, *args, **kwargs)

    tracking.Tracker._update_snap = noted
    after_case(lambda: setattr(tracking.Tracker, "_update_snap", update))
    case = small_gpt2()
    shard_gpt2(case.model)
    optimizer = torch.optim.Adam(case.model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    measure_step(case.model, lambda m: m(input_ids=ids, labels=ids).loss, optimizer)  # Adam's state
    peaks = [measure_step(case.model, lambda m: m(input_ids=ids, labels=ids).loss, optimizer).peak_bytes
             for _ in range(steps)]
    return dict(peaks=peaks, elsewhere=elsewhere)


@pytest.mark.distributed
def test_a_sharded_steps_peak_does_not_depend_on_when_the_gloo_worker_lets_go(tmp_path):
    # FSDP2's reduce-scatter input is held by the collective's work, which gloo's worker thread drops
    # after the step has moved on: without the tracker holding it until the worker is done, it died
    # in the worker whenever it got there, and steady peaks varied by up to its size (1 step in 2).
    from tests.gloo_ranks import spawn

    for rank in spawn(_steady_peaks_of_a_sharded_step, tmp_path, 12):
        assert rank["elsewhere"] == []
        assert len(set(rank["peaks"])) == 1, rank["peaks"]


def test_a_fake_sharded_steps_collectives_are_not_held_for_a_worker_that_does_not_exist(monkeypatch):
    # A fake process group's collectives hold no tensor and have no worker thread: waiting for one to
    # let go of them waited the whole _WORKER_WAIT_S (0.5 s) for every collective of a fake profile.
    from torch import nn

    from lightning_remat.runtime.measuring import tracking
    from lightning_remat.runtime.targets.fake import fake_model, new_fake_mode
    from lightning_remat.runtime.targets.sharded import fake_process_group, shard_model

    def sleep(seconds):
        raise AssertionError("the tracker waited for a fake collective's worker")

    works, is_fake = [], tracking._is_fake
    monkeypatch.setattr(tracking.time, "sleep", sleep)
    monkeypatch.setattr(tracking, "_is_fake", lambda w: works.append(is_fake(w)) or works[-1])
    mode = new_fake_mode()
    net = fake_model(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), mode)
    with fake_process_group(4) as mesh:
        shard_model(net, ["0", "1"], mesh, mode)
        with mode:
            x = torch.randn(4, 8)
        tracker = Tracker()
        tracker.track_external(net)
        with tracker:
            net(x).sum().backward()
    assert len(works) >= 6 and all(works)  # all-gathers in forward and backward, reduce-scatters
