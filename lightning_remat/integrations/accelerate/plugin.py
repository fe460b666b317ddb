"""``RematPlugin``: the settings of recomputation under Accelerate. Accelerate takes no third-party keys in its
config file or ``kwargs_handlers``, but ``accelerate launch`` passes the environment through: each is a variable."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Callable

from ...core.config import MAX_STEPS
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
    """Each field left ``None`` is read from its ``ACCELERATE_REMAT_*`` variable (docs/accelerate.md, "Settings").
    On if and only if a budget is set; a malformed value raises ``ValueError`` naming its variable.

    >>> plugin = RematPlugin(budget="10GB", candidates="GPT2Block, transformer.h.*")
    >>> plugin.enabled, plugin.profile_steps, plugin.candidates, plugin.cost
    (True, 1, ['GPT2Block', 'transformer.h.*'], None)
    """

    budget: str | int | None = None  # peak memory of a training step: '10GB', 'min'
    profile_steps: int | None = None  # steps observed before the plan is applied (>= 1)
    candidates: Any = None  # module classes or name patterns to choose among
    cost: str | None = None  # 'flops', 'time' or 'roofline'; unset: the target's (roofline on a known GPU)
    offload: Any = None  # also offload activations to host memory (CUDA)
    policies: Any = None  # selective-checkpointing policies to offer ('all', 'none', names)
    chunk_loss: Any = None  # let the plan chunk a causal LM's head and loss

    def __post_init__(self):
        sources: dict[str, str] = {}
        for name in (f.name for f in fields(self)):
            variable = "ACCELERATE_REMAT_" + name.upper()  # ENV_BUDGET and the others
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
        return self.budget is not None

    def config(self) -> RematConfig:
        return RematConfig(self.budget, cost=self.cost, profile=ProfileOptions(
            candidates=self.candidates, offload=bool(self.offload), policies=self.policies,
            chunk_loss=bool(self.chunk_loss)))


@dataclass
class LoopFacts:
    """What the session reads of the loop: optimizers, accumulation, the process ``state`` (``Accelerator`` or
    ``AcceleratorState``), where figures go and lines are shown. The Trainer's callback gives its own.

    >>> LoopFacts.of(None).accumulation(), LoopFacts(accumulation=lambda: 4).processes()
    (1, 1)
    """

    optimizers: Callable[[], Any] = list
    accumulation: Callable[[], int] = lambda: 1
    state: Any = None
    log: Callable[[dict, int], None] = lambda figures, step: None
    show: Callable[[str], None] | None = None
    who: str = f"lightning-remat ({ENV_BUDGET} / RematPlugin.budget)"

    def processes(self) -> int:
        return getattr(self.state, "num_processes", 1)

    @classmethod
    def of(cls, accelerator: Any) -> "LoopFacts":
        def log(figures: dict, step: int) -> None:
            if getattr(accelerator, "trackers", None):  # initialised by init_trackers, maybe after prepare
                accelerator.log(figures, step=step)
        return cls(optimizers=lambda: getattr(accelerator, "_optimizers", []) or [],
                   accumulation=lambda: int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1),
                   state=accelerator, log=log)
