"""Random synthetic profiles for the solver's brute-force tests (hypothesis strategies)."""

from __future__ import annotations

from hypothesis import strategies as st

from lightning_remat import Costs, Profile, Segment, StageAction, StageOption, StageProfile

POLICIES = ("", "save_matmuls", "save_attention")


@st.composite
def random_profiles(draw, max_stages: int = 8, max_options: int = 3, policies: bool = False,
                    span_groups: bool = False) -> Profile:
    """Up to ``max_stages`` stages of up to ``max_options`` options ("keep", "whole", "o2"), with
    random stored bytes, local peaks and costs, and up to 4 segments. ``policies``: an option may
    recompute its stage under a selective-checkpointing policy instead. ``span_groups``: one or two
    groups of consecutive stages that may form multi-stage segments (a group may name a stage
    without "whole")."""
    n = draw(st.integers(1, max_stages))
    stages = []
    for i in range(n):
        options = []
        for j in range(draw(st.integers(1, max_options))):
            policy = "" if j == 0 or not policies else draw(st.sampled_from(POLICIES))
            options.append(StageOption(
                name=f"sac:{policy}" if policy else ["keep", "whole", "o2"][j],
                action=StageAction(f"s{i}") if j == 0 else StageAction.recompute(
                    f"s{i}", () if policy else (f"s{i}.o{j}",), policy),
                stored_bytes=draw(st.integers(0, 1000)), local_peak_bytes=draw(st.integers(0, 3000)),
                costs=Costs(0.0 if j == 0 else draw(st.floats(0.0, 10.0, allow_nan=False)),
                            0 if j == 0 else draw(st.integers(0, 1000)),
                            0.0 if j == 0 else draw(st.floats(0.0, 10.0, allow_nan=False)))))
        stages.append(StageProfile(f"s{i}", tuple(options)))
    segments = tuple(Segment(f"seg{k}", draw(st.integers(0, n)), draw(st.integers(0, 3000)))
                     for k in range(draw(st.integers(0, 4))))
    groups = []
    for _ in range(draw(st.integers(0, 2)) if span_groups else 0):
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a, n))
        groups.append(tuple(f"s{i}" for i in range(a, b)))
    return Profile(stages=tuple(stages), segments=segments, baseline_costs=Costs(time=10.0, flops=1000, roofline=10.0),
                   span_groups=tuple(groups))
