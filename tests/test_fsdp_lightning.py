"""AutoRemat under Lightning's ModelParallelStrategy (FSDP2 ``fully_shard`` in ``configure_model``),
2 processes, gloo, CPU, launched as a script as users launch it; FSDPStrategy (FSDP1) refused."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.lightning_gpt2 import LitGPT2, script_header

pytestmark = pytest.mark.xdist_group("fsdp-multiprocess")

SCRIPT = r'''
import json, sys
import torch
import lightning.pytorch as L
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset
from lightning_remat import AutoRemat
import lightning_remat.runtime.profiling.profile as profiling
from lightning_remat.runtime.installing.apply import checkpointed_modules
from tests.lightning_gpt2 import LitGPT2, SteadyPeaks

out = sys.argv[1]
calls = []
real = profiling.profile_step
profiling.profile_step = lambda *a, **k: (calls.append(1), real(*a, **k))[1]


def ids():
    return torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))


lit, steady = LitGPT2(shard=True, dropout=False), SteadyPeaks(first=2)
callback = AutoRemat(budget="min", cost="flops", verbose=False)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                    max_steps=4, callbacks=[callback, steady], logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
# Every rank reads the same batches: FSDP averages equal gradients, so losses are one process's.
trainer.fit(lit, DataLoader(TensorDataset(ids()), batch_size=2))
with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
    json.dump({"profile_calls": len(calls), "checkpointed": checkpointed_modules(lit), "plan": callback.plan.checkpointed,
               "budget": callback.plan.budget_bytes, "predicted": callback.plan.predicted_peak_bytes,
               "measured": callback.measured_peak_bytes, "steady": steady.peaks, "losses": steady.losses,
               "notes": callback.plan.notes, "world_size": trainer.world_size}, f)
'''


def _reference_losses():
    """Four Adam steps of one unsharded process on the same batches."""
    model = LitGPT2(dropout=False).model
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for i in range(4):
        x = ids[2 * i:2 * i + 2]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.distributed
def test_model_parallel_strategy_plans_on_every_rank_and_holds_the_budget(tmp_path):
    script = tmp_path / "fsdp_fit.py"
    script.write_text(script_header() + SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [r["profile_calls"] for r in ranks] == [1, 1]  # every rank profiled, in lockstep
    assert ranks[0]["plan"] and ranks[0]["plan"] == ranks[1]["plan"] == ranks[0]["checkpointed"] == ranks[1]["checkpointed"]
    assert any("ranks in lockstep" in note for note in ranks[0]["notes"])
    # The callback's figure is the largest per-rank peak of a steady step; later steps agree.
    steady = max(max(r["steady"]) for r in ranks)
    assert ranks[0]["measured"] == ranks[1]["measured"] <= ranks[0]["budget"]
    assert steady <= ranks[0]["budget"]
    assert ranks[0]["measured"] == pytest.approx(ranks[0]["predicted"], rel=0.05)
    assert steady == pytest.approx(ranks[0]["predicted"], rel=0.05)
    reference = _reference_losses()
    for r in ranks:
        assert r["losses"] == pytest.approx(reference, abs=1e-5)


def test_fsdp1_strategy_is_refused_with_the_workaround():
    import lightning.pytorch as L
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_remat import AutoRemat
    from lightning_remat.core.errors import UnsupportedShardingError

    class Trainerish:
        strategy = FSDPStrategy.__new__(FSDPStrategy)

    callback = AutoRemat(budget="1GB")
    with pytest.raises(UnsupportedShardingError, match="ModelParallelStrategy") as info:
        callback.setup(Trainerish(), L.LightningModule(), "fit")
    assert "apply_plan" in str(info.value)
