"""Plans on models the tests never used (issue 31): Gemma-2, GPT-NeoX, DeBERTa-v2 (masked LM), Whisper (speech
to text) and Swin (image classification) (transformers configs, random weights, nothing downloaded), AdamW,
measured on the CPU:

    nice -n 5 python benchmarks/unseen_models.py [--models gemma2,gptneox,deberta,whisper,swin] [--out FILE]
    python benchmarks/unseen_models.py --merge a.json,b.json  # one table and JSON from runs made apart

Per model, two budgets: static + 50% of the plain step's activations, and the peak Hugging Face's every-layer
checkpointing measures. Rows: plain, HF every layer, op-SAC (``policies=("save_matmuls",)``), ours as a user calls it
(``plan_remat(model, step, budget, optimizer=opt)``: on the CPU ``cost="flops"``), ours with ``chunk_loss=True`` and
ours priced for an H100 (``fake=True, gpu="h100", chunk_loss=True``: a fake-tensor profile, its default cost the
roofline at the H100's figures; the plan is then applied to the real model on the CPU and measured). Columns: the measured peak
(``measure_step`` on the second step, after AdamW's state exists), the predicted peak and its error, whether the
budget held, FLOPs of forward + backward over plain's (torch's FlopCounterMode) and the roofline time over plain's
priced per aten op for an H100 (max(FLOPs / 989e12, bytes / 3.35e12), the package's ``OpRecorder``), and the head's
kind. Also the max abs gradient difference of the ``chunk_loss=True`` plan against the plain model (same weights,
same batch). Writes docs/benchmarks/unseen_models.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from lightning_remat import BudgetTooSmallError, apply_plan, measure_step, plan_remat
from lightning_remat.runtime.measuring.measure import count_step_flops
from lightning_remat.runtime.measuring.roofline import OpRecorder, device_peaks, roofline_seconds

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "unseen_models.json"
BATCH, SEQ, VOCAB = 2, 128, 4096
H100 = device_peaks("cuda", "h100")
MODELS = ("gemma2", "gptneox", "deberta", "whisper", "swin")


def _config(name: str):
    if name == "gemma2":
        return transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, final_logit_softcapping=30.0,
            attn_implementation="eager")
    if name == "gptneox":
        return transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=512)
    if name == "deberta":
        return transformers.DebertaV2ForMaskedLM, transformers.DebertaV2Config(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=512)
    if name == "whisper":  # 2 + 2 layers; 2 x 128 mel frames (64 after the strided conv), 128 decoder tokens
        return transformers.WhisperForConditionalGeneration, transformers.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=80, d_model=128, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256,
            max_source_positions=64, max_target_positions=SEQ, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None)
    if name == "swin":  # 2 stages of 2 blocks, 64 px images, 16 x 16 patches in windows of 4
        return transformers.SwinForImageClassification, transformers.SwinConfig(
            image_size=64, patch_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=10)
    raise ValueError(name)


def _batch(name: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if name == "whisper":
        features = torch.randn(BATCH, 80, 128, generator=g)
        return lambda m: m(input_features=features, labels=ids).loss
    if name == "swin":
        pixels, classes = torch.randn(4 * BATCH, 3, 64, 64, generator=g), torch.randint(0, 10, (4 * BATCH,), generator=g)
        return lambda m: m(pixel_values=pixels, labels=classes).loss
    labels = ids.clone()
    if name == "deberta":  # a masked LM scores the masked 15% only
        labels[torch.rand(ids.shape, generator=g) > 0.15] = -100
        # With an attention mask: without one, transformers' padding check reads the ids' values (.item()), which a
        # fake-tensor profile cannot (FakeProfileError, docs/benchmarks/unseen_models.md)
        mask = torch.ones_like(ids)
        return lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss
    return lambda m: m(input_ids=ids, labels=labels).loss


def _fresh(name: str, state: dict | None):
    cls, cfg = _config(name)
    torch.manual_seed(0)
    model = cls(cfg)
    if state is not None:
        model.load_state_dict(state)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _steady_peak(model, step, opt) -> int:
    opt.zero_grad(set_to_none=True)
    step(model).backward()
    opt.step()  # AdamW's state exists from here
    return measure_step(model, step, opt).peak_bytes


def _costs(model, step) -> tuple[int, float]:
    flops = count_step_flops(model, step)
    rec = OpRecorder()
    with rec:
        step(model).backward()
    model.zero_grad(set_to_none=True)
    return flops, roofline_seconds(rec.ops, H100)


def _head(plan) -> str:
    if plan.fused_loss:
        return ",".join(f"fused:{k}" for k in plan.fused_loss.values())
    if plan.chunked_loss:
        return ",".join(f"chunks:{k}" for k in plan.chunked_loss.values())
    return "whole"


def _plan_row(name, state, step, budget, **kw) -> tuple[dict, object, object]:
    model, opt = _fresh(name, state)
    try:
        plan = plan_remat(model, step, int(budget), optimizer=opt, verbose=False, **kw)
    except BudgetTooSmallError as e:
        return {"infeasible": True, "least_peak": e.smallest_peak_bytes}, None, None
    except Exception as e:  # noqa: BLE001 - recorded in the table: a model the package fails on is a finding
        return {"failed": f"{type(e).__name__}: {str(e)[:300]}"}, None, None
    apply_plan(model, plan)
    peak = _steady_peak(model, step, opt)
    flops, secs = _costs(model, step)
    pred = plan.predicted_peak_bytes
    return {"peak": peak, "predicted": pred, "error": (peak - pred) / pred, "held": peak <= budget,
            "flops": flops, "roofline_s": secs, "head": _head(plan),
            "recomputed": sum(1 for a in plan.actions if a.action.name == "RECOMPUTE"),
            "notes": list(plan.notes)}, plan, model


def _grad_diff(name, state, step, model) -> float:
    ref, _ = _fresh(name, state)
    with torch.no_grad():  # the planned model took two AdamW steps: back to the same weights as the reference
        for (_, p1), (_, p2) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
            p2.copy_(p1)
    model.zero_grad(set_to_none=True)
    for m in (ref, model):  # the same random draws (DeBERTa's dropout, Swin's stochastic depth) in both
        torch.manual_seed(2)
        step(m).backward()
    worst = 0.0
    for (n1, p1), (n2, p2) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        if p1.grad is None and p2.grad is None:
            continue
        worst = max(worst, (p1.grad - p2.grad).abs().max().item())
    return worst


def run_model(name: str) -> dict:
    step = _batch(name)
    model, opt = _fresh(name, None)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plain_peak = _steady_peak(model, step, opt)
    static = 4 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights, grads, 2 AdamW moments
    plain_flops, plain_s = _costs(model, step)
    hf, hf_opt = _fresh(name, state)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.train()
    hf_peak = _steady_peak(hf, step, hf_opt)
    hf_flops, hf_s = _costs(hf, step)
    out = {"static": static, "plain_peak": plain_peak, "hf_peak": hf_peak, "budgets": {}}
    budgets = {"static+50%": static + (plain_peak - static) // 2, "HF peak": hf_peak}
    for label, budget in budgets.items():
        rows = {"plain": {"peak": plain_peak, "flops": plain_flops, "roofline_s": plain_s, "head": "whole"},
                "HF every layer": {"peak": hf_peak, "flops": hf_flops, "roofline_s": hf_s, "head": "whole"}}
        for row in rows.values():
            row["held"] = row["peak"] <= budget
        rows["op-SAC"], _, _ = _plan_row(name, state, step, budget, policies=("save_matmuls",))
        rows["ours default"], _, _ = _plan_row(name, state, step, budget)
        rows["ours chunk_loss"], plan, m = _plan_row(name, state, step, budget, chunk_loss=True)
        if plan is not None:
            rows["ours chunk_loss"]["grad_max_abs_diff"] = _grad_diff(name, state, step, m)
        rows["ours H100 (fake)"], _, _ = _plan_row(name, state, step, budget, chunk_loss=True, fake=True, gpu="h100")
        for row in rows.values():
            if "flops" in row:
                row["flops_over_plain"] = row["flops"] / plain_flops - 1
                row["roofline_over_plain"] = row["roofline_s"] / plain_s - 1
        out["budgets"][label] = {"budget": budget, "rows": rows}
    return out


def _mib(b) -> str:
    return f"{b / 2**20:.2f}"


def table(results: dict) -> str:
    lines = ["| model | budget (MiB) | variant | measured peak (MiB) | predicted (MiB) | (meas-pred)/pred | held | "
             "FLOPs vs plain | H100 roofline vs plain | head |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        for label, b in res["budgets"].items():
            for variant, r in b["rows"].items():
                head = f"| {name} | {label} {_mib(b['budget'])} | {variant} |"
                if r.get("infeasible"):
                    lines.append(f"{head} infeasible (least peak {_mib(r['least_peak'])}) | | | | | | |")
                    continue
                if r.get("failed"):
                    lines.append(f"{head} failed: {r['failed'][:120]} | | | | | | |")
                    continue
                pred = _mib(r["predicted"]) if "predicted" in r else "-"
                err = f"{r['error']:+.3%}" if "error" in r else "-"
                hd = r["head"] + (f" (grad diff {r['grad_max_abs_diff']:.1e})" if "grad_max_abs_diff" in r else "")
                lines.append(f"{head} {_mib(r['peak'])} | {pred} | {err} | {'yes' if r['held'] else 'NO'} | "
                             f"{r['flops_over_plain']:+.1%} | {r['roofline_over_plain']:+.1%} | {hd} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS), help=", ".join(MODELS))
    parser.add_argument("--out", default=str(OUT), help="the JSON written")
    parser.add_argument("--merge", help="JSON files of runs made apart (comma-separated): one table, one JSON")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.merge:
        runs = [json.loads(Path(f).read_text()) for f in args.merge.split(",")]
        merged = {**runs[0], "results": {k: v for r in runs for k, v in r["results"].items()}}
        print(table(merged["results"]))
        Path(args.out).write_text(json.dumps(merged, indent=1) + "\n")
        return
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    results = {}
    for name in args.models.split(","):
        t0 = time.perf_counter()
        results[name] = run_model(name)
        results[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {results[name]['seconds']} s", flush=True)
    print(table(results))
    Path(args.out).write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                               "batch": BATCH, "seq": SEQ, "vocab": VOCAB, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
