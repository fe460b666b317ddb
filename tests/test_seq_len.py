"""The longest sequence that fits a budget (``find_remat_seq_len``): real models, real steps, real measurements (CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_remat import BudgetTooSmallError, find_remat_seq_len
from lightning_remat.core.shape_fit import LengthFit
from lightning_remat.integrations.cli import main as cli_main
from lightning_remat.runtime.measuring.measure import measure_step
from lightning_remat.runtime.profiling.profile import profile_step
from tests.torch_meter import TorchPeak

warnings.filterwarnings("ignore", category=FutureWarning)
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread for tiny models

VOCAB = 128
FITS = 128  # the budget: a plain step's peak at this many tokens


def rows_make_step(length: int):
    x = torch.randn(length, 16, generator=torch.Generator().manual_seed(length))
    return lambda model: model(x).square().mean()


class Block(nn.Module):
    """Pre-norm causal self-attention (SDPA) and an MLP, with residuals: a transformer layer in few modules."""

    def __init__(self, width: int):
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, -1)
        x = x + self.out(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(x)


class TinyLM(nn.Module):
    """Embedding, two ``Block``s, a head and the cross-entropy of next-token-like targets: the loss is the output."""

    def __init__(self, width: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def lm_make_step(seq_len: int):
    ids = torch.randint(0, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
    return lambda model: model(ids)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)])


def searched(model, make_step, fits, **kwargs):
    """A search whose budget is the steady peak of a plain step at ``fits`` (the optimizer's state made first)."""
    optimizer = torch.optim.AdamW(model.parameters())
    measure_step(model, make_step(fits), optimizer)
    budget = measure_step(model, make_step(fits), optimizer).peak_bytes
    return optimizer, budget, find_remat_seq_len(model, make_step, budget, optimizer=optimizer, verbose=False, **kwargs)


def measured_peak(model, optimizer, step) -> int:
    """The steady peak of two real steps (the plan installed), by torch's allocator events."""
    peaks = []
    for _ in range(2):
        meter = TorchPeak(model, optimizer).start()
        step(model).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peaks.append(meter.stop())
    return peaks[1]


@pytest.fixture(scope="module")
def rows_search():
    model = mlp()
    return (model, *searched(model, rows_make_step, FITS, init_val=64, multiple_of=16, max_seq_len=4096))


def test_the_longest_length_runs_for_real_within_the_budget(rows_search):
    model, optimizer, budget, result = rows_search
    assert result.seq_len > FITS  # recomputation buys length
    assert result.seq_len % 16 == 0 and result.measured_peak_bytes <= budget
    peak = measured_peak(model, optimizer, rows_make_step(result.seq_len))  # the plan is installed (apply=True)
    assert peak <= budget and abs(peak - result.plan.predicted_peak_bytes) <= 0.01 * budget, (peak, budget)


def test_the_first_length_past_it_is_over_the_budget_and_what_binds_is_named(rows_search):
    _, _, budget, result = rows_search
    assert result.first_failing == result.seq_len + 16
    answer, failing = result.row(result.seq_len), result.row(result.first_failing)
    assert answer.fits and answer.least_peak_bytes <= budget
    assert not failing.fits and failing.least_peak_bytes > budget
    assert result.binding["term"] and result.failing_binding["term"]
    lengths = [r.seq_len for r in result.tried]
    assert lengths == sorted(lengths) and len(lengths) == result.profiles <= 12
    assert [r.seq_len for r in result.tried if r.fits] == [n for n in lengths if n <= result.seq_len]
    text = result.summary()
    assert text.count("what binds:") == 2 and f"{result.first_failing} tokens" in text


def test_a_transformer_at_its_longest_length_holds_the_budget_for_real():
    torch.manual_seed(0)
    model = TinyLM()
    optimizer, budget, result = searched(model, lm_make_step, FITS, init_val=64, multiple_of=32, max_seq_len=2048)
    assert result.seq_len > FITS and result.row(result.first_failing).least_peak_bytes > budget
    peak = measured_peak(model, optimizer, lm_make_step(result.seq_len))
    assert peak <= budget and abs(peak - result.plan.predicted_peak_bytes) <= 0.01 * budget, (peak, budget)


def test_a_short_search_holds_the_budget_for_real_and_the_next_length_does_not_fit():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(2)])
    optimizer, budget, result = searched(model, rows_make_step, 48, init_val=16, multiple_of=16, max_seq_len=96)
    assert result.seq_len > 48 and result.first_failing == result.seq_len + 16
    assert result.row(result.first_failing).least_peak_bytes > budget and result.binding["term"]
    peak = measured_peak(model, optimizer, rows_make_step(result.seq_len))
    assert peak <= budget and abs(peak - result.plan.predicted_peak_bytes) <= 0.01 * budget, (peak, budget)


def test_three_profiles_predict_the_answer_the_full_search_profiles_and_it_holds_for_real(rows_search):
    """``max_profiles=3``: the answer and the length after it are the fit's (rows marked), here (memory linear in
    the rows) the same answer as the search that profiles it, and a real step at it holds the budget."""
    _, _, budget, full = rows_search
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    result = find_remat_seq_len(model, rows_make_step, budget, optimizer=optimizer, init_val=64, multiple_of=16,
                                max_seq_len=4096, max_profiles=3, verbose=False)
    assert full.profiles > 3 and result.profiles == 3 and [r.seq_len for r in result.tried if r.profiled] == [64, 128, 256]
    assert result.seq_len == full.seq_len and result.first_failing == full.first_failing
    assert not result.row(result.seq_len).profiled and not result.row(result.first_failing).fits
    assert result.row(result.first_failing).least_peak_bytes == full.row(full.first_failing).least_peak_bytes
    assert result.measured_peak_bytes <= budget  # confirmed by a real step
    assert "* predicted from the profiled lengths" in result.summary()


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
    with pytest.raises(ValueError, match="max_profiles must be an int >= 3"):
        find_remat_seq_len(model, rows_make_step, "1MB", max_profiles=2)
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
    model = TinyLM()
    result = find_remat_seq_len(model, lm_make_step, "20MB", multiple_of=256, init_val=1024, max_seq_len=2**16,
                                apply=False, verbose=False, fake=True, device="cuda", gpu="h100",
                                precision="bf16-true")
    assert result.measured_peak_bytes is None  # nothing real ran
    assert result.row(result.seq_len).fits and result.row(result.first_failing).least_peak_bytes > result.budget_bytes


FACTORY = """
import torch
from tests.test_seq_len import mlp, rows_make_step

def rows():
    model = mlp()
    return model, rows_make_step, torch.optim.AdamW(model.parameters())
"""


def test_the_command_line_prints_the_answer_and_the_lengths_it_profiled(capsys, tmp_path):
    (tmp_path / "factory.py").write_text(FACTORY)
    code = cli_main(["seq-len", f"{tmp_path / 'factory.py'}:rows", "--budget", "400KB", "--multiple-of", "16",
                     "--init-val", "64", "--max-seq-len", "4096"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "longest sequence:" in out and out.count("what binds") == 3  # the answer, past it, the table's head
    assert "tokens  fits  least peak" in out and " no " in out and " yes " in out
    assert cli_main(["seq-len", f"{tmp_path / 'factory.py'}:rows", "--budget", "min"]) == 2  # a usage error


def test_the_example_finds_a_longer_sequence_and_confirms_it(capsys):
    import runpy
    from pathlib import Path

    example = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "seq_len.py"))
    result, = example["main"](["--fits", "128", "--max-seq-len", "1024"])
    assert result.seq_len > 128 and result.measured_peak_bytes <= result.budget_bytes
    assert "longest sequence:" in capsys.readouterr().out


def test_advice_names_the_knobs_at_the_first_length_that_does_not_fit():
    model = mlp()
    result = find_remat_seq_len(model, rows_make_step, 200_000, optimizer=torch.optim.AdamW(model.parameters()),
                                init_val=64, multiple_of=16, max_seq_len=4096, advice=True, verbose=False)
    knobs = {k["knob"]: k for k in result.failing_knobs}
    # Sharding the parameters and optimizer state over two GPUs (a fake re-profile) fits the next length.
    assert knobs["more GPUs (FSDP2)"]["fits"], result.failing_knobs
    assert knobs["more GPUs (FSDP2)"]["peak_bytes"] < result.row(result.first_failing).least_peak_bytes
    assert f"at {result.first_failing} tokens, more GPUs (FSDP2)" in result.summary()


def test_a_tiled_mlp_is_predicted_at_lengths_whose_chunk_counts_differ():
    """tile_mlp's options are named after their chunk count, which grows with the length ("whole+tile:mlp:4" at 128
    tokens, ":8" at 256): the fit lines them up without it, and predicts the option a profile at the length has."""
    from lightning_remat.core.config import ProfileOptions

    from lightning_remat.models import build

    cases = {n: build("llama", batch_size=1, seq_len=n, layers=2, hidden=16, vocab=64) for n in (64, 128, 256, 512)}
    profiles = {n: profile_step(c.model, c.step, options=ProfileOptions(tile_mlp=True, warmup=0))
                for n, c in cases.items()}
    tiled = lambda p: {o.name: o for o in p.stages[0].options if "tile:" in o.name}  # noqa: E731
    assert set(tiled(profiles[64])) == {"tile:mlp:4", "whole+tile:mlp:4"} and "tile:mlp:32" in tiled(profiles[512])
    predicted = LengthFit({n: profiles[n] for n in (64, 128, 256)}).at(512)
    assert tiled(predicted).keys() == tiled(profiles[512]).keys()
    for name, option in tiled(predicted).items():
        assert dict(option.action.extra) == dict(tiled(profiles[512])[name].action.extra) == \
            {"tile": name.rpartition("+")[2][5:]}
        assert option.stored_bytes == pytest.approx(tiled(profiles[512])[name].stored_bytes, rel=0.01)


def test_the_fit_does_not_predict_offload_hidden_whose_limit_follows_compute_time():
    """"offload:hidden" moves what the link carries during the next stage's compute: not a polynomial of the length
    (here the parabola through its stored bytes would go below zero), so predictions leave it out; nodes keep it."""
    from lightning_remat.core.memory_model import Profile, StageAction, StageOption, StageProfile

    def node(s, hidden_stored):
        keep = StageOption("keep", StageAction("a"), 8 * s, 1000 + 3 * s)
        hidden = StageOption("offload:hidden", StageAction.offload("a"), hidden_stored, 1000 + 3 * s,
                             host_bytes=8 * s - hidden_stored, offload_limit=5 * s)
        return Profile((StageProfile("a", (keep, hidden)),), (), parameter_bytes=1000)

    fit = LengthFit({64: node(64, 300), 128: node(128, 500), 256: node(256, 400)})
    assert [o.name for o in fit.at(1024).stages[0].options] == ["keep"]
    assert fit.at(1024).stages[0].options[0].stored_bytes == 8 * 1024
    assert [o.name for o in fit.at(128).stages[0].options] == ["keep", "offload:hidden"]


def test_a_first_length_whose_tiled_mlps_run_in_two_chunks_is_noted():
    """At 2 chunks a tiled MLP peaks at another moment than at 4 or more: predictions from it err high, so the
    search says to start longer (128 tokens at hidden 64: 2 chunks; 256: 4). One profile each."""
    import math

    from lightning_remat.core.config import ProfileOptions, RematConfig
    from lightning_remat.models import build
    from lightning_remat.service.seq_len import LengthSearch

    make = lambda n: build("llama", batch_size=1, seq_len=n, layers=2, hidden=64, vocab=64).step  # noqa: E731

    def notes_after_first_profile(start):
        search = LengthSearch(make, build("llama", batch_size=1, seq_len=start, layers=2, hidden=64, vocab=64).model,
                              None, RematConfig("8MB", profile=ProfileOptions(tile_mlp=True)), 8 * 10**6, math.inf,
                              1, start, 64, 2048, 3)
        search.profile_length(start)
        return search.notes

    assert any("run in 2 chunks" in note for note in notes_after_first_profile(128))
    assert not any("run in 2 chunks" in note for note in notes_after_first_profile(256))
