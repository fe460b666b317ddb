"""Attention at long context on a fake H100: Llama-3-8B, LoRA on q/v, bf16-true, chunk_loss, 32K-128K tokens.

For each length: the least peak the planner finds (budget "min"), what one layer keeps for backward when
nothing is recomputed, what its attention (``F.scaled_dot_product_attention``) keeps of that, and the
planning time. Run it against two checkouts (``PYTHONPATH=...``) to compare before and after a change.

    python benchmarks/long_attention.py --seq 32768 65536 131072 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from plan_long_context import GiB, SHAPES, build  # noqa: E402

MiB = 2**20
# Past 80 GB the planner refuses (and prices more GPUs, minutes at 128K): the least peak is asked of a
# device large enough, then compared with the H100's 80 GB.
DEVICE_MEMORY = "1000GB"


def attention_bytes(seq: int) -> tuple[int, int]:
    """(bytes one Llama-3-8B attention call keeps for backward beyond q, k, v; the peak of its backward: q, k, v,
    what it kept, dout, dq, dk, dv and the kernel's workspace), on fake tensors as a profile for a GPU runs it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from lightning_remat.runtime.targets.fake_attention import cuda_attention

    with FakeTensorMode():
        q = torch.empty(1, 32, seq, 128, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.empty(1, 8, seq, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        saved: dict[int, torch.Tensor] = {}
        with cuda_attention(True):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.setdefault(id(t), t), lambda t: t):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            kept = sum(t.untyped_storage().nbytes() for t in saved.values() if t is not q and t is not k and t is not v)
            tracker = MemTracker()
            tracker.track_external(q, k, v, out)
            with tracker:
                out.backward(torch.empty_like(out))
            peak = tracker.get_tracker_snapshot("peak")[q.device]["Total"]
    return kept, peak


def plan_one(seq: int) -> dict:
    from lightning_remat import plan_remat

    model = build("Llama-3-8B", "LoRA q/v")
    ids = torch.randint(0, SHAPES["Llama-3-8B"]["vocab_size"], (1, seq))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    start = time.perf_counter()
    plan = plan_remat(model, lambda m: m(input_ids=ids, labels=ids).loss, "min", optimizer=optimizer, cost="flops",
                      fake=True, precision="bf16-true", device="cuda", gpu="h100", device_memory=DEVICE_MEMORY,
                      chunk_loss=True, verbose=False)
    seconds = time.perf_counter() - start
    kept, backward_peak = attention_bytes(seq)
    return dict(seq=seq, least_peak_gib=plan.predicted_peak_bytes / GiB, fits_80gb=plan.predicted_peak_bytes <= 80e9, attention_kept_mib=kept / MiB,
                attention_backward_peak_mib=backward_peak / MiB, seconds=seconds,
                notes=[n for n in plan.notes if "attention" in n])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for seq in args.seq:
        rows.append(plan_one(seq))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
