"""The generative harness of the invariants (issue 29, docs/invariants.md).

- ``zoo``: small models whose features meet the package's (a token transformer, a CNN whose image
  height and width change, a trunk called twice per step, dict batches whose keys vary, blocks in an
  ``nn.ModuleDict`` planned with ``candidates=``), their batches at any drawn shape, and their losses.
- ``loops``: the same training run through each integration (``ShapePlans``, Fabric with
  ``ShapePlans``, ``AutoRemat``, ``RematAccelerator``/``prepare_remat``, ``RematTrainerCallback``),
  with or without the package, recording per step its peak (``torch.profiler`` allocation events,
  the package's own work in the step included), its loss, what is installed against the plan in
  effect, and the calls a user's hook saw.
- ``harness``: a case (model x integration x shapes x budget), its runs, and the invariants
  checked over them; Hypothesis strategies that draw cases.
"""
