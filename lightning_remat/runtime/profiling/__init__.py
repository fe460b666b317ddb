"""Profiling a step in the terms of the memory model: candidates, per-stage terms, identical-layer stacks."""
