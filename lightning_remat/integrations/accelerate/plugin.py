"""``RematPlugin``: the settings of recomputation under Accelerate. Accelerate takes no third-party keys in its
config file or ``kwargs_handlers``, but ``accelerate launch`` passes the environment through: each is a variable."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Callable

from ...core.budget import Budget
from ...core.config import MAX_STEPS, DEFAULT_COST, ProfileOptions, RematConfig, normalize_candidates, check_policies
from ...core.vocabulary import CostKind

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
        for name in (f.name for f in fields(self)):
            variable = "ACCELERATE_REMAT_" + name.upper()  # ENV_BUDGET and the others
            given = getattr(self, name)
            value = given if given is not None else (os.environ.get(variable, "").strip() or None)
            try:  # the core's checks (RematConfig's) where it has them, the variables' text read first
                setattr(self, name, _CHECKS[name](value))
            except ValueError as err:
                origin = f"RematPlugin({name}={value!r})" if given is not None else f"{variable}={value!r}"
                raise ValueError(f"lightning-remat: invalid {origin}: {err}") from None

    @property
    def enabled(self) -> bool:
        return self.budget is not None

    def config(self) -> RematConfig:
        return RematConfig(self.budget, cost=self.cost, profile=ProfileOptions(
            candidates=self.candidates, offload=bool(self.offload), policies=self.policies,
            chunk_loss=bool(self.chunk_loss)))


def _budget(value: Any) -> Any:
    value = value.strip() if isinstance(value, str) else value
    if value is not None:
        Budget.parse(value)
    return value


def _steps(value: Any) -> int:
    text = str(value).strip()
    if value is not None and (isinstance(value, bool) or not text.isdigit() or not 1 <= int(text) <= MAX_STEPS):
        raise ValueError(f"expected a whole number of training steps, at least 1 and at most {MAX_STEPS}")
    return 1 if value is None else int(text)


def _flag(value: Any) -> bool:
    flag = str(value).strip().lower() if value is not None else "false"
    if flag not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError("expected 1/true/yes or 0/false/no")
    return flag in ("1", "true", "yes", "on")


# Unset: no budget (off), one step observed, the repeated blocks, the target's cost, no policies offered.
_CHECKS = {"budget": _budget, "profile_steps": _steps, "offload": _flag, "chunk_loss": _flag,
           "candidates": lambda value: None if value is None else list(normalize_candidates(value)),
           "cost": lambda value: DEFAULT_COST if value is None else CostKind.check(str(value).strip().lower()).value,
           "policies": lambda value: () if value is None else check_policies(value)}

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
