"""RematBatchSizeFinder under Lightning's ModelParallelStrategy (FSDP2 ``fully_shard`` in
``configure_model``), 2 processes, gloo, CPU, launched as a script as users launch it: every rank
searches in lockstep, finds the same batch size, sets it and trains within the per-rank budget."""

import json
import os
import subprocess
import sys

import pytest

from tests.lightning_gpt2 import script_header

pytestmark = pytest.mark.xdist_group("fsdp-multiprocess")

SCRIPT = r'''
import json, sys
import torch
import lightning.pytorch as L
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_remat import RematBatchSizeFinder
from lightning_remat.runtime.installing.apply import checkpointed_modules
from tests.lightning_gpt2 import LitGPT2, SteadyPeaks

out, budget = sys.argv[1], int(sys.argv[2])


class Steady(SteadyPeaks):
    """Each rank's MemTracker peak of steps 1 and 2 (Adam's state exists after step 0), the batch
    shapes, and at the end this rank's steady peaks at batch 8 and 9 without recomputation."""

    def on_train_end(self, trainer, pl_module):
        # Without recomputation, this rank's steady peaks at batch 8 and 9: the budget lies between.
        from lightning_remat import remove_remat
        from lightning_remat.runtime.measuring.measure import measure_step

        self.wrapped = checkpointed_modules(pl_module)
        remove_remat(pl_module)
        self.without = {}
        for b in (8, 9):
            x = torch.randint(0, 128, (b, 32))
            step = lambda m: m.model(input_ids=x, labels=x).loss
            self.without[b] = measure_step(pl_module, step, trainer.optimizers[0]).peak_bytes


lit, steady = LitGPT2(shard=True, dropout=False), Steady(first=1)
finder = RematBatchSizeFinder(budget=budget, margin=0.0, max_val=32, verbose=False)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                    max_steps=3, callbacks=[finder, steady], logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
trainer.fit(lit)
result = finder.result
with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
    json.dump({"batch_size": finder.batch_size, "attribute": lit.batch_size, "plan": finder.plan.checkpointed,
               "wrapped": steady.wrapped, "without": result.batch_size_without_remat,
               "measured": result.measured_peak_bytes, "steady": steady.peaks, "shapes": steady.shapes,
               "notes": result.notes, "peak_8": steady.without[8], "peak_9": steady.without[9], "world_size": trainer.world_size}, f)
'''

# The per-rank budget of tests/test_fsdp_batch_size.py's model (the same GPT-2, sharded the same
# way, the same Adam): between the largest per-rank steady peak at batch 8 and at batch 9 without
# recomputation (7624232 and 8389416 bytes measured there); the script measures them again.
BUDGET = 8_006_824


@pytest.mark.distributed
def test_model_parallel_strategy_finds_the_same_batch_on_every_rank(tmp_path):
    script = tmp_path / "fsdp_batch.py"
    script.write_text(script_header() + SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, str(script), str(tmp_path), str(BUDGET)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    r0, r1 = ranks
    assert r0["world_size"] == r1["world_size"] == 2
    assert r0["batch_size"] == r1["batch_size"] == r0["attribute"] == r1["attribute"] > 8
    assert r0["plan"] and r0["plan"] == r1["plan"] == r0["wrapped"] == r1["wrapped"]
    assert max(r0["peak_8"], r1["peak_8"]) <= BUDGET < max(r0["peak_9"], r1["peak_9"])
    assert r0["without"] == r1["without"] <= 8
    assert any("ranks in lockstep" in note for note in r0["notes"])
    # The dataloader was rebuilt at the batch found, and steady steps hold the budget on every rank.
    assert all(shape[0] == r0["batch_size"] for r in ranks for shape in r["shapes"])
    assert r0["measured"] == r1["measured"] <= BUDGET
    assert max(max(r["steady"]) for r in ranks) <= BUDGET


def test_other_distributed_strategies_are_refused_with_the_workaround():
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_remat.core.errors import UnsupportedShardingError
    from lightning_remat.integrations.lightning.batch_size_finder import _check_distributed

    class Trainerish:
        strategy = DDPStrategy.__new__(DDPStrategy)

    with pytest.raises(UnsupportedShardingError, match="ModelParallelStrategy") as info:
        _check_distributed(Trainerish())
    assert "devices=1" in str(info.value)
