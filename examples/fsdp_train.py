"""Train a small GPT-2 sharded with FSDP2 (``fully_shard``) across processes, under a per-rank budget.

Every rank shards the model, then calls ``plan_remat`` (the profiling passes run FSDP2's
collectives, so all ranks profile in lockstep) and ``apply_plan``; rank 0's plan is every rank's.
On a CPU with 2 processes (gloo):

    torchrun --nproc_per_node 2 examples/fsdp_train.py --budget 2.6MB

On GPUs use ``--backend nccl``; the budget is per GPU. docs/sharded.md explains the figures.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from lightning_remat import apply_plan, format_bytes, plan_remat
from lightning_remat.models import build
from lightning_remat.runtime.measuring.measure import measure_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="min", help='per-rank budget ("2.6MB", "min", ...)')
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    case = build("gpt2", layers=args.layers, hidden=args.hidden, seq_len=32, batch_size=2, vocab=128)
    model = case.model.to("cuda" if args.backend == "nccl" else "cpu")
    step = case.step if args.backend != "nccl" else (lambda m, ids=torch.randint(0, 128, (2, 32), device="cuda"):
                                                     m(input_ids=ids, labels=ids).loss)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    plan = plan_remat(model, step, args.budget, optimizer=optimizer, cost="flops")
    apply_plan(model, plan)
    peaks = []
    for _ in range(args.steps):
        peaks.append(measure_step(model, step, optimizer).peak_bytes)
    steady = torch.tensor(float(max(peaks[1:] or peaks)))
    dist.all_reduce(steady, op=dist.ReduceOp.MAX)  # the budget holds on every rank or it does not hold
    if dist.get_rank() == 0:
        print(plan.summary())
        print(f"largest per-rank peak of a steady step: {format_bytes(int(steady))} (predicted "
              f"{format_bytes(plan.predicted_peak_bytes)}, budget {format_bytes(plan.budget_bytes)})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
