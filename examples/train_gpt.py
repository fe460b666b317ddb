"""Train a small GPT-2 under a memory budget with Lightning and ``AutoRemat``, on CPU.

The model has random weights and learns synthetic tokens: nothing is downloaded. The script

1. measures the peak memory of a training step without recomputation (``measure_step``),
2. picks a budget (``--budget``; by default static memory + half the activation memory, from a
   quick ``profile_step``),
3. trains with ``Trainer(callbacks=[AutoRemat(budget=...)])``: the callback profiles the first
   batch, prints the plan, recomputes the chosen blocks and measures a step with the plan,
4. prints the memory before and after, and writes the logs (``remat/*`` metrics and the loss) as
   CSV under ``--log-dir``.

Run::

    python examples/train_gpt.py                 # about a minute on 2 CPU cores
    python examples/train_gpt.py --budget 120MB  # your own budget
    python examples/train_gpt.py --budget min    # the least memory any plan reaches
    python examples/train_gpt.py --figures docs/figures.json  # record the figures README quotes
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
import time

import torch
from torch.utils.data import DataLoader, TensorDataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--budget", default=None,
                        help='peak memory of a training step: "120MB", "0.1GiB", bytes, "min"; '
                             "default: static memory + 50%% of the activation memory, from a quick profile")
    parser.add_argument("--steps", type=int, default=10, help="training steps")
    parser.add_argument("--layers", type=int, default=6, help="transformer layers")
    parser.add_argument("--n-embd", type=int, default=256, help="hidden size")
    parser.add_argument("--n-head", type=int, default=4, help="attention heads")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per step")
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary size")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    parser.add_argument("--cost", choices=["flops", "time", "roofline"], default="flops",
                        help="price recomputation by counted FLOPs (the package's default), measured seconds or "
                             "the roofline")
    parser.add_argument("--log-dir", default="runs", help="where the CSV logs go")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads: 1 keeps a small model fast and timings steady on a busy machine; "
                             "0 for torch's default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--figures", default=None,
                        help="record the printed figures in this JSON file (docs/figures.json: README quotes them)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # Imported here so that --help answers at once.
    import lightning.pytorch as L
    import transformers
    from lightning.pytorch.loggers import CSVLogger

    from lightning_remat import AutoRemat, format_bytes, measure_step, parse_budget, profile_step
    from lightning_remat.core.solve import least_peak

    transformers.logging.set_verbosity_error()

    class GPTModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.n_embd, n_head=args.n_head,
                                             n_positions=args.seq_len, vocab_size=args.vocab,
                                             bos_token_id=0, eos_token_id=0,
                                             use_cache=False)  # the key/value cache only costs memory in training
            self.model = transformers.GPT2LMHeadModel(config)

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss
            self.log("train/loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=args.lr)

    L.seed_everything(args.seed)
    module = GPTModule().train()
    tokens = torch.randint(0, args.vocab, (args.steps * args.batch_size, args.seq_len),
                           generator=torch.Generator().manual_seed(args.seed))
    loader = DataLoader(TensorDataset(tokens), batch_size=args.batch_size)
    sample = tokens[: args.batch_size].clone()  # its own storage: a view would count every batch's tokens

    def step(model):
        return model.model(input_ids=sample, labels=sample).loss

    started = time.perf_counter()
    params = sum(p.numel() for p in module.parameters())
    print(f"GPT-2: {args.layers} layers, n_embd {args.n_embd}, {params / 1e6:.1f}M parameters; "
          f"batch {args.batch_size} x {args.seq_len} tokens; AdamW")

    # Before: a step without recomputation, on a copy (the model to train stays untouched). The
    # second step is measured: from then on AdamW's state exists, as in every step of training.
    reference = copy.deepcopy(module)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    measure_step(reference, step, optimizer)
    before = measure_step(reference, step, optimizer)
    del reference, optimizer
    # One split of the peak, at the moment it happens: its parts add up to it. Gradients are
    # counted there as far as backward has made them (none yet when the peak is early in backward).
    parts = [("parameters", before.parameter_bytes), ("buffers", before.buffer_bytes),
             ("gradients", before.gradient_bytes), ("optimizer state", before.optimizer_bytes),
             ("activations", before.activation_bytes), ("temporaries", before.temporary_bytes)]
    print(f"peak of a training step without recomputation: {format_bytes(before.peak_bytes)} = "
          + " + ".join(f"{what} {format_bytes(n)}" for what, n in parts if n or what == "gradients")
          + " at the peak")

    if args.budget is None:
        profile = profile_step(module, step, optimizer=torch.optim.AdamW(module.parameters(), lr=args.lr))
        budget = profile.static_bytes + profile.baseline_activation_bytes // 2
        # Static memory counts every gradient (they all exist by the end of backward), so what lies
        # above it at the peak is not the activations of the split above: it is named for what it is.
        print(f"budget: {format_bytes(budget)} = static {format_bytes(profile.static_bytes)} (parameters, gradients, "
              f"optimizer state) + 50% of the {format_bytes(profile.baseline_activation_bytes)} above it at the peak "
              "(pass --budget to choose)")
        # On a very small model the head and loss alone can take more than that.
        smallest = least_peak(profile)
        if budget < smallest:
            # "min": AutoRemat's own least peak, in the training loop (which holds the loss through the step).
            budget = "min"
            print(f"budget raised to the smallest reachable peak (budget='min', about {format_bytes(smallest)})")
    else:
        budget = args.budget
        parsed = parse_budget(budget)
        print(f"budget: {budget}" + (f" = {format_bytes(parsed)}" if isinstance(parsed, int) else ""))

    callback = AutoRemat(budget=budget, cost=args.cost)
    logger = CSVLogger(args.log_dir, name="train_gpt")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, callbacks=[callback], logger=logger,
                        log_every_n_steps=1, enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=False)
    trainer.fit(module, loader)

    plan, after = callback.plan, callback.measured_peak_bytes
    saved = before.peak_bytes - after
    print(f"recomputed modules: {len(plan.checkpointed)} {plan.checkpointed}")
    print(f"peak before (no recomputation): {format_bytes(before.peak_bytes)}")
    print(f"peak after  (measured, with the plan): {format_bytes(after)} "
          f"(predicted {format_bytes(plan.predicted_peak_bytes)}, budget {format_bytes(plan.budget_bytes)})")
    print(f"memory saved: {format_bytes(saved)} ({saved / before.peak_bytes:.0%}) "
          f"at a predicted recompute overhead of {plan.predicted_overhead:.0%} ({plan.cost_kind})")
    seconds = time.perf_counter() - started
    print(f"final loss {float(trainer.callback_metrics['train/loss']):.3f}; logs: {logger.log_dir}/metrics.csv; "
          f"{seconds:.0f} s")
    if args.figures:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # docs tooling: not in the wheel
        from doc_figures import figures_key, record_figures

        mib = 2.0**20
        record_figures(args.figures, figures_key("examples/train_gpt.py", list(argv if argv is not None else sys.argv[1:])), {
            "before_mib": before.peak_bytes / mib, "after_mib": after / mib, "budget_mib": plan.budget_bytes / mib,
            "predicted_mib": plan.predicted_peak_bytes / mib, "saved_pct": 100 * saved / before.peak_bytes,
            "overhead_pct": 100 * plan.predicted_overhead, "seconds": seconds})
    return {"before": before.peak_bytes, "after": after, "budget": plan.budget_bytes, "plan": plan}


if __name__ == "__main__":
    main()
