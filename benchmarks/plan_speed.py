"""How long planning takes for Llama-2-7B and a Llama-2-70B-sized model, profiled on fake tensors.

Each model is built on the meta device from a transformers ``LlamaConfig`` (nothing is downloaded
or allocated), trained in pure bf16 with AdamW for an H100, and planned for the least peak
(``budget="min"``: profile, then solve). Each row runs in a fresh process, so its resident-memory
high-water mark is its own. Prints a table and writes ``docs/benchmarks/plan_speed.json``.

    python benchmarks/plan_speed.py                  # 7B and 70B, identical layers profiled once
    python benchmarks/plan_speed.py --also-full      # and 7B with every layer profiled
    python benchmarks/plan_speed.py --row 7b         # one row, JSON on stdout
    python benchmarks/plan_speed.py --world-size 8   # and the 70B sharded over 8 GPUs (FSDP2)
    python benchmarks/plan_speed.py --row 70b --world-size 8
    python benchmarks/plan_speed.py --ab OLD_CHECKOUT NEW_CHECKOUT --runs 2   # CPU seconds A/B, 7B and 70B x 8

With ``--ab`` each row runs in a fresh process that imports the package from one checkout
(``PYTHONPATH``), A and B interleaved (a shared, noisy machine), and the table compares the CPU
seconds of profiling and solving (``time.process_time``: model building and imports excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    # Llama-2-7B: 32 layers, hidden 4096, 32 heads, MLP 11008; 1 x 2048 tokens.
    "7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
               intermediate_size=11008, tokens=2048),
    # Llama-2-70B's sizes: 80 layers, hidden 8192, 64 heads, 8 key/value heads, MLP 28672; 1 x 4096 tokens.
    "70b": dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=28672, tokens=4096),
}
OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "plan_speed.json"


def _resident() -> tuple[int, int]:
    """(peak resident bytes from /proc VmHWM, resource.getrusage's ru_maxrss in bytes)."""
    rusage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, rusage
    except OSError:
        pass
    return rusage, rusage


def row(name: str, repeated_blocks: bool, world_size: int = 1) -> dict:
    """Plan one model in this process (one GPU of ``world_size`` under FSDP2) and report time, memory
    and the predicted peaks."""
    import torch
    import transformers

    from lightning_remat import profile_step  # the package's export, at every version compared
    from lightning_remat.core.config import ProfileOptions
    from lightning_remat.core.solve import least_peak, solve

    transformers.logging.set_verbosity_error()
    sizes = dict(CONFIGS[name])
    tokens = sizes.pop("tokens")
    start = time.perf_counter()
    config = transformers.LlamaConfig(**sizes, vocab_size=32000, max_position_embeddings=tokens, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 32000, (1, tokens))
    optimizer = torch.optim.AdamW(model.parameters())
    cpu = time.process_time()
    options = ProfileOptions(fake=True, dtype=torch.bfloat16, device="cuda", gpu="h100",
                             repeated_blocks=repeated_blocks, world_size=world_size)
    profile = profile_step(model, lambda m: m(input_ids=ids, labels=ids).loss, optimizer=optimizer, options=options)
    plan = solve(profile, "min", cost="flops")
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    hwm, maxrss = _resident()
    return {
        "model": f"llama-{name}", "layers": sizes["num_hidden_layers"], "tokens": tokens,
        "world_size": world_size, "repeated_blocks": repeated_blocks, "extrapolated": any(n.startswith("extrapolated") for n in profile.notes),
        "seconds": round(seconds, 2), "cpu_seconds": round(cpu_seconds, 2), "max_resident_bytes": hwm, "ru_maxrss_bytes": maxrss,
        "baseline_peak_bytes": profile.baseline_peak_bytes, "least_peak_bytes": least_peak(profile),
        "planned_peak_bytes": plan.predicted_peak_bytes, "recomputed": len(plan.checkpointed),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", choices=sorted(CONFIGS), help="run one row here and print its JSON")
    parser.add_argument("--full", action="store_true", help="with --row: profile every layer")
    parser.add_argument("--also-full", action="store_true", help="add a 7B row with every layer profiled")
    parser.add_argument("--world-size", type=int, default=1,
                        help="with --row: plan one GPU of this many under FSDP2; else add a 70B row at this many")
    parser.add_argument("--ab", nargs=2, metavar=("A", "B"), help="two checkouts: CPU seconds of each, interleaved")
    parser.add_argument("--runs", type=int, default=2, help="with --ab: runs of each checkout per row")
    args = parser.parse_args(argv)
    if args.ab:
        return ab(*args.ab, runs=args.runs)
    if args.row:
        print(json.dumps(row(args.row, repeated_blocks=not args.full, world_size=args.world_size)))
        return []
    runs = [("7b", False, 1), ("70b", False, 1)] + ([("7b", True, 1)] if args.also_full else [])
    runs += [("70b", False, args.world_size)] if args.world_size > 1 else []
    rows = []
    for name, full, world_size in runs:
        command = [sys.executable, __file__, "--row", name, "--world-size", str(world_size)] + (["--full"] if full else [])
        out = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    gib = 2**30
    print(f"{'model':10} {'layers':>6} {'GPUs':>4} {'profile':>12} {'seconds':>8} {'max RSS':>9} {'baseline peak':>14} "
          f"{'least peak':>11}")
    for r in rows:
        how = "4+5 layers" if r["extrapolated"] else "all layers"
        print(f"{r['model']:10} {r['layers']:>6} {r.get('world_size', 1):>4} {how:>12} {r['seconds']:>8.1f} {r['max_resident_bytes'] / gib:>7.2f}Gi "
              f"{r['baseline_peak_bytes'] / gib:>12.2f}Gi {r['least_peak_bytes'] / gib:>9.2f}Gi")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": f"{os.cpu_count()} CPUs (shared with other jobs while measured)",
                               "rows": rows}, indent=1) + "\n")
    print(f"written {OUT}")
    return rows


def ab(a: str, b: str, runs: int) -> list[dict]:
    """The 7B plan and the 70B plan at 8 GPUs from checkouts ``a`` and ``b``, interleaved; a table of CPU seconds."""
    import statistics

    rows = []
    for name, world_size in (("7b", 1), ("70b", 8)):
        for i in range(runs):
            for label, checkout in (("A", a), ("B", b)):
                env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}
                out = subprocess.run([sys.executable, __file__, "--row", name, "--world-size", str(world_size)],
                                     check=True, capture_output=True, text=True, env=env).stdout
                rows.append({"checkout": label, "run": i, **json.loads(out.strip().splitlines()[-1])})
                print(json.dumps(rows[-1]), flush=True)
    print("| model | GPUs | A CPU s | B CPU s | B/A (medians) | same least peak |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, world_size in (("7b", 1), ("70b", 8)):
        got = {k: [r for r in rows if r["model"] == f"llama-{name}" and r["checkout"] == k] for k in "AB"}
        a_s, b_s = ([r["cpu_seconds"] for r in got[k]] for k in "AB")
        same = len({r["least_peak_bytes"] for r in got["A"] + got["B"]}) == 1
        print(f"| llama-{name} | {world_size} | {', '.join(map(str, a_s))} | {', '.join(map(str, b_s))} | "
              f"{statistics.median(b_s) / statistics.median(a_s):.2f} | {'yes' if same else 'NO'} |")
    out_path = OUT.with_name("plan_speed_ab.json")
    out_path.write_text(json.dumps({"a": str(Path(a).resolve()), "b": str(Path(b).resolve()), "rows": rows},
                                   indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
