"""Measuring a real step: memory trackers, the step runner, FLOPs and roofline costs, trial steps."""
