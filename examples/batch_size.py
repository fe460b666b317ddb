"""How much larger a batch fits the same memory with optimal recomputation?

A small GPT-2 (transformers config, random weights, synthetic tokens) on the CPU: the budget is
the peak of a training step at ``--fits`` sequences without recomputation; the search finds the
largest batch whose least-cost plan fits it within ``--max-overhead``, confirms it with a real step,
and prints both batch sizes, their ratio and the measured peak.

    python examples/batch_size.py                    # about 5-15 s on 2 CPU cores
    python examples/batch_size.py --fits 4 --max-overhead 0.2
    python examples/batch_size.py --figures docs/figures.json   # record the figures README quotes
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fits", type=int, default=8, help="the batch that defines the budget (fits without recomputation)")
    parser.add_argument("--max-overhead", type=float, default=0.35, help="largest recompute FLOPs, as a share of a step")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--figures", default=None, help="record the printed figures in this JSON file (docs/figures.json)")
    args = parser.parse_args(argv)
    import sys
    from pathlib import Path
    import time

    started = time.perf_counter()

    from lightning_remat import find_remat_batch_size
    from lightning_remat.runtime.measuring.measure import measure_step
    from lightning_remat.models import build

    torch.set_num_threads(1)
    vocab = 256
    model = build("gpt2", layers=4, hidden=64, seq_len=args.seq_len, vocab=vocab, batch_size=1).model

    def make_step(batch_size: int):
        ids = torch.randint(0, vocab, (batch_size, args.seq_len), generator=torch.Generator().manual_seed(batch_size))
        return lambda m: m(input_ids=ids, labels=ids).loss

    # The budget: what a steady-state step at --fits sequences needs with nothing recomputed.
    import copy

    probe = copy.deepcopy(model)
    probe_optimizer = torch.optim.AdamW(probe.parameters())
    measure_step(probe, make_step(args.fits), probe_optimizer)
    budget = measure_step(probe, make_step(args.fits), probe_optimizer).peak_bytes
    del probe, probe_optimizer

    optimizer = torch.optim.AdamW(model.parameters())
    result = find_remat_batch_size(model, make_step, budget, optimizer=optimizer, init_val=2,
                                   max_val=512, max_overhead=args.max_overhead)
    print(result.summary())
    print(f"budget {budget / 2**20:.2f} MiB: batch {result.batch_size_without_remat} without recomputation, "
          f"{result.batch_size} with it ({result.ratio:.2f}x) at {result.predicted_overhead:.1%} recompute FLOPs; "
          f"measured peak {result.measured_peak_bytes / 2**20:.2f} MiB")
    if args.figures:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # docs tooling: not in the wheel
        from doc_figures import figures_key, record_figures
        from lightning_binsearch import lightning_binsearch_sizes

        record_figures(args.figures, figures_key("examples/batch_size.py", list(argv if argv is not None else sys.argv[1:])), {
            "budget_mib": budget / 2**20, "batch_without": result.batch_size_without_remat, "batch": result.batch_size,
            "ratio": result.ratio, "overhead_pct": 100 * result.predicted_overhead,
            "predicted_mib": result.plan.predicted_peak_bytes / 2**20, "measured_mib": result.measured_peak_bytes / 2**20,
            "trial_steps": result.trial_steps,
            "binsearch_trial_steps": len(lightning_binsearch_sizes(2, result.largest_fitting, max_val=513)),
            "seconds": time.perf_counter() - started})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
