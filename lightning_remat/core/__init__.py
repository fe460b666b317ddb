"""The pure core (no torch): memory model, exact solver, plans, budgets, profile fits, errors."""

from .budget import Budget, format_bytes, parse_budget
from .config import ProfileOptions, RematConfig
from .errors import RematError
from .memory_model import Profile, Segment, StageOption, StageProfile, plan_cost, predict_peak
from .plan import Plan, StageAction, StageChoice
from .predict import Prediction, predict
from .solve import least_peak, plan_from_choices, solve, solve_recompute_everything
from .vocabulary import Action, CostKind, OptionKind, Policy, Precision

__all__ = ["Action", "Budget", "CostKind", "OptionKind", "Plan", "Policy", "Precision", "Prediction", "Profile",
           "ProfileOptions", "RematConfig", "RematError", "Segment", "StageAction", "StageChoice", "StageOption",
           "StageProfile", "format_bytes", "least_peak", "parse_budget", "plan_cost",
           "plan_from_choices", "predict", "predict_peak", "solve", "solve_recompute_everything"]
