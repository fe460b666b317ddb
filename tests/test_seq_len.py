"""The longest sequence that fits a budget (``find_remat_seq_len``): real models, real steps, real measurements (CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_remat import BudgetTooSmallError, find_remat_seq_len
from lightning_remat.core.length_fit import LengthFit
from lightning_remat.integrations.cli import main as cli_main
from lightning_remat.models import build
from lightning_remat.runtime.measuring.measure import measure_step
from lightning_remat.runtime.profiling.profile import profile_step
from tests.torch_meter import TorchPeak

warnings.filterwarnings("ignore", category=FutureWarning)
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread for tiny models

VOCAB = 128
FITS = 128  # the budget: a plain step's peak at this many tokens
MULTIPLE = 32


def llama_make_step(seq_len: int):
    ids = torch.randint(0, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
    return lambda model: model(input_ids=ids, labels=ids).loss


def rows_make_step(length: int):
    x = torch.randn(length, 16, generator=torch.Generator().manual_seed(length))
    return lambda model: model(x).square().mean()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))


@pytest.fixture(scope="module")
def llama_search():
    model = build("llama", layers=2, hidden=32, seq_len=FITS, vocab=VOCAB, batch_size=1).model
    optimizer = torch.optim.AdamW(model.parameters())
    measure_step(model, llama_make_step(FITS), optimizer)  # the optimizer's state exists from here on
    budget = measure_step(model, llama_make_step(FITS), optimizer).peak_bytes
    result = find_remat_seq_len(model, llama_make_step, budget, optimizer=optimizer, init_val=64,
                                multiple_of=MULTIPLE, max_seq_len=2048, verbose=False)
    return model, optimizer, budget, result


def test_the_longest_length_runs_for_real_within_the_budget(llama_search):
    model, optimizer, budget, result = llama_search
    assert result.seq_len > FITS  # recomputation buys length
    assert result.seq_len % MULTIPLE == 0 and result.measured_peak_bytes <= budget
    peaks = []
    for i in range(2):  # the plan is installed (apply=True); the second step is steady
        meter = TorchPeak(model, optimizer).start()
        llama_make_step(result.seq_len)(model).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peaks.append(meter.stop())
    assert peaks[1] <= budget, (peaks, budget)
    assert abs(peaks[1] - result.plan.predicted_peak_bytes) <= 0.01 * budget


def test_the_first_length_past_it_is_over_the_budget_and_what_binds_is_named(llama_search):
    _, _, budget, result = llama_search
    assert result.first_failing == result.seq_len + MULTIPLE
    answer, failing = result.row(result.seq_len), result.row(result.first_failing)
    assert answer.fits and answer.least_peak_bytes <= budget
    assert not failing.fits and failing.least_peak_bytes > budget
    assert result.binding["term"] and result.failing_binding["term"]
    lengths = [r.seq_len for r in result.tried]
    assert lengths == sorted(lengths) and len(lengths) == result.profiles <= 12
    assert [r.seq_len for r in result.tried if r.fits] == [n for n in lengths if n <= result.seq_len]
    text = result.summary()
    assert text.count("what binds:") == 2 and f"{result.first_failing} tokens" in text


def test_bad_input_gives_clear_errors():
    model = mlp()
    with pytest.raises(ValueError, match="multiple_of must be an int >= 1"):
        find_remat_seq_len(model, rows_make_step, "1MB", multiple_of=0)
    with pytest.raises(ValueError, match="max_seq_len must be an int >= 64"):
        find_remat_seq_len(model, rows_make_step, "1MB", max_seq_len=32)
    with pytest.raises(ValueError, match="init_val must be an int >= 1"):
        find_remat_seq_len(model, rows_make_step, "1MB", init_val=-64)
    with pytest.raises(ValueError, match='budget="min" has no meaning for a sequence-length search'):
        find_remat_seq_len(model, rows_make_step, "min")
    with pytest.raises(TypeError, match="unknown option.*'chunkloss'"):
        find_remat_seq_len(model, rows_make_step, "1MB", chunkloss=True)
    with pytest.raises(BudgetTooSmallError, match="below the static memory"):
        find_remat_seq_len(model, rows_make_step, 1000, verbose=False)
    ignoring = lambda n: rows_make_step(64)  # noqa: E731 - a make_step that ignores the length
    with pytest.raises(ValueError, match="ignores the length"):
        find_remat_seq_len(model, ignoring, "1MB", multiple_of=16, verbose=False)


def test_a_budget_no_length_fits_names_the_least_peak_at_the_shortest():
    model = mlp()
    static = profile_step(model, rows_make_step(16)).static_bytes
    with pytest.raises(BudgetTooSmallError, match="No sequence length fits.*at 16 tokens the least peak") as error:
        find_remat_seq_len(model, rows_make_step, static + 64, multiple_of=16, init_val=16, verbose=False)
    assert error.value.smallest_peak_bytes > static + 64


def test_the_parabola_through_three_profiled_lengths_predicts_a_fourth():
    model = mlp()
    profiles = {n: profile_step(model, rows_make_step(n)) for n in (64, 128, 256, 512)}
    predicted = LengthFit({n: profiles[n] for n in (64, 128, 256)}).at(512)
    assert abs(predicted.baseline_peak_bytes - profiles[512].baseline_peak_bytes) <= 0.01 * profiles[512].baseline_peak_bytes
    assert predicted.stages[0].options[0].stored_bytes == pytest.approx(profiles[512].stages[0].options[0].stored_bytes,
                                                                        rel=0.01)


def test_a_fake_search_for_a_gpu_profiles_the_answer_and_runs_nothing():
    model = build("llama", layers=2, hidden=32, seq_len=64, vocab=VOCAB, batch_size=1).model
    result = find_remat_seq_len(model, llama_make_step, "40MB", multiple_of=256, init_val=1024, max_seq_len=2**16,
                                apply=False, verbose=False, fake=True, device="cuda", gpu="h100",
                                precision="bf16-true")
    assert result.measured_peak_bytes is None  # nothing real ran
    assert result.row(result.seq_len).fits and result.row(result.first_failing).least_peak_bytes > result.budget_bytes


def test_the_command_line_prints_the_answer_and_the_lengths_it_profiled(capsys):
    code = cli_main(["seq-len", "examples/factories.py:llama_lengths", "--budget", "5MB", "--multiple-of", "64",
                     "--init-val", "128", "--max-seq-len", "2048"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "longest sequence:" in out and "what binds" in out
    assert "tokens  fits  least peak" in out and " no " in out and " yes " in out
