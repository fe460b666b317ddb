"""Every fixed byte allowance the package adds to a profile, named, with what it stands for.

An allowance covers memory that is alive through a training step but that no profile can see,
because it belongs to code outside the profiled ``step(model)``; it is added to every term of the
memory model (``runtime.profiling.profile_adjust.with_always_alive``). The figures are small
and deliberately rounded up: what was seen alive at the peak of a real run (said beside each), in
whole blocks of the CUDA caching allocator (which rounds every tensor up to 512 bytes), with room.
Plain numbers, no torch.

Example:
    >>> ALLOWANCES["lightning_loop"] == LIGHTNING_LOOP_ALLOWANCE == 1024
    True
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

# DDP's reducer keeps small bookkeeping tensors of its own beside its gradient buckets (the buckets
# themselves, one copy of the trainable gradients, are counted exactly): a 4-byte scalar was alive
# at the peak of a 2-process CPU run; two CUDA blocks.
DDP_REDUCER_ALLOWANCE = 1024

# Lightning's loop keeps a few scalars of its own alive through a step (the loss it returns and
# logs), which the profile of ``training_step`` does not see: 4 bytes at the peak of a 2-process
# DDP or FSDP2 run on the CPU, 10 with a compiled module; two CUDA blocks.
LIGHTNING_LOOP_ALLOWANCE = 1024

# The user's loss scalar and Accelerate's copy of it (``accelerator.backward`` divides the loss by
# ``gradient_accumulation_steps``, even by 1), alive through the backward, which re-running the
# model alone does not see: a CUDA block (512 bytes) each, with room.
ACCELERATE_LOOP_ALLOWANCE = 2048

# A real profile (``fake=False``, only where the plain step is predicted to fit) holds a few tensors of
# its own beside the plain step it runs (random-generator states, recorded outputs' bookkeeping): 8 KiB
# above the plain first step of a 3-layer GPT-2 on the CPU; rounded up to 64 KiB.
REAL_PROFILE_ALLOWANCE = 64 * 1024

# The user's loss computed outside the model (``criterion(model(x), y)``), before any step showed what
# it costs: this many copies of the model's outputs that require a gradient (a cross-entropy keeps its
# log-softmax, one copy, and its backward a temporary of the same size; one more for a float32 upcast
# of half-precision logits is within the second), counted where the loss runs, at the end of forward.
USER_LOSS_OUTPUT_COPIES = 2

ALLOWANCES: Mapping[str, int] = MappingProxyType({
    "ddp_reducer": DDP_REDUCER_ALLOWANCE,
    "lightning_loop": LIGHTNING_LOOP_ALLOWANCE,
    "accelerate_loop": ACCELERATE_LOOP_ALLOWANCE,
    "real_profile": REAL_PROFILE_ALLOWANCE,
})
