"""Accelerate's own FSDP2 path (2 processes, gloo, CPU): ``Accelerator.prepare`` -> ``_prepare_fsdp2``.

Accelerate 1.15 turns FSDP on only for accelerators (``AcceleratorState.__init__`` sets
``DistributedType.FSDP`` in its MULTI_GPU/NPU/XPU/... branch, never for MULTI_CPU), although
``_prepare_fsdp2`` itself needs nothing of a GPU: ``fully_shard`` builds its default mesh on the CPU
with gloo. ``_fsdp2_on_cpu`` does, in the test processes only, what that branch does on a GPU
(``distributed_type = FSDP``, ``fsdp_plugin = plugin``, its mixed precision, and the ``PartialState``
copy of the type that every later ``AcceleratorState()`` reloads), so the real ``Accelerator.prepare``
-> ``_prepare_fsdp2`` -> ``fsdp2_prepare_model`` (auto-wrap policy, tied embeddings' tail group, optimizer
parameter switch) runs, and ``RematAccelerator`` plans the model Accelerate sharded.

Shown: the script is switched on by the environment alone (``ACCELERATE_USE_FSDP``, ``FSDP_VERSION=2``,
``ACCELERATE_REMAT_BUDGET``); every rank profiles in lockstep and wraps the same modules; the largest
per-rank MemTracker peak of steady steps (optimizer state alive) is within the per-rank budget and
within 5% of the prediction; the losses are those of one unsharded process within 1e-5.
"""

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from lightning_remat.integrations.accelerate.accelerator import FSDP2_TAKE_OVER
from tests.gloo_ranks import after_case, count_profile_calls, spawn

pytestmark = [pytest.mark.xdist_group("fsdp-multiprocess"), pytest.mark.distributed]

SMALL = dict(layers=3, hidden=64, seq_len=32, batch_size=2, vocab=128)
STEPS = 5  # observed, planned at its end; measured by the session; one more; two measured here with MemTracker


def _fsdp2_on_cpu() -> None:
    """Make ``AcceleratorState`` choose FSDP on a multi-CPU run given an FSDP plugin, as it does on GPUs."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    real = AcceleratorState.__init__
    after_case(lambda: setattr(AcceleratorState, "__init__", real))

    def init(self, *args, fsdp_plugin=None, **kwargs):
        real(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            PartialState._shared_state["distributed_type"] = self.distributed_type  # as its __init__ ends

    AcceleratorState.__init__ = init


def _model():
    from lightning_remat.models import build

    torch.manual_seed(0)
    case = build("gpt2", **SMALL)
    for m in case.model.modules():  # ranks would draw other dropout masks than one process
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return case


def _rank(rank: int) -> dict:
    world = dist.get_world_size()  # the group spawn made: Accelerate reuses it
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    _fsdp2_on_cpu()
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin

    from lightning_remat import plan_remat
    from lightning_remat.accelerate import RematAccelerator, remat_session
    from lightning_remat.integrations.accelerate.accelerator import _check_supported
    from lightning_remat.core.errors import AlreadyCheckpointedError
    from lightning_remat.runtime.installing.apply import checkpointed_modules
    from lightning_remat.runtime.measuring.measure import measure_step

    calls = count_profile_calls()
    result = {}
    case = _model()
    if rank == 0:  # the reference: one unsharded process, the same batch, the same Adam steps
        reference = copy.deepcopy(case.model)
        adam = torch.optim.Adam(reference.parameters(), lr=1e-3)
        result["reference"] = [measure_step(reference, case.step, adam).loss for _ in range(STEPS)]

    # The budget: between the least and the plain peak of the model as the stock Accelerator shards it.
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    model, optimizer = accelerator.prepare(case.model, torch.optim.Adam(case.model.parameters(), lr=1e-3))
    least = plan_remat(model, case.step, "min", optimizer=optimizer.optimizer, cost="flops")
    budget = int(least.predicted_peak_bytes + 0.4 * (least.baseline_peak_bytes - least.predicted_peak_bytes))
    result["probe"] = dict(sharded=type(model).__name__, blocks=[type(m).__name__ for m in model.modules()
                                                                  if type(m).__name__.startswith("FSDP")])

    # The user's script, unchanged, switched on at launch by the environment.
    AcceleratorState._reset_state(True)  # a new run in the same processes (the process group stays)
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
                      ACCELERATE_REMAT_BUDGET=str(budget),
                      ACCELERATE_REMAT_COST="flops")
    case = _model()
    accelerator = RematAccelerator(cpu=True)
    model, optimizer = accelerator.prepare(case.model, torch.optim.Adam(case.model.parameters(), lr=1e-3))
    calls.clear()
    losses = []
    for _ in range(STEPS - 2):
        optimizer.zero_grad(set_to_none=True)
        loss = case.step(model)
        accelerator.backward(loss)
        optimizer.step()
        losses.append(float(loss.detach()))
    session = remat_session(model)
    steady = [measure_step(model, case.step, optimizer.optimizer) for _ in range(2)]  # the session lets go here
    losses += [m.loss for m in steady]
    result["remat"] = dict(fsdp2=accelerator.is_fsdp2, profiles=len(calls), plan=session.plan.checkpointed,
                           phase=session.phase, wrapped=checkpointed_modules(model), metrics=accelerator.remat_metrics,
                           budget=budget, steady=max(m.peak_bytes for m in steady), losses=losses)

    # The plugin's own activation checkpointing would wrap every block when the model is prepared:
    # RematAccelerator, made before, switches it off (one warning, main process); a session on a model the
    # plugin has prepared already (the Trainer's) refuses it.
    AcceleratorState._reset_state(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        taken = RematAccelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
                                                                                      activation_checkpointing=True))
    result["taken_over"] = (taken.state.fsdp_plugin.activation_checkpointing,
                            [str(w.message) for w in caught if "turned off" in str(w.message)])
    try:
        _check_supported(taken.state)  # as RematTrainerCallback checks, after the Trainer prepared
        taken.state.fsdp_plugin.activation_checkpointing = True
        _check_supported(taken.state)
        result["with_ac"] = None
    except AlreadyCheckpointedError as error:
        result["with_ac"] = str(error)
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(_rank, tmp_path_factory.mktemp("accelerate_fsdp2"))


def test_accelerate_shards_the_model_itself(ranks):
    probe = ranks[0]["probe"]
    assert probe["sharded"] == "FSDPGPT2LMHeadModel"  # fully_shard by fsdp2_prepare_model, not by hand
    assert probe["blocks"].count("FSDPGPT2Block") == SMALL["layers"]  # the auto-wrap policy's units


def test_remat_accelerator_plans_accelerates_fsdp2_model_within_the_budget(ranks):
    r0, r1 = ranks[0]["remat"], ranks[1]["remat"]
    assert r0["fsdp2"] and r1["fsdp2"]
    assert r0["profiles"] == r1["profiles"] == 1  # every rank profiled, in lockstep
    assert r0["phase"] == r1["phase"] == "done"
    assert r0["plan"] and r0["plan"] == r1["plan"] == r0["wrapped"] == r1["wrapped"]
    metrics = r0["metrics"]
    assert metrics == r1["metrics"]  # one plan, and the session's measured peak is the max over ranks
    budget = r0["budget"]
    assert metrics["remat/budget_bytes"] == budget < metrics["remat/baseline_peak_bytes"]
    steady = max(r0["steady"], r1["steady"])  # the largest per-rank peak of steady steps
    assert max(steady, metrics["remat/measured_peak_bytes"]) <= budget
    assert steady == pytest.approx(metrics["remat/predicted_peak_bytes"], rel=0.05)
    assert r0["losses"] == pytest.approx(ranks[0]["reference"], abs=1e-5)
    assert r1["losses"] == pytest.approx(ranks[0]["reference"], abs=1e-5)


def test_the_plugins_own_activation_checkpointing_is_taken_over_before_prepare_and_refused_after(ranks):
    assert ranks[0]["taken_over"] == [False, [FSDP2_TAKE_OVER]] and ranks[1]["taken_over"] == [False, []]  # (JSON)
    message = ranks[0]["with_ac"]
    assert message and "activation_checkpointing=True" in message and "ACCELERATE_REMAT_BUDGET" in message
    assert ranks[1]["with_ac"] == message
