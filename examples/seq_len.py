"""How long a sequence fits a memory budget with optimal recomputation?

A tiny Llama (transformers config, random weights, AdamW, batch 1) on the CPU: the budget is the peak of a
training step at ``--fits`` tokens without recomputation; ``find_remat_seq_len`` finds the longest sequence
(a multiple of ``--multiple-of``) whose plan fits it, confirms it with a real step, and prints the answer,
what binds there and at the first length that does not fit, and the lengths it profiled.

    python examples/seq_len.py                  # a few seconds on 2 CPU cores
    python examples/seq_len.py --llama8b        # also Llama-3-8B (LoRA q/v) on fake tensors for an 80 GB H100

``--llama8b`` plans on fake tensors (nothing is allocated): bf16-true, AdamW, the head and loss chunked,
checkpointed inputs offloadable to 1 TB of host memory, batch 1, lengths multiples of 1024 from 32K on
(5 or 6 profiles of about 30-60 s each on a laptop CPU).
"""

from __future__ import annotations

import argparse
import time

import torch


def tiny(fits: int, multiple_of: int, max_seq_len: int):
    """The tiny Llama's search: its budget is the peak of a plain step at ``fits`` tokens."""
    from lightning_remat import find_remat_seq_len
    from lightning_remat.models import build
    from lightning_remat.runtime.measuring.measure import measure_step

    torch.set_num_threads(1)
    vocab = 256
    model = build("llama", layers=2, hidden=64, seq_len=fits, vocab=vocab, batch_size=1).model

    def make_step(seq_len: int):
        ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
        return lambda m: m(input_ids=ids, labels=ids).loss

    optimizer = torch.optim.AdamW(model.parameters())
    measure_step(model, make_step(fits), optimizer)  # the optimizer's state exists from here on
    budget = measure_step(model, make_step(fits), optimizer).peak_bytes
    result = find_remat_seq_len(model, make_step, budget, optimizer=optimizer, multiple_of=multiple_of,
                                max_seq_len=max_seq_len, init_val=fits // 2, verbose=False)
    print(f"tiny Llama (2 layers, hidden 64), budget {budget / 2**20:.2f} MiB = a plain step at {fits} tokens:")
    print(result.summary())
    return result


def llama8b(multiple_of: int, max_seq_len: int):
    """Llama-3-8B with LoRA on q/v, planned on fake tensors for an 80 GB H100."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from plan_long_context import build

    from lightning_remat import find_remat_seq_len

    model = build("Llama-3-8B", "LoRA q/v")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    def make_step(seq_len: int):
        ids = torch.zeros(1, seq_len, dtype=torch.long)
        return lambda m: m(input_ids=ids, labels=ids).loss

    result = find_remat_seq_len(model, make_step, "80GB", optimizer=optimizer, init_val=32768, multiple_of=multiple_of,
                                max_seq_len=max_seq_len, apply=False, verbose=False, fake=True, device="cuda",
                                gpu="h100", device_memory="80GB", precision="bf16-true", chunk_loss=True, offload=True,
                                host_memory="1TB")
    print("Llama-3-8B, LoRA r=16 on q/v, fake H100 80 GB, bf16-true, AdamW, chunk_loss, offload (1 TB host):")
    print(result.summary())
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fits", type=int, default=256, help="the length that defines the tiny model's budget")
    parser.add_argument("--multiple-of", type=int, default=32, help="lengths searched are its multiples (tiny model)")
    parser.add_argument("--max-seq-len", type=int, default=8192, help="the longest length searched (tiny model)")
    parser.add_argument("--llama8b", action="store_true", help="also search Llama-3-8B on fake tensors (minutes)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    results = [tiny(args.fits, args.multiple_of, args.max_seq_len)]
    if args.llama8b:
        results.append(llama8b(1024, 2**20))
    print(f"done in {time.perf_counter() - started:.1f} s")
    return results


if __name__ == "__main__":
    main()
