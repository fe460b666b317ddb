"""Plan recomputation for a Llama-2-7B training step on an 80 GB GPU, on a machine without one.

The model is built on the meta device (no weights are allocated) and profiled under fake tensors
for a CUDA device (AdamW's batched "foreach" step, as CUDA runs it), in pure bf16 by default
(``--precision bf16-mixed`` keeps float32 weights, gradients and moments: 16 bytes per parameter),
with FLOPs priced at an H100's speed.

    python examples/plan_llama7b.py                 # the full 32 layers, 1 x 2048 tokens
    python examples/plan_llama7b.py --layers 2 --json
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
    args = parser.parse_args(argv)

    from lightning_remat import plan_remat

    start = time.perf_counter()
    model = build_llama(args.layers)
    ids = torch.randint(0, 32000, (args.batch, args.seq))
    optimizer = torch.optim.AdamW(model.parameters())
    plan = plan_remat(model, lambda m: m(input_ids=ids, labels=ids).loss, args.budget, optimizer=optimizer,
                      cost="time", fake=True, precision=args.precision, device="cuda", gpu=args.gpu,
                      device_memory=args.device_memory)
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
    return result


if __name__ == "__main__":
    main()
