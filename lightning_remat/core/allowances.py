"""Fixed byte allowances for memory alive through a step that code outside ``step(model)`` owns, added to every
term of the memory model (whole CUDA allocator blocks of 512 bytes, with room)."""

# DDP's reducer keeps small bookkeeping tensors beside its gradient buckets (the buckets are counted exactly).
DDP_REDUCER_ALLOWANCE = 1024

# Lightning's loop keeps a few scalars alive through a step (the loss it returns and logs), unseen by the profile.
LIGHTNING_LOOP_ALLOWANCE = 1024

# The user's loss scalar and Accelerate's copy of it (divided by the accumulation steps), alive through backward.
ACCELERATE_LOOP_ALLOWANCE = 2048

# A real profile (``fake=False``) holds a few tensors of its own (random-generator states, outputs' bookkeeping).
REAL_PROFILE_ALLOWANCE = 64 * 1024

# The user's loss computed outside the model (``criterion(model(x), y)``): this many copies of the model's
# outputs that require a gradient (a log-softmax and its backward's temporary), counted at the end of forward.
USER_LOSS_OUTPUT_COPIES = 2
