"""The runtime: everything that touches torch, in four folders by job.

- ``measuring``: run and meter a real step (trackers, the peak meter, FLOPs, roofline costs, trials).
- ``profiling``: turn a step into the memory model's terms (candidates, per-stage options, stacks).
- ``installing``: put a plan on a model and take it off (recompute, segments, policies, offload).
- ``targets``: what is not here (fake tensors for a GPU one lacks, FSDP2 ranks, the host link).
"""
