"""``RematPlugin``: the settings of recomputation under Accelerate. Accelerate takes no third-party keys in its
config file or ``kwargs_handlers``, but ``accelerate launch`` passes the environment through: each is a variable."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ...core.bounds import MAX_STEPS
from ...core.budget import Budget
from ...core.config import (COST_KINDS, DEFAULT_COST, ProfileOptions, RematConfig, normalize_candidates,
                            check_policies)
from ...core.vocabulary import Policy

ENV_BUDGET = "ACCELERATE_REMAT_BUDGET"
ENV_PROFILE_STEPS = "ACCELERATE_REMAT_PROFILE_STEPS"
ENV_CANDIDATES = "ACCELERATE_REMAT_CANDIDATES"
ENV_COST = "ACCELERATE_REMAT_COST"
ENV_OFFLOAD = "ACCELERATE_REMAT_OFFLOAD"
ENV_POLICIES = "ACCELERATE_REMAT_POLICIES"
ENV_CHUNK_LOSS = "ACCELERATE_REMAT_CHUNK_LOSS"

METRIC_NAMES = (
    "remat/budget_bytes",
    "remat/baseline_peak_bytes",
    "remat/predicted_peak_bytes",
    "remat/measured_peak_bytes",
    "remat/predicted_overhead",
    "remat/num_checkpointed",
    "remat/num_plans",  # plans the run made (one per batch shape): the figures above are its largest's
)

@dataclass
class RematPlugin:
    """Settings of recomputation under Accelerate: each field left ``None`` is read from its
    ``ACCELERATE_REMAT_*`` variable (the table in docs/accelerate.md, "Settings"; ``chunk_loss``: as
    ``plan_remat(chunk_loss=)``, env ``ACCELERATE_REMAT_CHUNK_LOSS``); an explicit value wins. Recomputation
    is on if and only if a budget is set. A malformed value raises ``ValueError`` naming its variable.

    Example:
        >>> plugin = RematPlugin(budget="10GB", candidates="GPT2Block, transformer.h.*")
        >>> plugin.enabled, plugin.profile_steps, plugin.candidates, plugin.cost
        (True, 1, ['GPT2Block', 'transformer.h.*'], None)
    """

    budget: str | int | None = field(
        default=None, metadata={"help": f"Peak memory of a training step, e.g. '10GB' or 'min'. Env: {ENV_BUDGET}."})
    profile_steps: int | None = field(
        default=None, metadata={"help": f"Steps observed before the plan is applied (>= 1). Env: {ENV_PROFILE_STEPS}."})
    candidates: Any = field(
        default=None, metadata={"help": f"Module classes or name patterns to choose among. Env: {ENV_CANDIDATES}."})
    cost: str | None = field(
        default=None, metadata={"help": f"'flops', 'time' or 'roofline': what the plan minimises; unset, the target's (roofline "
                                   f"on a GPU of the hardware table, flops on the CPU). Env: {ENV_COST}."})
    offload: Any = field(
        default=None, metadata={"help": f"Also offload activations to host memory (CUDA). Env: {ENV_OFFLOAD}."})
    policies: Any = field(
        default=None, metadata={"help": f"Selective-checkpointing policies to offer ('all', 'none', names). "
                                        f"Env: {ENV_POLICIES}."})
    chunk_loss: Any = field(
        default=None, metadata={"help": f"Let the plan chunk a causal LM's head and loss. Env: {ENV_CHUNK_LOSS}."})

    def __post_init__(self):
        sources: dict[str, str] = {}
        for name, variable in (("budget", ENV_BUDGET), ("profile_steps", ENV_PROFILE_STEPS),
                               ("candidates", ENV_CANDIDATES), ("cost", ENV_COST), ("offload", ENV_OFFLOAD),
                               ("policies", ENV_POLICIES), ("chunk_loss", ENV_CHUNK_LOSS)):
            if getattr(self, name) is None:
                value = os.environ.get(variable, "").strip()
                if value:
                    setattr(self, name, value)
                    sources[name] = variable

        def invalid(name: str, why: str) -> ValueError:
            value = getattr(self, name)
            origin = f"{sources[name]}={value!r}" if name in sources else f"RematPlugin({name}={value!r})"
            return ValueError(f"lightning-remat: invalid {origin}: {why}")

        if self.budget is not None:
            if isinstance(self.budget, str):
                self.budget = self.budget.strip()
            try:
                Budget.parse(self.budget)
            except ValueError as err:
                raise invalid("budget", str(err)) from None
        self.profile_steps = self._steps(invalid)
        try:
            candidates = normalize_candidates(self.candidates)
        except ValueError:
            raise invalid("candidates", "expected module classes, class names or comma-separated name patterns, "
                          "such as 'GPT2Block' or 'transformer.h.*'") from None
        self.candidates = list(candidates) if candidates is not None else None
        self.cost = DEFAULT_COST if self.cost is None else str(self.cost).strip().lower()
        if self.cost is not None and self.cost not in COST_KINDS:
            raise invalid("cost", f"expected one of {list(COST_KINDS)}")
        for name in ("offload", "chunk_loss"):
            flag = str(getattr(self, name)).strip().lower() if getattr(self, name) is not None else "false"
            if flag not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise invalid(name, "expected 1/true/yes or 0/false/no")
            setattr(self, name, flag in ("1", "true", "yes", "on"))
        try:
            self.policies = () if self.policies is None else check_policies(self.policies)
        except ValueError:
            raise invalid("policies", f"expected comma-separated policy names among {', '.join(Policy.values())} "
                          "(each also spelled 'sac:' + the name), or 'all' or 'none'") from None

    def _steps(self, invalid: Any) -> int:
        if self.profile_steps is None:
            return 1
        text = str(self.profile_steps).strip()
        if isinstance(self.profile_steps, bool) or not text.isdigit() or not 1 <= int(text) <= MAX_STEPS:
            raise invalid("profile_steps", f"expected a whole number of training steps, at least 1 and at most "
                          f"{MAX_STEPS}")
        return int(text)

    @property
    def enabled(self) -> bool:
        """Whether recomputation is on: a budget is set."""
        return self.budget is not None

    def config(self) -> RematConfig:
        """The settings as the planning service takes them."""
        return RematConfig(self.budget, cost=self.cost, profile=ProfileOptions(
            candidates=self.candidates, offload=bool(self.offload), policies=self.policies,
            chunk_loss=bool(self.chunk_loss)))

    def loop_config(self, accumulation: int = 1, processes: int = 1, sharded: bool = False) -> RematConfig:
        """``config()`` with the loop's ``accumulation`` and DDP's buckets (several ``processes``, not FSDP2)."""
        config = self.config()
        steps = int(accumulation or 1)
        buckets = processes > 1 and not sharded
        return replace(config, profile=replace(config.profile, accumulation_steps=max(1, steps),
                                               gradient_buckets=buckets))

    def budget_bytes(self, device: Any = None) -> int | str:
        """The budget in bytes on ``device`` (a percentage refers to its total memory), or ``"min"``."""
        return Budget.parse(self.budget).resolve(device=device)


@dataclass
class LoopFacts:
    """What the session reads of the loop around the model when it needs it: optimizers, accumulation,
    processes, where figures go (``log``) and lines are shown (``show``; None: the logger at INFO).
    ``of(accelerator)`` reads them from an ``Accelerator``; the Trainer's callback gives its own.

    Example:
        >>> LoopFacts.of(None).accumulation(), LoopFacts(accumulation=lambda: 4).processes()
        (1, 1)
    """

    optimizers: Callable[[], Any] = list
    accumulation: Callable[[], int] = lambda: 1
    processes: Callable[[], int] = lambda: 1
    log: Callable[[dict, int], None] = lambda figures, step: None
    show: Callable[[str], None] | None = None

    @classmethod
    def of(cls, accelerator: Any) -> "LoopFacts":
        def log(figures: dict, step: int) -> None:
            if getattr(accelerator, "trackers", None):  # initialised by init_trackers, maybe after prepare
                accelerator.log(figures, step=step)
        return cls(optimizers=lambda: getattr(accelerator, "_optimizers", []) or [],
                   accumulation=lambda: int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1),
                   processes=lambda: getattr(accelerator, "num_processes", 1), log=log)
