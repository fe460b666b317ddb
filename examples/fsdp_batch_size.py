"""Find the largest batch per rank of a small GPT-2 sharded with FSDP2 (``fully_shard``), with recomputation.

Every rank shards the model, then calls ``find_remat_batch_size`` (its profiles and trial steps run
FSDP2's collectives, so all ranks search in lockstep); every rank gets rank 0's batch size and plan,
and the budget is per rank. On a CPU with 2 processes (gloo):

    torchrun --nproc_per_node 2 examples/fsdp_batch_size.py --budget 7.6MB

On GPUs use ``--backend nccl``; the budget is per GPU. docs/batch_size.md, "Sharded models".
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from lightning_remat import find_remat_batch_size, format_bytes
from lightning_remat.models import build
from lightning_remat.runtime.measuring.measure import measure_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="7.6MB", help='per-rank budget ("7.6MB", "20GB", ...)')
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    device = "cpu"
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = "cuda"
    torch.manual_seed(0)
    model = build("gpt2", layers=args.layers, hidden=args.hidden, seq_len=32, batch_size=2, vocab=128).model.to(device)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def make_step(batch_size: int):
        # Every rank builds a batch of the same shape (its own data in real training).
        ids = torch.randint(0, 128, (batch_size, 32), device=device)
        return lambda m: m(input_ids=ids, labels=ids).loss

    result = find_remat_batch_size(model, make_step, args.budget, optimizer=optimizer, max_val=256)
    # Train at the batch found (the plan is applied); the budget holds on every rank or it does not hold.
    peaks = [measure_step(model, make_step(result.batch_size), optimizer).peak_bytes for _ in range(3)]
    steady = torch.tensor(float(max(peaks[1:])), device=device)
    dist.all_reduce(steady, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(result.summary())
        print(f"batch {result.batch_size} per rank with recomputation, {result.batch_size_without_remat} without; "
              f"largest per-rank peak of a steady step: {format_bytes(int(steady))} "
              f"(budget {format_bytes(result.budget_bytes)})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
