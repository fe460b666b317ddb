"""Lightning's ``BatchSizeFinder(mode="binsearch")`` as a list of the sizes it tries (docs tooling, not in the wheel).

It is the yardstick ``find_remat_batch_size``'s real trial steps are compared with in docs/batch_size.md,
``examples/batch_size.py --figures`` and tests/test_batch_size.py (which checks it against Lightning's own callback).

>>> lightning_binsearch_sizes(2, 28)
[2, 4, 8, 16, 32, 24, 28, 30, 29]
"""

from __future__ import annotations

DEFAULT_MAX_BATCH_SIZE = 8192  # Lightning's BatchSizeFinder max_val


def lightning_binsearch_sizes(init_val: int, largest_fitting: int, max_trials: int = 25,
                              max_val: int = DEFAULT_MAX_BATCH_SIZE) -> list[int]:
    """The batch sizes Lightning's ``BatchSizeFinder(mode="binsearch")`` tries when exactly the sizes up to
    ``largest_fitting`` succeed (transcribed from Lightning 2.6's ``_run_binsearch_scaling``).
    """
    if init_val < 1:
        raise ValueError(f"init_val must be >= 1, got {init_val}")
    low, high, count = 1, None, 0
    new_size = init_val
    tried: list[int] = []
    while True:
        if new_size >= max_val:
            break
        tried.append(new_size)
        if new_size <= largest_fitting:
            count += 1
            if count >= max_trials:
                break
            low = new_size
            if high:
                if high - low <= 1:
                    break
                next_size = (high + low) // 2
            else:
                next_size = int(new_size * 2.0)
            next_size = min(next_size, max_val)
            changed = next_size != new_size
            new_size = next_size
            if not changed:
                break
        else:
            high = new_size
            new_size = min((high + low) // 2, max_val)
            if high - low <= 1:
                break
    return tried
