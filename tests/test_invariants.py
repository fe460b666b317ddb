"""The invariants of issue 29 over generated cases (docs/invariants.md): every step within the budget,
the first included (or a ``RematError`` before it runs), what is installed equal to the plan in
effect, losses equal to the run without the package, user hooks unaware of profiling.

For each (model, integration) of the harness (``tests/invariants``), Hypothesis draws a case (the
``CI`` profile: derandomized, no database, no shrinking; one case per pair: Hypothesis's first,
whose choices are the first of each list in ``strategies``: a budget half-way between the least and
the plain peak, a batch shape, a second shape, and back) and the harness runs it without and with the
package. The long run, with shrinking: ``python benchmarks/fuzz.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from lightning_remat import ShapePlans
from tests.invariants.harness import PAIRS, Case, batches_of, check, run_case
from tests.invariants.loops import hand_loop, using_plans
from tests.invariants.runners import RUNNERS
from tests.invariants.recorder import Recorder
from tests.invariants.strategies import CI, cases
from tests.invariants.zoo import ZOO

# Found by this harness and not fixed yet: the CPU's oneDNN convolutions reorder their input (or
# output) and weights into blocked layouts inside the kernel, buffers as large as an activation that
# neither MemTracker nor fake tensors see (a 16-channel 24x24 batch of 4: 156,672 B missed, the same
# under every plan), so a CNN's prediction is short by that and its steps run 1.07x over the budget.
_CONV = ("oneDNN convolution workspaces (input and weight reorders, ~1 activation) are invisible to "
         "MemTracker and fake tensors: predicted 2,100,156 B, measured 2,256,828 B (1.071x)")
KNOWN = {("cnn", integration): _CONV for integration in ("shape_plans", "fabric", "lightning", "accelerate")}


def _pair(model: str, integration: str) -> object:
    reason = KNOWN.get((model, integration))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(model, integration, marks=marks, id=f"{model}-{integration}")


@pytest.mark.parametrize("model, integration", [_pair(m, i) for m, i in PAIRS])
def test_every_step_keeps_the_invariants(model, integration):
    outcomes = {}  # Hypothesis runs a failing example again to report it: once is enough here

    @CI
    @given(cases(model, integration, min_steps=6, max_steps=6, max_pool=2))
    def every_step(case):
        outcome = outcomes[case] = outcomes.get(case) or run_case(case)
        assert not outcome.violations, outcome.report()

    every_step()


def test_the_harness_sees_a_plan_that_is_not_installed_and_the_budget_it_breaks(monkeypatch):
    """The harness's own check: ``ShapePlans`` whose installer does nothing. The plan names modules
    that the records and the backward do not recompute, and the steps break the budget. The package's
    own check (``InstallationMismatchError``) is switched off: the harness must see it independently."""
    import lightning_remat.service.shape_plans as shape_plans

    monkeypatch.setattr(shape_plans, "check_installed", lambda *args, **kwargs: None)
    case = Case("trunk", "shape_plans", ((4, 32),) * 6, 0.3)
    spec, batches = ZOO["trunk"], batches_of(case)
    reference = RUNNERS["shape_plans"](spec, batches, None, case.seed)
    plain = max(step.peak for step in reference.steps)
    budget = int(0.8 * plain)
    model = spec.build(case.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    plans = ShapePlans(model, spec.loss, budget, optimizer=optimizer, cost="flops", verbose=False,
                       install=lambda module, plan: None)
    used = [None]
    rec = Recorder(model, model, lambda: used[0])
    torch.manual_seed(case.seed + 1)
    error = hand_loop(rec, model, optimizer, batches, lambda batch: spec.loss(model, batch),
                      lambda loss: loss.backward(), using_plans(plans, used))
    found = check(case, budget, reference, rec.finish(error), batches)
    kinds = {v.invariant for v in found}
    assert used[0].checkpointed and {"installed", "budget"} <= kinds, found
    assert any("behaviour: planned but not recomputed" in v.detail for v in found), found
