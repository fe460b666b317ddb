"""The longest context table of issue 32: Llama-3-8B and Qwen2.5-7B, LoRA (r=16, q/v) and full fine-tuning, at
128K-512K tokens, planned on fake tensors for an H100 (80 GB, bf16-true, AdamW, batch 1, budget "min": the plan of
least peak, cost: counted FLOPs) with every long-context option on (``chunk_loss``, ``tile_mlp``, ``offload`` with
1 TB of host memory), and the same profile solved again without each option (``core.memory_model.restricted``:
what each option buys, from one profile). Also the longest length ``find_remat_seq_len`` finds, a refusal's
planning time, and a CPU table where each mechanism's measured peak is compared with the predicted one.

    python benchmarks/long_context_table.py --cases llama-lora             # one (model, mode), 128K-512K
    python benchmarks/long_context_table.py --cases llama-lora --tokens 131072 --cache /tmp/lc
    python benchmarks/long_context_table.py --search llama-lora            # the longest length, its time
    python benchmarks/long_context_table.py --refusal llama-full:131072    # refused at 80 GB: what binds, time
    python benchmarks/long_context_table.py --cases llama-lora --fit-from 8192 16384 32768   # predicted, from 3 short profiles
    python benchmarks/long_context_table.py --search llama-lora --search-from 8192 --max-profiles 3   # in minutes
    python benchmarks/long_context_table.py --cpu                          # the CPU verification table
    python benchmarks/long_context_table.py --render                       # the tables of every row in --out

Each run adds its rows to ``--out`` (docs/benchmarks/long_context_table.json by default) and prints the tables.
Profiles are kept in ``--cache`` (JSON) so that the "without" rows and a re-run solve without profiling again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from plan_long_context import GiB, SHAPES, build  # noqa: E402

OUT = ROOT / "docs" / "benchmarks" / "long_context_table.json"
H100_BYTES = 80 * 10**9  # 74.51 GiB
CASES = {"llama-lora": ("Llama-3-8B", "LoRA q/v"), "qwen-lora": ("Qwen2.5-7B", "LoRA q/v"),
         "llama-full": ("Llama-3-8B", "full"), "qwen-full": ("Qwen2.5-7B", "full")}
TOKENS = (131072, 262144, 524288)
WITHOUT = ("", "offload", "tile_mlp", "chunk_loss")  # "": every option offered


def allowed(without: str):
    """Which options a plan "without" an option may choose (every stage keeps "keep")."""
    from lightning_remat.core.offload_model import to_host

    if without == "offload":
        return lambda o: not to_host(o)
    if without == "tile_mlp":
        return lambda o: "tile:" not in o.name
    if without == "chunk_loss":
        return lambda o: o.action.chunks is None
    return lambda o: True


def planner(device_memory: str | None = None):
    from lightning_remat.core.config import ProfileOptions, RematConfig
    from lightning_remat.service.planning import Planner

    options = ProfileOptions(fake=True, precision="bf16-true", device="cuda", gpu="h100", chunk_loss=True,
                             tile_mlp=True, offload=True, host_memory="1TB", device_memory=device_memory)
    return Planner(RematConfig("min", cost="flops", profile=options), verbose=False)


def step_and_optimizer(name: str, mode: str, tokens: int):
    model = build(name, mode)
    ids = torch.randint(0, SHAPES[name]["vocab_size"], (1, tokens))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return model, (lambda m: m(input_ids=ids, labels=ids).loss), optimizer


def profiled(case: str, tokens: int, cache: Path):
    """(model, step, optimizer) and the profile with every option (from ``cache`` if there), and the seconds profiling took."""
    from lightning_remat.core.memory_model import Profile

    name, mode = CASES[case]
    model, step, optimizer = step_and_optimizer(name, mode, tokens)
    path = cache / f"{case}-{tokens}.json"
    if path.exists():
        data = json.loads(path.read_text())
        return (model, step, optimizer), Profile.from_dict(data["profile"]), data["seconds"]
    start = time.perf_counter()
    profile = planner().profile(model, step, optimizer)
    seconds = time.perf_counter() - start
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"profile": profile.to_dict(), "seconds": seconds}))
    return (model, step, optimizer), profile, seconds


def binds(binding: dict | None) -> str:
    """The term at the peak, short: its kind, the last two parts of its name, its bytes split."""
    if not binding:
        return ""
    name = ".".join(str(binding["name"]).split(".")[-2:])
    return (f"{binding['term']} {name}: own {binding['own_bytes'] / GiB:.2f}, stored {binding['stored_bytes'] / GiB:.2f}, "
            f"static {binding['static_bytes'] / GiB:.2f} GiB")


def solved(case: str, tokens: int, without: str, model, profile, profile_seconds: float) -> dict:
    from lightning_remat.core.memory_model import restricted

    start = time.perf_counter()
    plan = planner().solve_profile(model, restricted(profile, allowed(without)))
    seconds = time.perf_counter() - start
    chosen: dict[str, int] = {}
    for choice in plan.choices:
        chosen[choice.option] = chosen.get(choice.option, 0) + 1
    name, mode = CASES[case]
    return dict(kind="plan", model=name, mode=mode, tokens=tokens, without=without,
                least_peak_gib=round(plan.predicted_peak_bytes / GiB, 2), fits=plan.predicted_peak_bytes <= H100_BYTES,
                binds=binds(plan.binding), host_gib=round(plan.host_bytes / GiB, 2),
                overhead=round(plan.predicted_overhead or 0.0, 4), options=chosen,
                profile_s=round(profile_seconds, 1), solve_s=round(seconds, 1))


def plan_rows(case: str, tokens: int, cache: Path) -> list[dict]:
    (model, _, _), profile, seconds = profiled(case, tokens, cache)
    return [solved(case, tokens, without, model, profile, seconds) for without in WITHOUT]


def fitted(case: str, tokens: int, nodes: list[int], cache: Path):
    """(model, step, optimizer) at ``tokens`` and its profile predicted by ``core.shape_fit.LengthFit`` from the
    profiles at ``nodes`` (each from ``cache`` or made), and the seconds those profiles took."""
    from lightning_remat.core.shape_fit import LengthFit

    made = {n: profiled(case, n, cache) for n in nodes}
    return (step_and_optimizer(*CASES[case], tokens), LengthFit({n: p for n, (_, p, _) in made.items()}).at(tokens),
            sum(s for _, _, s in made.values()))


def fit_rows(case: str, tokens: int, nodes: list[int], cache: Path) -> list[dict]:
    """``plan_rows`` on the profile the fit through ``nodes`` predicts at ``tokens`` (kind "fit")."""
    (model, _, _), profile, seconds = fitted(case, tokens, nodes, cache)
    rows = [solved(case, tokens, without, model, profile, seconds) for without in WITHOUT]
    return [{**r, "kind": "fit", "fit_from": nodes} for r in rows]


def refusal_row(case: str, tokens: int, cache: Path, nodes: list[int] | None = None) -> dict:
    """Planning against the H100's 80 GB where the least peak is above it: the error (what binds, the knobs that
    would fit) and the time, the profile's (made once, kept in ``cache``; or the fit's through ``nodes``) and the
    refusal's own."""
    name, mode = CASES[case]
    if nodes:
        (model, step, optimizer), profile, profile_seconds = fitted(case, tokens, nodes, cache)
    else:
        (model, step, optimizer), profile, profile_seconds = profiled(case, tokens, cache)
    start = time.perf_counter()
    try:
        plan = planner("80GB").solve_or_advise(model, step, optimizer, profile)
        said = f"planned: {plan.predicted_peak_bytes / GiB:.2f} GiB"
    except Exception as error:  # noqa: BLE001 - the refusal is the row
        said = " ".join(str(error).split())
    return dict(kind="refusal", model=name, mode=mode, tokens=tokens, said=said, profile_s=round(profile_seconds, 1),
                seconds=round(time.perf_counter() - start, 1), fit_from=nodes or [])


def search_row(case: str, start_len: int, max_len: int, max_profiles: int = 12) -> dict:
    from lightning_remat import find_remat_seq_len

    name, mode = CASES[case]
    model = build(name, mode)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    def make_step(length: int):
        ids = torch.randint(0, SHAPES[name]["vocab_size"], (1, length))
        return lambda m: m(input_ids=ids, labels=ids).loss

    start = time.perf_counter()
    try:
        result = find_remat_seq_len(model, make_step, "80GB", optimizer=optimizer, cost="flops", fake=True,
                                    precision="bf16-true", device="cuda", gpu="h100", chunk_loss=True, tile_mlp=True,
                                    offload=True, host_memory="1TB", init_val=start_len, max_seq_len=max_len,
                                    multiple_of=1024, max_profiles=max_profiles, verbose=False)
    except Exception as error:  # noqa: BLE001 - no length fits: the error is the answer
        return dict(kind="search", model=name, mode=mode, max_profiles=max_profiles, seq_len=0, first_failing=None, least_peak_gib=0.0,
                    binds=" ".join(str(error).split()), failing_binds="", profiles=0, tried=[],
                    seconds=round(time.perf_counter() - start, 1))
    return dict(kind="search", model=name, mode=mode, max_profiles=max_profiles, seq_len=result.seq_len, first_failing=result.first_failing,
                least_peak_gib=round(result.plan.predicted_peak_bytes / GiB, 2), binds=binds(result.binding),
                failing_binds=binds(result.failing_binding), profiles=result.profiles,
                tried=[r.seq_len for r in result.tried if r.profiled], seconds=round(time.perf_counter() - start, 1))


def _short(tokens: int) -> str:
    return f"{tokens // 1024}K"


def render(rows: list[dict]) -> str:
    """Markdown tables of every kind of row present."""
    out = []
    plans = [r for r in rows if r["kind"] == "plan"]
    if plans:
        out += ["| model | trainable | tokens | without | least peak | what binds | host memory | overhead (FLOPs) "
                "| options chosen | planned in |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in plans:
            options = ", ".join(f"{n} x{c}" for n, c in sorted(r["options"].items()))
            took = (f"{r['profile_s'] + r['solve_s']:.0f} s" if not r["without"] else f"{r['solve_s']:.1f} s (re-solved)")
            out.append(f"| {r['model']} | {r['mode']} | {_short(r['tokens'])} | {r['without'] or '(all on)'} "
                       f"| {r['least_peak_gib']:.2f} GiB ({'fits' if r['fits'] else 'does not fit'}) | {r['binds']} "
                       f"| {r['host_gib']:.2f} GiB | {r['overhead']:.1%} | {options} | {took} |")
    fits = [r for r in rows if r["kind"] == "fit"]
    if fits:
        profiled_peaks = {(r["model"], r["mode"], r["tokens"], r["without"]): r["least_peak_gib"] for r in plans}
        out += ["", "| model | trainable | tokens | without | predicted least peak | profiled there | what binds "
                "| host memory | overhead (FLOPs) | profiles at | their time + solve |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in fits:
            there = profiled_peaks.get((r["model"], r["mode"], r["tokens"], r["without"]))
            out.append(f"| {r['model']} | {r['mode']} | {_short(r['tokens'])} | {r['without'] or '(all on)'} "
                       f"| {r['least_peak_gib']:.2f} GiB ({'fits' if r['fits'] else 'does not fit'}) "
                       f"| {'-' if there is None else f'{there:.2f} GiB'} | {r['binds']} | {r['host_gib']:.2f} GiB "
                       f"| {r['overhead']:.1%} | {', '.join(_short(n) for n in r['fit_from'])} "
                       f"| {r['profile_s']:.0f} + {r['solve_s']:.1f} s |")
    searches = [r for r in rows if r["kind"] == "search"]
    if searches:
        out += ["", "| model | trainable | longest length | its least peak | what binds there | first that does not fit "
                "| what binds there | lengths profiled | search time |", "|---|---|---|---|---|---|---|---|---|"]
        for r in searches:
            failing = str(r["first_failing"]) if r["first_failing"] else "-"
            out.append(f"| {r['model']} | {r['mode']} | {r['seq_len']:,} | {r['least_peak_gib']:.2f} GiB | {r['binds']} "
                       f"| {failing} | {r['failing_binds']} | {', '.join(map(str, r['tried']))} | {r['seconds']:.0f} s |")
    refusals = [r for r in rows if r["kind"] == "refusal"]
    if refusals:
        out += ["", "| model | trainable | tokens | what the planner says (80 GB) | profile | refusal |",
                "|---|---|---|---|---|---|"]
        out += [f"| {r['model']} | {r['mode']} | {_short(r['tokens'])} | {r['said']} | {r['profile_s']:.0f} s"
                + (f" (fit from {', '.join(_short(n) for n in r['fit_from'])})" if r.get("fit_from") else "")
                + f" | {r['seconds']:.0f} s |" for r in refusals]
    cpu = [r for r in rows if r["kind"] == "cpu"]
    if cpu:
        out += ["", "| mechanism | model | options chosen | predicted peak | measured peak | predicted - measured "
                "| max abs gradient diff |", "|---|---|---|---|---|---|---|"]
        out += [f"| {r['mechanism']} | {r['model']} | {', '.join(r['options'])} | {r['predicted']:,} B "
                f"| {r['measured']:,} B | {r['difference']:+.3%} | {r['grad_diff']:.1e} |" for r in cpu]
    return "\n".join(out)


def merged(out: Path, new: list[dict]) -> list[dict]:
    """The rows in ``out`` with ``new`` in place of any of the same key, in a stable order."""
    old = json.loads(out.read_text())["rows"] if out.exists() else []
    key = lambda r: tuple(str(r.get(k)) for k in ("kind", "model", "mode", "tokens", "without", "mechanism", "fit_from", "max_profiles"))  # noqa: E731
    table = {key(r): r for r in old}
    table.update({key(r): r for r in new})
    order = {"plan": 0, "fit": 1, "search": 2, "refusal": 3, "cpu": 4}
    models = {"Llama-3-8B": 0, "Qwen2.5-7B": 1}
    return sorted(table.values(), key=lambda r: (order[r["kind"]], r.get("mode") == "full", models.get(r.get("model"), 2),
                                                  r.get("tokens", 0), WITHOUT.index(r.get("without", ""))))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=[], choices=list(CASES))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--search", nargs="*", default=[], choices=list(CASES))
    parser.add_argument("--search-from", type=int, default=65536, help="the search's first length")
    parser.add_argument("--max-profiles", type=int, default=12, help="the search's max_profiles")
    parser.add_argument("--fit-from", type=int, nargs="*", default=[],
                        help="--cases and --refusal from the fit through profiles at these lengths")
    parser.add_argument("--refusal", nargs="*", default=[], help="CASE:TOKENS planned against 80 GB")
    parser.add_argument("--cpu", action="store_true", help="the CPU verification table")
    parser.add_argument("--render", action="store_true", help="only print the tables of --out")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/long_context_profiles"))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--merge", type=Path, nargs="*", default=[], help="add the rows of these JSON files to --out")
    args = parser.parse_args(argv)
    for case in args.cases:
        for tokens in args.tokens:
            rows = (fit_rows(case, tokens, args.fit_from, args.cache) if args.fit_from
                    else plan_rows(case, tokens, args.cache))
            args.out.write_text(json.dumps({"rows": merged(args.out, rows)}, indent=1) + "\n")
            print(render(rows), flush=True)
    for case in args.search:
        rows = [search_row(case, args.search_from, 2**20, args.max_profiles)]
        args.out.write_text(json.dumps({"rows": merged(args.out, rows)}, indent=1) + "\n")
        print(render(rows), flush=True)
    for item in args.refusal:
        case, tokens = item.split(":")
        rows = [refusal_row(case, int(tokens), args.cache, args.fit_from)]
        args.out.write_text(json.dumps({"rows": merged(args.out, rows)}, indent=1) + "\n")
        print(render(rows), flush=True)
    if args.cpu:
        from long_context_cpu import cpu_rows  # noqa: PLC0415 - benchmarks/long_context_cpu.py

        rows = cpu_rows()
        args.out.write_text(json.dumps({"rows": merged(args.out, rows)}, indent=1) + "\n")
        print(render(rows), flush=True)
    for path in args.merge:
        args.out.write_text(json.dumps({"rows": merged(args.out, json.loads(path.read_text())["rows"])}, indent=1) + "\n")
    if args.render:
        print(render(json.loads(args.out.read_text())["rows"]))


if __name__ == "__main__":
    main()
