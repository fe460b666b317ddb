"""Batch-size scaling with optimal recomputation: real models, real steps, real measurements (CPU)."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_remat.runtime.installing.apply import checkpointed_modules, remove_remat
from benchmarks.lightning_binsearch import lightning_binsearch_sizes
from lightning_remat.core.batch_fit import ProfileFit
from lightning_remat.core.errors import BatchSizeTooSmallBudgetError
from lightning_remat.service.batch_size import find_remat_batch_size
from lightning_remat.runtime.measuring.measure import is_out_of_memory
from lightning_remat.integrations.lightning.batch_size_finder import RematBatchSizeFinder
from lightning_remat.runtime.measuring.measure import measure_step
from lightning_remat.models import build
from lightning_remat.runtime.profiling.profile import profile_step
from lightning_remat import BudgetTooSmallError

warnings.filterwarnings("ignore", category=FutureWarning)

SEQ_LEN = 64
VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread for tiny models


def gpt2_make_step(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=torch.Generator().manual_seed(batch_size))
    return lambda model: model(input_ids=ids, labels=ids).loss


def gpt2_with_adam():
    model = build("gpt2", layers=4, hidden=64, seq_len=SEQ_LEN, vocab=VOCAB, batch_size=1).model
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def steady_peak(model, make_step, optimizer, batch_size):
    """Peak of a real step once Adam's state exists (the budget is for steady-state steps).

    A first real step at batch size 1 creates the state, as cheaply as possible.
    """
    if not optimizer.state:
        measure_step(model, make_step(1), optimizer)
    return measure_step(model, make_step(batch_size), optimizer).peak_bytes


@pytest.fixture(scope="module")
def gpt2_search():
    torch.manual_seed(0)
    # The budget: between the measured peaks at batch 8 and 9 without recomputation, on a separate
    # model, so that exactly 8 fits without recomputation (by measurement).
    model, optimizer = gpt2_with_adam()
    peak_8 = steady_peak(model, gpt2_make_step, optimizer, 8)
    peak_9 = steady_peak(model, gpt2_make_step, optimizer, 9)
    budget = (peak_8 + peak_9) // 2
    del model, optimizer

    torch.manual_seed(0)
    model, optimizer = gpt2_with_adam()
    before = [p.detach().clone() for p in model.parameters()]
    result = find_remat_batch_size(model, gpt2_make_step, budget, optimizer=optimizer, init_val=2,
                                   max_overhead=0.35, steps_per_trial=1)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and not optimizer.state
    return dict(model=model, optimizer=optimizer, budget=budget, peak_8=peak_8, peak_9=peak_9, result=result,
                unchanged=unchanged)


def test_the_table_shows_a_decimal_budget_in_decimal_next_to_its_bytes():
    from lightning_remat.core.plan import Plan
    from lightning_remat.service.batch_size import BatchSizeResult

    plan = Plan([], budget_bytes=60 * 10**6, baseline_peak_bytes=10**8, predicted_peak_bytes=5 * 10**7,
                predicted_overhead=0.1, requested_budget="60MB")
    assert "60.00 MB = 60000000 bytes" in BatchSizeResult(4, 2, 4, plan, plan.budget_bytes).summary()  # was 57.22 MiB


def test_a_result_reads_in_one_short_line_and_its_summary_is_the_table():
    from lightning_remat.core.memory_model import Costs, Profile, StageAction, StageOption, StageProfile
    from lightning_remat.core.solve import solve
    from lightning_remat.runtime.measuring.trial import Trial
    from lightning_remat.service.batch_size import BatchSizeResult

    stages = tuple(StageProfile(f"h.{k}", (StageOption("keep", StageAction(f"h.{k}"), 10**6, 2 * 10**6),
                                          StageOption("whole", StageAction.recompute(f"h.{k}"), 0, 2 * 10**6,
                                                      Costs(1.0, 5)))) for k in range(12))
    plan = solve(Profile(stages, (), baseline_peak_bytes=13 * 10**6), "8MB", cost="flops")
    trials = [Trial(b, tuple(plan.checkpointed), 2, 7 * 10**6, False, True) for b in (8, 16, 32)]
    result = BatchSizeResult(32, 8, 32, plan, 8 * 10**6, measured_peak_bytes=7 * 10**6, trials=trials,
                             notes=["a note"] * 3)
    text = repr(result)
    assert len(text) < 300 and "\n" not in text, text  # the dataclass's repr was 4.6 KB for a real search
    for figure in ("batch_size=32", "batch_size_without_remat=8", "ratio=4.00x", "measured_peak=6.68 MiB",
                   "budget=8.00 MB = 8000000 bytes", "predicted_overhead="):
        assert figure in text
    assert "ratio" in result.summary() and "predicted peak / measured peak" in result.summary()


def test_chosen_batch_fits_the_budget_when_measured(gpt2_search):
    model, optimizer, budget, result = gpt2_search["model"], gpt2_search["optimizer"], gpt2_search["budget"], gpt2_search["result"]
    assert checkpointed_modules(model) == result.plan.checkpointed != []
    measured = steady_peak(model, gpt2_make_step, optimizer, result.batch_size)
    assert measured <= budget
    # The prediction the search relied on agrees with the measurement.
    assert abs(result.plan.predicted_peak_bytes - measured) <= 0.03 * measured
    assert result.measured_peak_bytes is not None and result.measured_peak_bytes <= budget
    assert result.predicted_overhead <= 0.35
    # Trial steps put the weights and the optimizer state back.
    assert gpt2_search["unchanged"]


def test_at_least_twice_the_batch_without_recomputation(gpt2_search):
    result = gpt2_search["result"]
    # By construction (measured) 8 fits without recomputation and 9 does not.
    assert gpt2_search["peak_8"] <= gpt2_search["budget"] < gpt2_search["peak_9"]
    assert result.batch_size_without_remat == 8
    assert result.batch_size >= 2 * result.batch_size_without_remat
    assert result.ratio >= 2.0
    assert result.metrics()["remat/batch_size_ratio"] == pytest.approx(result.ratio)
    text = result.summary()
    assert str(result.batch_size) in text and "without recomputation" in text


def test_costs_no_more_real_steps_than_lightning_binsearch(gpt2_search):
    result = gpt2_search["result"]
    binsearch = lightning_binsearch_sizes(2, result.largest_fitting)
    assert result.trial_steps <= len(binsearch) * result.steps_per_trial
    # Profiling passes run at small batches; with them the search still processes fewer samples.
    trial_samples = sum(t.batch_size * t.steps for t in result.trials)
    assert result.profile_samples + trial_samples <= sum(binsearch) * result.steps_per_trial
    assert result.profile_batch_sizes == (2, 4)


class _FakeOOMModule(pl.LightningModule):
    """Fails with a CUDA out-of-memory message above a batch size, to record what binsearch tries."""

    def __init__(self, limit: int):
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = 2
        self.layer = nn.Linear(4, 1)
        self.tried: list[int] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.tried.append(x.shape[0])
        if x.shape[0] > self.hparams.limit:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.layer(x).sum()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(4096, 4)), batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("limit", [13])
def test_binsearch_transcription_matches_lightning(limit, tmp_path):
    from lightning.pytorch.callbacks import BatchSizeFinder

    module = _FakeOOMModule(limit)
    trainer = pl.Trainer(max_steps=1, callbacks=[BatchSizeFinder(mode="binsearch", steps_per_trial=1, margin=0.0)],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path)
    trainer.fit(module)
    search = module.tried[:-1]  # the last entry is the real training step after the search
    assert search == lightning_binsearch_sizes(2, limit)


# ----------------------------------------------------------------------------------------------
# Small models for the quick tests


def mlp(depth: int = 6, width: int = 32, hidden: int = 256) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
                           for _ in range(depth)])


def mlp_make_step(batch_size: int, width: int = 32):
    x = torch.randn(batch_size, width, generator=torch.Generator().manual_seed(batch_size))
    return lambda model: model(x).square().mean()


def test_profile_fit_predicts_a_real_profile():
    net = mlp()
    fit = ProfileFit([(2, profile_step(net, mlp_make_step(2))), (4, profile_step(net, mlp_make_step(4)))])
    real = profile_step(net, mlp_make_step(24))
    predicted = fit.at(24)
    assert predicted.static_bytes == real.static_bytes
    for p, r in zip(predicted.stages, real.stages):
        assert [o.stored_bytes for o in p.options] == [o.stored_bytes for o in r.options]
        assert [o.costs.flops for o in p.options] == [o.costs.flops for o in r.options]
    assert predicted.baseline_peak_bytes == pytest.approx(real.baseline_peak_bytes, rel=0.03)


def test_bad_arguments_give_clear_errors():
    net = mlp(depth=2)
    with pytest.raises(ValueError, match="max_overhead must be a number >= 0"):
        find_remat_batch_size(net, mlp_make_step, "1GB", max_overhead=-0.01)
    for margin in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"margin must be in \[0, 1\)"):
            find_remat_batch_size(net, mlp_make_step, "1GB", margin=margin)
    with pytest.raises(ValueError, match="has no meaning for a batch-size search"):
        find_remat_batch_size(net, mlp_make_step, "min")
    with pytest.raises(ValueError, match="Invalid memory budget"):
        find_remat_batch_size(net, mlp_make_step, "ten gigs")
    with pytest.raises(ValueError, match="margin must be in"):
        RematBatchSizeFinder(budget="1GB", margin=1.0)
    with pytest.raises(ValueError, match="max_overhead"):
        RematBatchSizeFinder(budget="1GB", max_overhead=-1)


def test_budget_too_small_even_at_batch_size_one():
    net = mlp(depth=2)
    static = sum(p.numel() * p.element_size() for p in net.parameters())
    with pytest.raises(BatchSizeTooSmallBudgetError, match="too small even at batch size 1") as info:
        find_remat_batch_size(net, mlp_make_step, static)
    assert isinstance(info.value, BudgetTooSmallError)
    assert info.value.smallest_peak_bytes > static
    assert checkpointed_modules(net) == []


def test_real_out_of_memory_steps_down():
    net = mlp(depth=4)
    limit = 20

    def make_step(batch_size):
        step = mlp_make_step(batch_size)

        def run(model):
            if batch_size > limit:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes")
            return step(model)
        return run

    result = find_remat_batch_size(net, make_step, "1GB", init_val=4, max_val=64)
    # Bisection between what passed and what ran out of memory finds the limit exactly.
    assert result.largest_fitting == limit
    assert any(t.out_of_memory for t in result.trials)
    assert [t.batch_size for t in result.trials if t.fits][-1] == limit
    assert all(t.out_of_memory for t in result.trials if t.batch_size > limit)
    remove_remat(net)

    def broken(batch_size):
        def run(model):
            raise RuntimeError("shape mismatch")
        return run

    with pytest.raises(RuntimeError, match="shape mismatch"):
        find_remat_batch_size(net, broken, "1GB")
    assert is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_margin_and_power_mode():
    net = mlp(depth=4)
    budget = 2_000_000
    binsearch = find_remat_batch_size(net, mlp_make_step, budget, init_val=4, max_val=512, margin=0.25, apply=False)
    assert binsearch.batch_size == max(1, int(binsearch.largest_fitting * 0.75))
    assert checkpointed_modules(net) == []
    power = find_remat_batch_size(net, mlp_make_step, budget, init_val=4, max_val=512, mode="power", apply=False)
    assert power.largest_fitting in {4 * 2**k for k in range(8)}
    assert power.largest_fitting <= binsearch.largest_fitting < 2 * power.largest_fitting


# ----------------------------------------------------------------------------------------------
# Lightning


class _Recorder(Logger):
    def __init__(self):
        super().__init__()
        self.metrics: dict[str, float] = {}

    @property
    def name(self):
        return "recorder"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.metrics.update(metrics)

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class _LitMLP(pl.LightningModule):
    def __init__(self, batch_size: int = 2, depth: int = 6):
        super().__init__()
        self.save_hyperparameters()
        self.net = mlp(depth=depth)
        self.seen: list[int] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self(x).square().mean()
        self.log("loss", loss)
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append(batch[0].shape[0])

    def train_dataloader(self):
        data = torch.randn(4096, 32, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(data), batch_size=self.hparams.batch_size)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _trainer(tmp_path, callback, logger=None):
    return pl.Trainer(max_steps=2, callbacks=[callback], logger=logger or False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                      default_root_dir=tmp_path, num_sanity_val_steps=0, log_every_n_steps=1)


def test_lightning_callback_sets_batch_size_and_dataloader(tmp_path):
    # The budget: what a batch of 128 needs without recomputation (measured, steady state).
    reference = _LitMLP()
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    x = torch.randn(128, 32)
    step = lambda m: m(x).square().mean()
    measure_step(reference, step, optimizer)
    budget = measure_step(reference, step, optimizer).peak_bytes

    module = _LitMLP()
    finder = RematBatchSizeFinder(budget=budget, margin=0.0, verbose=True)
    logger = _Recorder()
    trainer = _trainer(tmp_path, finder, logger)
    trainer.fit(module)

    assert finder.batch_size is not None and finder.batch_size == finder.optimal_batch_size
    assert module.hparams.batch_size == finder.batch_size
    assert finder.result.batch_size_without_remat >= 100  # predicted; 128 fits by measurement
    assert finder.batch_size >= 2 * finder.result.batch_size_without_remat
    assert module.seen == [finder.batch_size, finder.batch_size]  # the real training steps
    assert trainer.train_dataloader.batch_size == finder.batch_size
    assert checkpointed_modules(module) == finder.plan.checkpointed != []
    assert finder.result.measured_peak_bytes <= budget
    assert logger.metrics["remat/batch_size"] == finder.batch_size
    assert logger.metrics["remat/batch_size_without_remat"] == finder.result.batch_size_without_remat
    assert logger.metrics["remat/batch_size_ratio"] == pytest.approx(finder.result.ratio)
    assert logger.metrics["remat/predicted_overhead"] == pytest.approx(finder.plan.predicted_overhead)
    assert finder.state_dict()["batch_size"] == finder.batch_size


def test_lightning_callback_missing_batch_attribute(tmp_path):
    module = _LitMLP()
    finder = RematBatchSizeFinder(budget="1GB", batch_arg_name="bs")
    with pytest.raises(MisconfigurationException, match=r"'bs' does not exist. Looked in the LightningModule \(_LitMLP\), its hparams"):
        _trainer(tmp_path, finder).fit(module)


def test_step_calling_a_submodule_prices_recomputation_by_flops():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp(depth=4)

    model = Wrapper()
    make_step = lambda b: (lambda m, x=torch.randn(b, 32): m.net(x).square().mean())
    result = find_remat_batch_size(model, make_step, 2_000_000, init_val=4, max_val=256, apply=False)
    # The profiler attributes FLOPs by the counter's growth across each module's forward, so a
    # step that calls m.net (as a LightningModule's training_step often does) is priced in FLOPs.
    assert result.plan.cost_kind == "flops"
    assert not any("priced by measured time" in note for note in result.notes)
    assert result.plan.predicted_overhead > 0
    assert result.largest_fitting > result.batch_size_without_remat > 0


def test_the_example_finds_a_larger_batch(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "batch_size.py"
    spec = importlib.util.spec_from_file_location("batch_size_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    threads = torch.get_num_threads()
    try:
        assert example.main(["--fits", "4", "--seq-len", "32"]) == 0
    finally:
        torch.set_num_threads(threads)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    without, with_remat = int(line.split("batch ")[1].split()[0]), int(line.split(", ")[1].split()[0])
    assert with_remat >= 2 * without


# ---------------------------------------------------------------- offload (docs/offload.md)


def test_offload_search_without_an_accelerator_is_the_clear_error_plan_remat_gives(tmp_path):
    from lightning_remat.core.errors import RematError

    net = mlp(depth=2)
    called = []
    with pytest.raises(RematError, match="nothing to gain without an accelerator.*fake=True, gpu="):
        find_remat_batch_size(net, lambda b: called.append(b), "1GB", offload=True)
    assert called == []  # refused before any step is built or run
    # The Lightning finder passes it through: the same error, and the batch size is left as it was.
    module = _LitMLP()
    with pytest.raises(RematError, match="nothing to gain without an accelerator"):
        _trainer(tmp_path, RematBatchSizeFinder(budget="1GB", offload=True)).fit(module)
    assert module.hparams.batch_size == 2 and checkpointed_modules(module) == []


def _fake_llama_fit(batch_sizes=(2, 4)):
    """A ProfileFit of a small Llama planned on fake tensors for an H100 with offload offered,
    as ``find_remat_batch_size(offload=True)`` fits a CUDA model's profiles."""
    from lightning_remat.core.config import ProfileOptions
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=512, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).train()
    options = ProfileOptions(fake=True, gpu="h100", device="cuda", offload=True, dtype=torch.bfloat16, policies=())

    def at(batch):
        ids = torch.randint(0, 512, (batch, 512))
        return profile_step(model, lambda m: m(input_ids=ids, labels=ids).loss, options=options)

    return ProfileFit([(b, at(b)) for b in batch_sizes]), at


def _offload_search(fit, budget, host_free=None):
    from lightning_remat.core.config import ProfileOptions, RematConfig
    from lightning_remat.service.batch_search import BatchSearch

    config = RematConfig(budget, cost="time", profile=ProfileOptions(offload=True))
    search = BatchSearch(None, None, None, config, budget, float("inf"), 1, "binsearch", 2)
    search.fit, search.host_free = fit, host_free
    return search


def test_offload_batch_fit_scales_host_bytes_and_the_search_stays_within_host_memory():
    from lightning_remat.core.batch_fit import largest_batch
    from lightning_remat.core.offload_model import without_offload
    from lightning_remat.core.solve import least_peak

    fit, at = _fake_llama_fit()
    # The offloaded bytes grow with the batch like every other term: the host-memory limit and the
    # "offload:hidden" limit applied at the batch found read the fitted figures.
    real = at(8)
    for predicted, measured in zip(fit.at(8).stages, real.stages):
        for name in ("offload", "offload:hidden"):
            if any(o.name == name for o in measured.options):
                p, m = predicted.option(name), measured.option(name)
                assert p.host_bytes == pytest.approx(m.host_bytes, rel=0.01) and m.host_bytes > 0
                assert p.offload_limit == pytest.approx(m.offload_limit, rel=0.01)
    # A budget where recomputation alone stops at some batch: offloading never fits fewer samples.
    budget = least_peak(without_offload(fit.at(24), set(range(len(real.stages)))))
    unlimited = _offload_search(fit, budget, host_free=10**15)
    found = unlimited.largest(True, 256)
    n = len(real.stages)
    recompute_only = largest_batch(lambda b: least_peak(without_offload(fit.at(b), set(range(n)))) <= budget,
                                   2, 256, "binsearch")
    assert found >= recompute_only >= 24 > unlimited.largest(False, 256)  # (False: nothing recomputed)
    plan = unlimited.plan_for(found, True)
    assert plan.predicted_peak_bytes <= budget
    # With little host memory free, every plan of the search stays within it (offloading withdrawn
    # from the largest offloaded stages), and the batch found is no larger.
    cheapest_host = min(s.option("offload:hidden").host_bytes for s in fit.at(found).stages[:-1])
    limited = _offload_search(fit, budget, host_free=cheapest_host)
    small = limited.largest(True, 256)
    assert 24 <= small <= found
    for b in sorted({2, small // 2, small - 1, small}):
        plan = limited.plan_for(b, True)
        assert plan is not None and plan.host_bytes <= cheapest_host and plan.predicted_peak_bytes <= budget


def test_offload_trial_runs_with_the_plans_offloading_and_puts_it_back():
    from lightning_remat.core.plan import Plan, StageAction
    from lightning_remat.runtime.installing.apply import apply_plan
    from lightning_remat.runtime.installing.offload import offloaded_modules
    from lightning_remat.runtime.measuring.trial import run_trial

    net = mlp(depth=4)
    apply_plan(net, ["3"])  # the model's own plan, back after the trial
    plan = Plan([StageAction.offload("0"), StageAction.recompute("1"), StageAction.offload("2")], 10**9, 10**9, 10**9, 0.0,
                host_bytes=1)
    seen = []
    step = mlp_make_step(8)

    def watched(model):
        seen.append((sorted(offloaded_modules(model)), checkpointed_modules(model)))
        return step(model)

    trial = run_trial(net, watched, None, 8, plan, 1, 10**9, plan.predicted_peak_bytes)
    assert trial.fits and seen and all(s == (["0", "2"], ["1"]) for s in seen), seen
    assert offloaded_modules(net) == [] and checkpointed_modules(net) == ["3"]
    remove_remat(net)
