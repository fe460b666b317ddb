"""The runtime: everything that touches torch (candidates, memory tracking, observing and profiling
a step, fake tensors, applying a plan, measuring a step)."""
