"""The one channel between ranks: a single process, plain functions standing in for other ranks, a
Lightning strategy, and two real gloo processes (values and an error that reaches every rank)."""

import sys
import time

import pytest
import torch

from lightning_remat.core.errors import BudgetTooSmallError, PlanningFailedError
from lightning_remat.service.channel import Channel, torch_distributed_channel, travelling
from tests.function_channel import FunctionChannel


def test_a_single_process_talks_to_itself_and_raises_errors_as_they_are():
    single = torch_distributed_channel()
    assert type(single) is Channel and (single.rank, single.world_size, single.is_main, single.distributed) == (
        0, 1, True, False)
    assert single.broadcast({"plan": 1}) == {"plan": 1} and single.gather("x") == ["x"]
    assert single.max(3) == 3.0 and single.any(True) and not single.any(False)
    assert single.from_main(lambda: 7) == 7 and single.on_every_rank(lambda: 8) == [8]

    def bad():
        raise TypeError("bad step")

    with pytest.raises(TypeError, match="bad step"):  # nothing travels: the error itself
        single.from_main(bad)
    with pytest.raises(TypeError, match="bad step"):
        single.on_every_rank(bad)
    error = BudgetTooSmallError(100, 150, 80)
    with pytest.raises(BudgetTooSmallError, match=r"\(AutoRemat\)$"):
        single.from_main(lambda: (_ for _ in ()).throw(error), hint="(AutoRemat)")


def test_errors_travel_as_ours_or_as_a_planning_failure_naming_rank_and_type():
    ours = BudgetTooSmallError(1, 2)
    assert travelling(ours, rank=3) is ours
    other = travelling(KeyError("k"), rank=1, action="profiling")
    assert isinstance(other, PlanningFailedError) and str(other) == "profiling failed on rank 1: KeyError: 'k'"
    oom = travelling(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"), rank=1)
    assert oom.out_of_memory and str(oom).startswith("out of memory on rank 1")


def test_another_ranks_error_is_raised_here_and_this_ranks_from_its_original():
    boom = PlanningFailedError("profiling failed on rank 1: RuntimeError: boom")
    other_failed = FunctionChannel(gather=lambda value: [value, (None, boom)])
    assert other_failed.world_size == 2 and other_failed.distributed
    with pytest.raises(PlanningFailedError, match="rank 1: RuntimeError: boom"):
        other_failed.on_every_rank(lambda: 1)
    both_fine = FunctionChannel(gather=lambda value: [value, (2, None)])
    assert both_fine.on_every_rank(lambda: 1) == [1, 2]

    def bad():
        raise ValueError("no batch")

    with pytest.raises(PlanningFailedError, match="profiling failed on rank 0: ValueError: no batch") as raised:
        both_fine.on_every_rank(bad)
    assert isinstance(raised.value.__cause__, ValueError)  # the user's own error stays in the chain
    # Not rank 0: rank 0's decision (or error) arrives by broadcast.
    listening = FunctionChannel(broadcast=lambda value: (None, BudgetTooSmallError(1, 2)), is_main=False)
    with pytest.raises(BudgetTooSmallError):
        listening.from_main(lambda: pytest.fail("only rank 0 computes"))


def _two_ranks(rank):
    import faulthandler

    faulthandler.dump_traceback_later(60, exit=True)  # a rank left waiting in a collective ends the test
    channel = torch_distributed_channel()
    result = {"rank": channel.rank, "world": channel.world_size, "main": channel.is_main,
              "broadcast": channel.broadcast(f"from rank {rank}"), "gather": channel.gather(rank * 10),
              "max": channel.max(100.0 + rank), "any": channel.any(rank == 1),
              "on_every_rank": channel.on_every_rank(lambda: rank + 1)}

    def fails_on_rank_1():
        if rank == 1:
            result["raised_at"] = sys._getframe().f_lineno + 1
            raise ValueError("bad batch on rank 1")
        return "profiled"

    start = time.perf_counter()
    try:
        channel.on_every_rank(fails_on_rank_1)
    except Exception as error:  # noqa: BLE001 - the test compares what each rank raised
        result["error"] = [type(error).__name__, str(error), type(error.__cause__).__name__]
    result["seconds"] = time.perf_counter() - start

    def rank_0_decides():
        raise BudgetTooSmallError(100, 150)

    try:
        channel.from_main(rank_0_decides, hint="(test)")
    except BudgetTooSmallError as error:
        result["decided"] = [str(error), error.smallest_peak_bytes]
    faulthandler.cancel_dump_traceback_later()
    return result


@pytest.mark.distributed
def test_two_gloo_ranks_share_values_and_every_rank_raises_one_ranks_error(tmp_path):
    from tests.gloo_ranks import spawn

    ranks = spawn(_two_ranks, tmp_path)
    for rank, result in enumerate(ranks):
        assert (result["rank"], result["world"], result["main"]) == (rank, 2, rank == 0)
        assert result["broadcast"] == "from rank 0" and result["gather"] == [0, 10]
        assert result["max"] == 101.0 and result["any"] is True and result["on_every_rank"] == [1, 2]
        assert result["seconds"] < 10
        assert result["decided"][1] == 150 and result["decided"][0].endswith("(test)")
    # Rank 0 reads rank 1's error and the line of the user's code that raised it.
    line = _two_ranks.__code__.co_firstlineno
    assert ranks[0]["error"][:2] == ranks[1]["error"][:2] == [
        "PlanningFailedError", "profiling failed on rank 1: ValueError: bad batch on rank 1 "
        f"(at {__file__}:{ranks[1]['raised_at']} in fails_on_rank_1)"] and ranks[1]["raised_at"] > line
    # Where it happened, the user's error is the cause; elsewhere it travelled as its type and message.
    assert (ranks[1]["error"][2], ranks[0]["error"][2]) == ("ValueError", "NoneType")
    assert ranks[0]["decided"] == ranks[1]["decided"]
