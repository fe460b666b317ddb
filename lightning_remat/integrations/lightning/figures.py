"""The plan's pictures for Lightning loggers that take images (``docs/lightning.md``, "Figures reported")."""

from __future__ import annotations

from typing import Any, Iterable


def image_sink(logger: Any) -> Any:
    """How ``logger`` takes a matplotlib figure: ``sink(tag, figure, step)``, or None if it takes none.

    >>> image_sink(object()) is None
    True
    """
    if callable(getattr(logger, "log_image", None)):  # WandbLogger, NeptuneLogger, CometLogger
        return lambda tag, figure, step: logger.log_image(key=tag, images=[figure], step=step)
    experiment = getattr(logger, "experiment", None)
    if callable(getattr(experiment, "add_figure", None)):  # TensorBoardLogger's SummaryWriter
        return lambda tag, figure, step: experiment.add_figure(tag, figure, global_step=step)
    run_id = getattr(logger, "run_id", None)
    if callable(getattr(experiment, "log_figure", None)) and run_id:  # MLFlowLogger's MlflowClient
        return lambda tag, figure, step: experiment.log_figure(run_id, figure, f"{tag}_step{step}.png")
    return None


def log_plan_figures(loggers: Iterable[Any], shape_plans: Any, plan: Any, measured_peak_bytes: int | None,
                     step: int) -> list[str]:
    """Draw ``plan`` on its profile (``remat/pareto``) once if some logger takes images; the tags logged."""
    sinks = [sink for sink in (image_sink(logger) for logger in loggers) if sink is not None]
    profile = shape_plans.profile_of(plan) if sinks and shape_plans is not None and plan is not None else None
    if profile is None:
        return []
    try:
        import matplotlib  # noqa: F401 - the figures need it; without it, nothing is logged
    except ImportError:
        return []
    from ...report.plots import pareto_figure, pareto_sweep, pyplot

    figure = pareto_figure(pareto_sweep(profile, cost=plan.cost_kind), profile.baseline_peak_bytes, plan.cost_kind,
                           plan, measured_peak_bytes, "The plan: predicted peak vs overhead, and as measured")
    for sink in sinks:
        sink("remat/pareto", figure, step)
    pyplot().close(figure)
    return ["remat/pareto"]
