"""Plan recomputation for a Llama-2-7B training step on an 80 GB GPU, on a machine without one.

The model is built on the meta device (no weights are allocated) and profiled under fake tensors
for a CUDA device (AdamW's batched "foreach" step, as CUDA runs it), in pure bf16 by default
(``--precision bf16-mixed`` keeps float32 weights, gradients and moments: 16 bytes per parameter),
with FLOPs priced at an H100's speed.

    python examples/plan_llama7b.py                 # the full 32 layers, 1 x 2048 tokens
    python examples/plan_llama7b.py --layers 2 --json
    python examples/plan_llama7b.py --figures docs/figures.json   # record the figures README quotes
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch


def peak_resident_bytes() -> int:
    """This process's peak resident memory.

    Read from /proc (VmHWM belongs to the current program) where there is one: ``ru_maxrss``
    carries over from a parent process across fork and exec, so a script started by a large
    process (a benchmark, a test runner) would report its parent's peak.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_llama(layers: int):
    """Llama-2-7B's published sizes on the meta device (no memory), with ``layers`` layers."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                      num_key_value_heads=32, num_hidden_layers=layers, vocab_size=32000,
                                      max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return model.train()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (Llama-2-7B has 32)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per batch")
    parser.add_argument("--budget", default="90%", help='budget, e.g. "90%%" of --device-memory or "60GB"')
    parser.add_argument("--device-memory", default="80GB", help="the target GPU's memory")
    parser.add_argument("--gpu", default="h100", help="the target GPU, for pricing FLOPs in seconds")
    parser.add_argument("--precision", default="bf16-true", choices=("bf16-true", "bf16-mixed", "32-true"),
                        help="bf16-true: weights, gradients and AdamW state in bf16 (16 GB per billion parameters "
                             "less); bf16-mixed keeps them in float32 (16 bytes per parameter)")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--figures", default=None, help="record the printed figures in this JSON file (docs/figures.json)")
    args = parser.parse_args(argv)

    from lightning_remat import BudgetTooSmallError, plan_remat

    start = time.perf_counter()
    model = build_llama(args.layers)
    ids = torch.randint(0, 32000, (args.batch, args.seq))
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        plan = plan_remat(model, lambda m: m(input_ids=ids, labels=ids).loss, args.budget, optimizer=optimizer,
                          cost="time", fake=True, precision=args.precision, device="cuda", gpu=args.gpu,
                          device_memory=args.device_memory)
    except BudgetTooSmallError as err:
        raise SystemExit(f"plan_llama7b: {too_small(err, args)}") from None
    result = {
        "layers": args.layers, "tokens": args.batch * args.seq, "seconds": time.perf_counter() - start,
        "max_resident_bytes": peak_resident_bytes(),
        "plan": plan.to_dict(), "summary": plan.summary(),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(plan.summary())
        print(f"planned in {result['seconds']:.1f} s with {result['max_resident_bytes'] / 2**30:.2f} GiB resident")
    if args.figures:
        record(args, argv, plan, result)
    return result


def too_small(err, args) -> str:
    """What to change when no plan fits: the batch only where the batch is what does not fit."""
    from lightning_remat import format_bytes

    least, static = format_bytes(err.smallest_peak_bytes), format_bytes(err.static_bytes)
    if err.static_bytes >= err.budget_bytes:
        # Parameters, gradients and optimizer state alone exceed the budget: no recomputation and no
        # smaller batch frees any of them.
        return (f"no plan fits {args.budget} of {args.device_memory}: parameters, gradients and AdamW state alone take "
                f"{static} in {args.precision} (the least peak is {least}), which no recomputation or smaller batch "
                "reduces; use --precision bf16-true, shard the model over GPUs (plan_remat(..., world_size=8), "
                "lightning-remat plan --world-size 8) or a GPU with more memory (--device-memory)")
    return (f"no plan fits {args.budget} of {args.device_memory}: the least peak is {least} ({static} of it parameters, "
            f"gradients and AdamW state); fewer tokens per step (--batch {args.batch}, --seq {args.seq}) or a larger "
            "--budget")


def record(args, argv, plan, result) -> None:
    """The figures README quotes, as printed, into ``--figures``."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # docs tooling: not in the wheel
    from doc_figures import figures_key, record_figures

    gib = 2.0**30
    record_figures(args.figures, figures_key("examples/plan_llama7b.py", list(argv if argv is not None else sys.argv[1:])), {
        "baseline_gib": plan.baseline_peak_bytes / gib, "predicted_gib": plan.predicted_peak_bytes / gib,
        "budget_gib": plan.budget_bytes / gib, "overhead_pct": 100 * plan.predicted_overhead,
        "recomputed": len(plan.checkpointed), "parameters_gib": plan.parameter_bytes / gib,
        "gradients_gib": plan.gradient_bytes / gib, "optimizer_state_gib": plan.optimizer_state_bytes / gib,
        "seconds": result["seconds"], "resident_gib": result["max_resident_bytes"] / gib})


if __name__ == "__main__":
    main()
