"""A plan as plain text (no rich, no torch): ``Plan.summary()``, and the lines ``report.render`` tabulates."""

from __future__ import annotations

from collections import Counter
from functools import partial

from typing import Any

from .binding import Binding
from .budget import format_budget, format_in_units_of

TABLE_HEADER = ("stage", "option", "stored (keep)", "stored (plan)", "recompute cost")


def _size(plan: Any) -> Any:
    return partial(format_in_units_of, plan.requested_budget)


def plan_headline(plan: Any, title: str = "Recompute plan") -> str:
    """One line: modules recomputed, predicted peak against budget and baseline, overhead."""
    segments = len(plan.segments)
    spans = f" and {segments} segment(s)" if segments else ""
    budget = "not given" if plan.budget_bytes is None else format_budget(plan.requested_budget, plan.budget_bytes)
    if plan.predicted_peak_bytes is None:
        how = " under op-level policies" if plan.policies else " whole"
        return (f"{title}: {len(plan.checkpointed)} module(s){spans} recomputed{how} (fallback: not profiled, peak "
                f"not predicted; budget {plan.requested_budget or budget})")
    overhead = "unknown" if plan.predicted_overhead is None else f"{plan.predicted_overhead:.1%}"
    size = _size(plan)
    baseline = "not profiled" if plan.baseline_peak_bytes is None else size(plan.baseline_peak_bytes)
    return (f"{title}: {len(plan.checkpointed)} module(s){spans}, predicted peak {size(plan.predicted_peak_bytes)} "
            f"(budget {budget}, baseline {baseline}), overhead {overhead} ({plan.cost_kind})")


def plan_rows(plan: Any) -> list[tuple[str, str, str, str, str]]:
    """One row per stage (``TABLE_HEADER``); without a profile's choices, one per recomputed module."""
    unit = "FLOP" if plan.cost_kind == "flops" else "s"
    size = _size(plan)
    rows = [(c.stage, c.option, size(c.baseline_stored_bytes), size(c.stored_bytes),
             f"{c.cost:.3g} {unit}" if c.cost else "-") for c in plan.choices]
    if not rows:
        policies = plan.policies
        rows = [(name, f"sac:{policies[name]}" if name in policies else "whole", "-", "-", "-")
                for name in plan.checkpointed]
    return rows


def table_text(header: tuple[str, ...], rows: list[tuple[str, ...]], indent: str = "  ") -> list[str]:
    """Aligned columns: the first two left-justified, the others right-justified."""
    widths = [max(len(str(r[k])) for r in [header, *rows]) for k in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return indent + "  ".join(str(c).ljust(w) if k < 2 else str(c).rjust(w)
                                  for k, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header), line(tuple("-" * w for w in widths)), *(line(r) for r in rows)]


def plan_lines(plan: Any) -> list[str]:
    """What follows the table: segments, policies, offloading, the memory at the peak, notes."""
    lines: list[str] = []
    size = _size(plan)
    segments = plan.segments
    if segments:
        lines.append("  segments, each recomputed as one checkpoint (inner boundaries not kept): "
                     + ", ".join(f"{s[0]}..{s[-1]} ({len(s)})" for s in segments))
    policies = plan.policies
    if policies:
        counts = Counter(policies.values())
        lines.append("  selective checkpointing (op-level policy per recomputed module): "
                     + ", ".join(f"{policy} x{n}" for policy, n in sorted(counts.items())))
    offloaded = plan.offloaded
    if offloaded:
        lines.append(f"  offloaded to host memory (saved tensors out in forward, prefetched back in backward): "
                     f"{len(offloaded)} module(s), {size(plan.host_bytes)} on the host")
    fused = getattr(plan, "fused_loss", {})
    chunked = {head: k for head, k in getattr(plan, "chunked_loss", {}).items() if head not in fused}
    if chunked:
        lines.append("  head and loss over sequence chunks, each recomputed in backward (chunk_loss; the model returns "
                     "logits=None): " + ", ".join(f"{head} in {k} chunks" for head, k in chunked.items()))
    if fused:
        lines.append("  head and loss fused over sequence chunks, each chunk's gradients computed in forward, nothing "
                     "recomputed (chunk_loss; the model returns logits=None): "
                     + ", ".join(f"{head} in {k} chunks" for head, k in fused.items()))
    inputs = getattr(plan, "offloaded_inputs", [])
    if inputs:
        lines.append(f"  recomputed with their checkpoint input in host memory (copied out in forward, back for the "
                     f"recompute): {len(inputs)} module(s)")
    if plan.predicted_peak_bytes is not None and plan.sharding:
        lines.append(sharded_memory_line(plan))
    elif plan.predicted_peak_bytes is not None:
        # Gradients exist only from some point of backward on: the rest of the peak is said as what it is.
        held = plan.parameter_bytes + plan.optimizer_state_bytes
        lines.append(
            f"  memory: parameters {size(plan.parameter_bytes)}, optimizer state "
            f"{size(plan.optimizer_state_bytes)}, gradients {size(plan.gradient_bytes)} by the end of "
            f"backward; the rest of the predicted peak, {size(max(0, plan.predicted_peak_bytes - held))}, is "
            "activations, temporaries and the gradients alive at that point")
    binding = getattr(plan, "binding", None)
    if binding and plan.predicted_peak_bytes is not None:
        lines.append("  " + Binding.from_dict(binding).text(size))
    lines.extend(f"  note: {note}" for note in plan.notes)
    return lines


def plan_text(plan: Any, title: str = "Recompute plan") -> str:
    """Headline, stage table, static memory at the peak, notes (``Plan.summary()``)."""
    rows = plan_rows(plan)
    table = table_text(TABLE_HEADER, rows) if rows else []
    return "\n".join([plan_headline(plan, title), *table, *plan_lines(plan)])


def per_gpu_breakdown(plan: Any) -> dict[str, int]:
    """The per-GPU peak of a sharded plan split into its parts; empty when unsharded or not predicted."""
    sharding = getattr(plan, "sharding", None) or {}
    if not sharding or plan.predicted_peak_bytes is None:
        return {}
    parts = {
        "world_size": int(sharding["world_size"]),
        "parameter_bytes": int(plan.parameter_bytes),
        "gradient_bytes": int(plan.gradient_bytes),
        "optimizer_state_bytes": int(plan.optimizer_state_bytes),
        "unsharded_parameter_bytes": int(sharding.get("unsharded_parameter_bytes", 0)),
    }
    held = sum(v for k, v in parts.items() if k != "world_size")
    parts["activations_and_rest_bytes"] = max(0, int(plan.predicted_peak_bytes) - held)
    parts["peak_bytes"] = int(plan.predicted_peak_bytes)
    return parts


def sharded_memory_line(plan: Any) -> str:
    """The per-GPU split of a sharded (FSDP2) plan's predicted peak (``per_gpu_breakdown``)."""
    parts, size = per_gpu_breakdown(plan), _size(plan)
    sharding = plan.sharding
    stored, computed = sharding.get("sharded_dtype", ""), sharding.get("param_dtype", "")
    master = f" ({stored} master weights)" if stored and computed and stored != computed else ""
    return (f"  per GPU of {parts['world_size']} (FSDP2): sharded parameters{master} "
            f"{size(parts['parameter_bytes'])}, gradients {size(parts['gradient_bytes'])}, optimizer "
            f"state {size(parts['optimizer_state_bytes'])}, unsharded parameters in flight"
            f"{f' ({computed})' if computed else ''} up to {size(parts['unsharded_parameter_bytes'])}; the rest "
            f"of the predicted peak, {size(parts['activations_and_rest_bytes'])}, is activations of the local "
            "batch, temporaries and reduce-scatter buffers")
