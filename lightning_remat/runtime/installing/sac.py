"""Op-level selective checkpointing: named policies over torch's SAC API (docs/selective_checkpointing.md)."""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.utils.checkpoint import (CheckpointError, CheckpointPolicy, SAC_IGNORED_OPS,
                                   create_selective_checkpoint_contexts)
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from ...core.actions import StageAction
from ...core.vocabulary import Action, Policy
from ...core.vocabulary import policy_of  # noqa: F401 - the policy of an option name ("" for none)
from .records import Behaviour

aten = torch.ops.aten


def _packets(*names: str) -> frozenset:
    # Some ops exist only in some builds; a name torch lacks is simply not there.
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


MATMUL_OPS = _packets("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_int_mm")
BATCHED_MATMUL_OPS = _packets("bmm", "baddbmm")
CONV_OPS = _packets("convolution", "_convolution", "cudnn_convolution", "convolution_overrideable",
                    "_slow_conv2d_forward", "mkldnn_convolution")
ATTENTION_OPS = _packets("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                         "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                         "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
                         "_efficient_attention_forward")

# Option names in a profile are "sac:" + the policy name (``core.vocabulary``).
POLICIES = Policy.values()


def _packet(func: Any) -> Any:
    return getattr(func, "overloadpacket", func)


# The ops each policy saves (the rest is recomputed); save_alternate_matmuls: every other matmul, attention always.
_SAVED = {"save_matmuls": MATMUL_OPS | CONV_OPS | ATTENTION_OPS,
          "save_projections": (MATMUL_OPS | CONV_OPS | ATTENTION_OPS) - BATCHED_MATMUL_OPS,
          # SDPA's math path (a mask and dropout, as on the CPU) runs attention as batched matmuls.
          "save_attention": ATTENTION_OPS | BATCHED_MATMUL_OPS}


def _decider(policy: str) -> Callable[[Any, str], bool]:
    """A fresh stateful ``save(func, pass_key) -> bool`` for one checkpointed call."""
    policy = check_policy(policy)
    if policy in _SAVED:
        return lambda func, key: _packet(func) in _SAVED[policy]
    counts: dict[str, int] = defaultdict(int)

    def save_alternate_matmuls(func: Any, key: str) -> bool:
        packet = _packet(func)
        if packet in ATTENTION_OPS:
            return True
        if packet in MATMUL_OPS or packet in CONV_OPS:
            # Counted per pass (forward, recompute) so both passes take the same decisions.
            counts[key] += 1
            return counts[key] % 2 == 1
        return False

    return save_alternate_matmuls


def check_policy(policy: str) -> str:
    """Validate a policy name; the plain name, as torch.compile sees it in a ``context_fn``'s arguments."""
    return Policy.check(policy).value


# torch's report that a recompute did not run the forward's ops again (torch < 2.10: a comma after "backward").
_NOT_REPLAYED = re.compile(r"encountered during backward,? but not found in storage")


def recompute_not_replayed(error: BaseException) -> bool:
    """Whether ``error`` is torch's report that a recompute did not replay its forward (only these drop a policy)."""
    if isinstance(error, CheckpointError):
        return True
    return type(error) is RuntimeError and bool(_NOT_REPLAYED.search(str(error)))


def _contexts(policy: str) -> tuple[Any, Any]:
    decide = _decider(policy)

    def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        # MUST_*, never a PREFER_* hint that torch.compile's partitioner may override.
        save = decide(func, "recompute" if ctx.is_recompute else "forward")
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.MUST_RECOMPUTE

    return create_selective_checkpoint_contexts(policy_fn)


def context_fn(policy: str) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` for ``checkpoint`` that runs ``policy`` (a ``functools.partial``: torch.compile accepts it)."""
    return functools.partial(_contexts, check_policy(policy))


class OpPolicy(Behaviour):
    """A ``RECOMPUTE`` action's policy: its recompute's ``context_fn`` is the policy's (eager and compiled alike)."""

    name = "policy"

    def settings(self, action: StageAction) -> dict[str, Any]:
        if action.action is not Action.RECOMPUTE or action.policy is None:
            return {}
        return {m: action.policy.value for m in action.modules}

    def checkpoint_options(self, setting: Any, state: Any, options: dict[str, Any]) -> None:
        options["context_fn"] = context_fn(setting)

    def fields(self, name: str, setting: Any) -> dict[str, Any]:
        return {"policy": setting}


def recomputed_ops(policy: str, funcs: Sequence[Any]) -> list[bool]:
    """For ops in forward order, whether ``policy`` recomputes each (``True``) or saves it."""
    decide = _decider(policy)
    # Ops SAC never caches (detach) run again on recompute whatever the policy says.
    return [True if f in SAC_IGNORED_OPS else not decide(f, "forward") for f in funcs]


def distinct_policies(policies: Iterable[str], funcs: Sequence[Any]) -> list[str]:
    """The policies worth an option for ``funcs``: neither "keep" nor "whole", one per distinct set of saved ops."""
    chosen, seen = [], set()
    for policy in policies:
        recomputed = tuple(recomputed_ops(policy, funcs))
        if all(recomputed) or not any(recomputed) or recomputed in seen:
            continue
        seen.add(recomputed)
        chosen.append(policy)
    return chosen


def _sdpa_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# FlopCounterMode lacks the formulas of the CPU SDPA kernels (attention counted 0 there): the same ones as CUDA's,
# registered at import on every SDPA backend.
for _name, _formula in (("_scaled_dot_product_flash_attention_for_cpu", _sdpa_forward),
                        ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_backward),
                        ("_scaled_dot_product_fused_attention_overrideable", _sdpa_forward),
                        ("_scaled_dot_product_fused_attention_overrideable_backward", _sdpa_backward)):
    _op = getattr(aten, _name, None)
    if _op is not None and _op not in flop_registry:
        register_flop_formula(_op)(_formula)
