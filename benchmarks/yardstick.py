#!/usr/bin/env python
"""An independent H100 yardstick at real widths: what each checkpointing scheme costs where matmuls are compute-bound.

Every configuration's training step (forward + backward) runs on fake tensors (``FakeTensorMode``: shapes, no memory,
no arithmetic) at the real widths of Llama-3-8B and Qwen2.5-7B (hidden, intermediate, heads, key/value heads,
vocabulary; fewer layers than the real models, ``--layers``), bf16 weights, AdamW, batch 1 at 4K and 8K tokens, full
fine-tuning and LoRA on q/v (peft, r=16). Each aten op of forward and backward, recomputation included, is priced on
an H100's data-sheet roofline, independently of the package's own pricing:

    seconds = max(FLOPs / 989e12, bytes / 3.35e12)

(FLOPs from torch's ``FlopCounterMode`` formulas; bytes: the op's input and output tensors, views and allocation-only
ops moving nothing). A scheme's overhead is its step's yardstick seconds over those of the step without checkpointing.
Peaks: torch's ``MemTracker`` over the fake step (forward, backward, AdamW step), with the optimizer state made by a
first step; for our plans, also the package's prediction.

Schemes: no checkpointing; Hugging Face every layer (``gradient_checkpointing_enable``); torchtitan's op-level
selective rule (attention and every second matmul output saved, the rest recomputed) and its layer rule (every second
layer recomputed whole); torch's SAC saving every matmul and attention output
(``create_selective_checkpoint_contexts``); chunked cross-entropy alone (torchtune's: the head and an upcast loss over
8 sequence chunks, nothing else checkpointed); ours (``plan_remat``'s default cost for a fake H100, ``chunk_loss=True``,
every policy offered) at static + 50% of the activations and at Hugging Face's every-layer peak.

    python benchmarks/yardstick.py                   # 11 minutes on 2 shared CPU cores (load ~8)
    python benchmarks/yardstick.py --models llama3-8b --tokens 4096 --modes lora

Writes benchmarks/results/yardstick.json and .md and prints the table.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from results_io import RESULTS, log, write_results  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode, flop_registry  # noqa: E402

import lightning_remat  # noqa: E402,F401  (registers FlopCounterMode's formulas for the CPU attention kernel)
from lightning_remat import BudgetTooSmallError, ProfileOptions, RematConfig, apply_plan, format_bytes  # noqa: E402
from lightning_remat.runtime.targets.fake import real_code_paths  # noqa: E402
from lightning_remat.service.planning import Planner  # noqa: E402

H100_FLOPS, H100_BANDWIDTH = 989e12, 3.35e12
aten = torch.ops.aten
ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default}
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}
# Ops that move no data: they allocate, or re-label memory another op wrote.
NO_DATA = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
           "lift_fresh", "_unsafe_view", "set_", "resize_"}


def _llama3_8b(layers):
    import transformers
    return transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                    num_key_value_heads=8, num_hidden_layers=layers, vocab_size=128256,
                                    rope_theta=500000.0, max_position_embeddings=8192, use_cache=False,
                                    attn_implementation="sdpa"), transformers.LlamaForCausalLM


def _qwen25_7b(layers):
    import transformers
    return transformers.Qwen2Config(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                                    num_key_value_heads=4, num_hidden_layers=layers, vocab_size=152064,
                                    rope_theta=1000000.0, max_position_embeddings=8192, tie_word_embeddings=False,
                                    use_cache=False, attn_implementation="sdpa"), transformers.Qwen2ForCausalLM


MODELS = {"llama3-8b": ("Llama-3-8B", _llama3_8b), "qwen2.5-7b": ("Qwen2.5-7B", _qwen25_7b)}


def build(name, layers, mode):
    """The model on the meta device in bf16, LoRA (q/v, r=16, adapters in bf16) or all parameters trained."""
    import transformers
    transformers.logging.set_verbosity_error()
    config, cls = MODELS[name][1](layers)
    with torch.device("meta"):
        model = cls(config).to(torch.bfloat16)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"]), autocast_adapter_dtype=False)
    model.train()
    return model


def causal_lm(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# ------------------------------------------------------------------------------ the yardstick


def _nbytes(t):
    return t.numel() * t.element_size()


class Yardstick(TorchDispatchMode):
    """Every op's H100 roofline seconds, FLOPs and bytes (inputs + outputs), summed."""

    def __init__(self):
        super().__init__()
        self.seconds = self.flops = self.bytes = self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func.overloadpacket.__name__ in NO_DATA or func.namespace == "prim":
            return out
        formula = flop_registry.get(func.overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        inputs = {id(t): _nbytes(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outputs = {id(t): _nbytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        moved = sum(inputs.values()) + sum(outputs.values())
        self.flops, self.bytes, self.ops = self.flops + flops, self.bytes + moved, self.ops + 1
        self.seconds += max(flops / H100_FLOPS, moved / H100_BANDWIDTH)
        return out


class FrozenTracker(MemTracker):
    """torch's ``MemTracker``, which refuses a frozen parameter (LoRA's base weights: marked as hooked, still counted)
    and a module called twice in one step."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        for param in module.parameters():
            if not param.requires_grad:
                self._param_to_grad_hook_handles.setdefault(param, (_NO_HOOK, _NO_HOOK))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_fw_hook(self, module, inputs):
        # A module called again in one step (the head, per chunk): only the step's peak is read, not its stats.
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)


class _NoHook:
    def remove(self):
        pass


_NO_HOOK = _NoHook()


def twin(model, mode):
    """A fake copy of the meta ``model`` (no memory), with its AdamW over the trained parameters."""
    fake = copy.deepcopy(model)
    with mode:
        fake = fake.to_empty(device="cpu")
    return fake, torch.optim.AdamW([p for p in fake.parameters() if p.requires_grad], foreach=False)


def measure(model, step, optimizer, mode):
    """(peak bytes, yardstick seconds, FLOPs) of ``step`` on the fake ``model``: the first step makes the optimizer
    state, the second is tracked (forward, backward, AdamW step), the third priced (forward and backward)."""
    # On fake tensors transformers believes it is tracing and would build the causal mask a real step does not.
    with mode, real_code_paths():
        step(model).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker = FrozenTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            step(model).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peak = max(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
        counter, yardstick = FlopCounterMode(display=False), Yardstick()
        with counter, yardstick:
            step(model).backward()
        optimizer.zero_grad(set_to_none=True)
    assert counter.get_total_flops() == yardstick.flops, (counter.get_total_flops(), yardstick.flops)
    return peak, yardstick.seconds, yardstick.flops


# ------------------------------------------------------------------------------ the peers


def hf_loss_step(ids):
    return lambda m: m(input_ids=ids, labels=ids).loss


def chunked_ce_step(ids, chunks=8):
    """torchtune's chunked cross-entropy: the head and the upcast loss over sequence chunks (shifted as HF does)."""
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)

    def step(m):
        lm = causal_lm(m)
        hidden = lm.model(input_ids=ids).last_hidden_state
        total = 0.0
        for h, y in zip(hidden.chunk(chunks, dim=1), labels.chunk(chunks, dim=1)):
            logits = lm.lm_head(h).float()
            total = total + F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
        return total / (labels != -100).sum()
    return step


def _save_matmuls(ctx, func, *args, **kwargs):
    """torch's SAC: every matmul and attention output saved, the rest recomputed."""
    return CheckpointPolicy.MUST_SAVE if func in MATMULS | ATTENTION else CheckpointPolicy.PREFER_RECOMPUTE


def _torchtitan_op(ctx, func, *args, **kwargs):
    """torchtitan's op-level SAC: attention and max saved, and every second matmul (torchtitan counts aten.mm; addmm,
    a biased projection, counted as one here), the rest recomputed."""
    mode = "recompute" if ctx.is_recompute else "forward"
    if func in MATMULS:
        ctx.meta[mode] = ctx.meta.get(mode, 0) + 1
    save = (func in ATTENTION or func == aten.max.default
            or (func in MATMULS and ctx.meta[mode] % 2 == 1))
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpoint_layers(model, layers, policy=None):
    """Each of ``layers`` (indices) recomputed in backward: whole, or under a selective policy."""
    for index, layer in enumerate(causal_lm(model).model.layers):
        if index not in layers:
            continue
        forward = layer.forward

        def wrapped(*args, _forward=forward, **kwargs):
            if policy is None:
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            # A fresh ``meta`` per call: torchtitan's matmul counter is per layer and per pass.
            context = functools.partial(create_selective_checkpoint_contexts, functools.partial(policy, _Meta()))
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=context, **kwargs)
        layer.forward = wrapped


class _Meta:
    def __init__(self):
        self.meta = {}


def _policy_with_meta(policy):
    def call(holder, ctx, func, *args, **kwargs):
        ctx.meta = holder.meta
        return policy(ctx, func, *args, **kwargs)
    return call


def peers(n_layers):
    """(name, install on the fake model, step maker): the schemes compared, each as its project runs it."""
    every = set(range(n_layers))
    return [
        ("no checkpointing", lambda m: None, hf_loss_step),
        ("HF every layer", lambda m: causal_lm(m).gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}), hf_loss_step),
        ("torchtitan op-SAC (every 2nd mm)", lambda m: _checkpoint_layers(m, every, _policy_with_meta(_torchtitan_op)),
         hf_loss_step),
        ("torchtitan every 2nd layer", lambda m: _checkpoint_layers(m, {i for i in every if i % 2 == 1}),
         hf_loss_step),
        ("torch SAC save matmuls", lambda m: _checkpoint_layers(m, every, _policy_with_meta(_save_matmuls)),
         hf_loss_step),
        ("chunked CE (torchtune, 8)", lambda m: None, chunked_ce_step),
    ]


# ------------------------------------------------------------------------------ one case


def _options_used(plan):
    used = {}
    for choice in plan.choices:
        if choice.option != "keep":
            used[choice.option] = used.get(choice.option, 0) + 1
    return ", ".join(f"{o} x{n}" for o, n in sorted(used.items(), key=lambda kv: (-kv[1], kv[0]))) or "keep all"


def run_case(name, layers, tokens, mode):
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = build(name, layers, mode)
    ids = torch.randint(0, causal_lm(model).config.vocab_size, (1, tokens))
    rows, base = [], None
    for label, install, make_step in peers(layers):
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake, optimizer = twin(model, fake_mode)
        install(fake)
        peak, seconds, flops = measure(fake, make_step(ids), optimizer, fake_mode)
        base = base or (seconds, flops)
        rows.append(dict(scheme=label, peak_bytes=peak, seconds=seconds, flops=flops))
        log(f"  {label}: {format_bytes(peak)}, +{seconds / base[0] - 1:.1%} yardstick")
    # Ours: one fake profile for an H100 (cost unset: the target's default), solved at both budgets.
    options = ProfileOptions(fake=True, gpu="h100", chunk_loss=True, policies=None)
    meta_optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False)
    start = time.perf_counter()
    profile = Planner(RematConfig("min", profile=options), verbose=False).profile(model, hf_loss_step(ids),
                                                                                meta_optimizer)
    plain, hf_peak = rows[0]["peak_bytes"], rows[1]["peak_bytes"]
    half = profile.static_bytes + (profile.baseline_peak_bytes - profile.static_bytes) // 2
    for label, budget, cost in ((f"ours at static + 50% ({format_bytes(half)})", half, None),
                                ("ours at static + 50%, cost='flops'", half, "flops"),
                                ("ours at HF's peak", hf_peak, None)):
        planner = Planner(RematConfig(budget, cost=cost, profile=options), verbose=False)
        try:
            plan = planner.solve_profile(model, profile)
        except BudgetTooSmallError as error:
            rows.append(dict(scheme=label, infeasible=f"least peak {format_bytes(error.smallest_peak_bytes)}"))
            continue
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake, optimizer = twin(model, fake_mode)
        apply_plan(fake, plan)
        peak, seconds, flops = measure(fake, hf_loss_step(ids), optimizer, fake_mode)
        rows.append(dict(scheme=label, peak_bytes=peak, predicted_peak_bytes=plan.predicted_peak_bytes,
                         seconds=seconds, flops=flops, cost=str(plan.cost_kind), options=_options_used(plan),
                         predicted_overhead=plan.predicted_overhead))
        log(f"  {label}: {format_bytes(peak)} (predicted {format_bytes(plan.predicted_peak_bytes)}), "
            f"+{seconds / base[0] - 1:.1%} yardstick, {_options_used(plan)}")
    for r in rows:
        if "seconds" in r:
            r.update(overhead=r["seconds"] / base[0] - 1, flops_overhead=r["flops"] / base[1] - 1,
                     within_half=r["peak_bytes"] <= half, within_hf=r["peak_bytes"] <= hf_peak)
    return dict(model=MODELS[name][0], layers=layers, tokens=tokens, mode=mode, static_bytes=profile.static_bytes,
                plain_peak_bytes=plain, profile_baseline_peak_bytes=profile.baseline_peak_bytes, half_budget=half,
                hf_peak_bytes=hf_peak, plan_seconds=time.perf_counter() - start, rows=rows)


def table(results):
    lines = ["| model | tokens | training | scheme | peak | fits static + 50% | fits HF's peak | yardstick overhead "
             "| FLOPs overhead | ours: options, predicted overhead (its cost) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for case in results:
        head = f"| {case['model']} ({case['layers']} layers) | {case['tokens']} | {case['mode']} "
        for r in case["rows"]:
            if "infeasible" in r:
                lines.append(head + f"| {r['scheme']} | infeasible: {r['infeasible']} | | | | | |")
                continue
            peak = format_bytes(r["peak_bytes"])
            if "predicted_peak_bytes" in r:
                peak += f" (predicted {format_bytes(r['predicted_peak_bytes'])})"
            lines.append(head + f"| {r['scheme']} | {peak} | {'yes' if r['within_half'] else 'no'} | "
                         f"{'yes' if r['within_hf'] else 'no'} | {r['overhead']:+.1%} | {r['flops_overhead']:+.1%} | "
                         + (f"{r['options']}; {r['predicted_overhead']:+.1%} ({r['cost']})" if "options" in r else "")
                         + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 8192])
    parser.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--render", metavar="JSON", help="print the table of a run's JSON, and run nothing")
    args = parser.parse_args(argv)
    if args.render:
        print(table(json.loads(Path(args.render).read_text())))
        return
    results, start = [], time.perf_counter()
    for name in args.models:
        for tokens in args.tokens:
            for mode in args.modes:
                log(f"[{name}, {tokens} tokens, {mode}]")
                results.append(run_case(name, args.layers, tokens, mode))
    log(f"done in {time.perf_counter() - start:.0f} s")
    write_results(args.out, "yardstick", results, table(results))


if __name__ == "__main__":
    main()
